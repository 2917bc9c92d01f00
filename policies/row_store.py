"""PLACEHOLDER (replaced by the issue-15a branch): row-addressable store with the final interface."""

from __future__ import annotations

import torch


class RowStore:
    def __init__(self, quant, offload, n_layers, batch, n_rows, dim, device, dtype):
        self.quant, self.n_rows, self.dtype = quant, n_rows, dtype
        self.values = [torch.zeros(batch, n_rows + 1, dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.anchor: list = [None] * n_layers

    def write_all(self, layer, values, anchor=None):
        B, N, d = values.shape
        if self.quant.lossless or anchor is None:
            self.anchor[layer] = None
            payload = values
        else:
            self.anchor[layer] = torch.cat([anchor, anchor.new_zeros(B, 1, d)], 1)
            payload = values - anchor
        self.values[layer][:, :N] = self.quant.decode(self.quant.encode(payload.contiguous())).to(self.dtype)

    def read(self, layer, rows):
        d = self.values[layer].shape[-1]
        idx = rows[..., None].expand(-1, -1, d)
        out = self.values[layer].gather(1, idx)
        a = self.anchor[layer]
        return out if a is None else out + a.gather(1, idx)

    def write(self, layer, rows, valid, values):
        d = values.shape[-1]
        rows = torch.where(valid, rows, self.n_rows)
        a = self.anchor[layer]
        idx = rows[..., None].expand(-1, -1, d)
        payload = values.to(self.dtype) if a is None else values.to(self.dtype) - a.gather(1, idx)
        payload = self.quant.decode(self.quant.encode(payload.contiguous())).to(self.dtype)
        self.values[layer].scatter_(1, idx, payload)

    def read_all(self, layer):
        return self.read(layer, torch.arange(self.n_rows, device=self.values[layer].device)[None].expand(
            self.values[layer].shape[0], -1))
