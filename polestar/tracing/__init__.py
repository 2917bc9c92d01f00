"""See a decoding: :func:`trace` decodes one prompt with one or two policies, records every step through the
engine's typed records (:class:`~polestar.state.StepRecord`, with the stages' :class:`~polestar.state.StepDetail`)
and draws what each policy did: when and how each position was committed, which positions each layer recomputed,
Polestar-Cache's cluster drift, Elastic-Cache's trigger layer and each step's cost. Modules: :mod:`.record`
(records → plain per-step values), :mod:`.figures` (→ figure data), :mod:`.html` (the self-contained page),
:mod:`.png` (the PNG figures), :mod:`.run` (the entry point)."""

from .run import Trace, trace

__all__ = ["Trace", "trace"]
