"""An offloader (kind ``offload``): stored rows kept in ordinary host memory, copied to the device on read.

Contract (by rows; ``rows [B, M]`` are long indices along dim 1): ``alloc(like)`` allocates, once, storage for a
tuple of leaves ``[B, N, ...]`` initialized to ``like``'s values; ``read_rows(stored, rows, device)`` -> the leaves
``[B, M, ...]`` on ``device``; ``write_rows(stored, rows, leaves [B, M, ...])`` scatters rows in place. A read or
write must not sync the host with the device in a compilable offloader; this one copies synchronously, so it
declares ``compilable = False`` (the step then runs eagerly).
Consumer: the ``polestar`` refresh selector's row store.
"""

import attrs

import polestar
from polestar.policies.offload import Offloader, gather_rows, scatter_rows_
from polestar.testing import check_stage


@polestar.register("offload", "host")
class HostOffload(Offloader):
    """Leaves ``[B, N, ...]`` live on the CPU; rows are gathered there and copied to the compute device."""

    compilable = False

    @attrs.frozen
    class Config:
        pass

    def alloc(self, like):
        return tuple(t.detach().to("cpu", copy=True) for t in like)

    def read_rows(self, stored, rows, device):
        return tuple(gather_rows(t, rows.cpu()).to(device) for t in stored)

    def write_rows(self, stored, rows, leaves):
        for buf, src in zip(stored, leaves):
            scatter_rows_(buf, rows.cpu(), src.cpu())


if __name__ == "__main__":
    check_stage("offload", "host", ["contract", "laws"])
    model = polestar.load("tiny-llada")
    out = polestar.generate(model, ["3+4*2-5"], task="arith", policy="polestar", offload="host")
    print(out.texts[0], out.pipeline.describe()["offload"])
