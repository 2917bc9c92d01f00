"""Training of the tiny shipped checkpoints (imported as ``polestar.training``).

Kept outside the runtime import path: nothing in ``polestar``, ``polestar.models`` or ``polestar.policies``
imports it, and it may depend on the benchmark tasks (``polestar.tasks``) that supply its training data.
Run it as ``python -m polestar.training.train`` (see :mod:`polestar.training.train`).
"""
