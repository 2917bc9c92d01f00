"""``python -m polestar.bench.compile_cost``: a cold compiled decode in a child process, its CPU seconds counted and its
tokens checked against eager decoding."""

import pytest

from polestar.bench import compile_cost


def test_compile_value_reads_true_and_names():
    assert compile_cost.compile_value("true") is True and compile_cost.compile_value("aot_eager") == "aot_eager"


@pytest.mark.slow
def test_a_cold_compiled_decode_is_measured_in_a_child_and_equals_eager(capsys):
    r = compile_cost.measure_cold("fast-dllm", 1, "eager", warm=True)
    assert r.equal and r.cpu_s > 0 and r.compile_s > 0 and r.warm_ms > 0
    compile_cost.main(["--policies", "fast-dllm", "--layers", "1", "--compile", "eager"])
    assert "= eager (1.00x)" in capsys.readouterr().out
