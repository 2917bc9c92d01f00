"""See a decoding: :func:`trace` decodes one prompt with one or two policies, records every step through the
engine's typed records (:class:`~polestar.state.StepRecord`, with the stages' :class:`~polestar.state.StepDetail`)
and draws what each policy did: when and how each position was committed, which positions each layer recomputed,
each step's cost, and the figures the stages add of their own (:mod:`.stage_figure`: Polestar-Cache's cluster
drift, Elastic-Cache's trigger layer). Modules: :mod:`.record` (records → plain per-step values), :mod:`.figures`
(→ figure data), :mod:`.html` (the self-contained page), :mod:`.png` (the PNG figures), :mod:`.run` (the entry
point). ``trace`` and ``Trace`` are imported on first use, so a stage module can import the drawing helpers without
the decoding entry point."""

__all__ = ["Trace", "trace"]


def __getattr__(name: str):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
