"""Build hook: the pytest files of ``bench/`` (pytest-benchmark tests and their conftest) stay out of the installed
``polestar.bench`` package; everything else is configured in pyproject.toml."""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """``build_py`` without the test modules (``test_*.py``, ``conftest.py``) of ``polestar.bench``."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != "polestar.bench":
            return modules
        return [m for m in modules if not (m[1].startswith("test_") or m[1] == "conftest")]


setup(cmdclass={"build_py": BuildPy})
