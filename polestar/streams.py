"""Side-stream overlap for the drift machinery (Polestar's system design).

On CUDA, work that only the *next* step consumes (clustering, residual quantization, proxy attention at a block
start; prefetching offloaded members) is issued on a side stream that first waits for the main stream, and the
main stream waits for it (``join``) before the consumer runs; tensors crossing streams are recorded on the stream
that uses them so the caching allocator does not reuse their memory early. On CPU every call is a no-op and the
work runs serially in program order.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """A side stream on ``device`` (None on CPU). ``with side.run(*inputs):`` issues work on it;
    ``side.join(*outputs)`` makes the current stream wait for it."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending = False

    def run(self, *inputs: torch.Tensor):
        """Issue the enclosed work on the side stream (a no-op on CPU and inside a compiled step, where the
        graph itself orders the work)."""
        if torch.compiler.is_compiling() or self.stream is None or torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()  # a captured graph orders the work on the capturing stream
        return self._run(*inputs)

    @contextlib.contextmanager
    def _run(self, *inputs: torch.Tensor):
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        for t in inputs:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        self._pending = True

    def join(self, *outputs: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or self.stream is None or not self._pending:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        for t in outputs:
            t.record_stream(main)
        self._pending = False
