"""Count the device-to-host reads Python code makes: every call of a ``torch.Tensor`` method that turns a tensor's
value into a Python value (``__bool__``, ``item``, ``tolist``, ``nonzero`` and friends)."""

from __future__ import annotations

import contextlib

import torch

READ_METHODS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "numpy", "any_nonzero")


@contextlib.contextmanager
def count_host_reads():
    """``with count_host_reads() as reads: ...`` — ``reads`` is a list of the method names called, in order."""
    reads: list[str] = []
    saved = {}
    for name in READ_METHODS:
        original = getattr(torch.Tensor, name, None)
        if original is None:
            continue
        saved[name] = original

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    try:
        yield reads
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
