"""The certainty density of "d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive Caching": at each
generation position, the Gaussian-weighted share of positions already decoded. d2Cache's refresh selector and the
certainty-prior commit rule both weigh confidences by it.

Computed exactly, as a linear map of the decoded indicator (float64); the released code convolves a canvas of ``3G``
positions by FFT in float32 (``G`` decoded positions left of the generation, the generation, ``G`` copies of its last
entry), whose last bits differ. Shapes: ``decoded [B, G]`` bool → ``[B, G]`` float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DensityKernel(NamedTuple):
    """The certainty density as a linear map of the decoded indicator over ``G`` generation positions (float64):
    ``weights [G, G]`` of the generation's own positions, ``left [G]`` the weight of the decoded side left of it,
    ``right [G]`` the weight of the side right of it (which counts as the last position does)."""

    weights: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor


def density_kernel(G: int, sigma: float, device) -> DensityKernel:
    """:class:`DensityKernel` of a Gaussian of width ``sigma``: the weight of offset ``d`` is
    ``exp(-d² / 2 sigma²)``, normalised by the kernel's weight over the offsets ``-3G .. 3G - 1`` (the released code's
    FFT canvas: ``G`` decoded positions, the generation, ``G`` copies of its last entry, padded to ``6 G``)."""
    g = torch.arange(G, dtype=torch.float64, device=device)

    def weight(d: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(d * d) / (2 * sigma**2))

    total = weight(torch.arange(-3 * G, 3 * G, dtype=torch.float64, device=device)).sum()
    side = torch.arange(1, G + 1, dtype=torch.float64, device=device)  # distances 1 .. G beyond an edge
    left = weight(g[:, None] + side[None, :]).sum(dim=1)
    right = weight((G - 1 - g)[:, None] + side[None, :]).sum(dim=1)
    return DensityKernel(weight(g[:, None] - g[None, :]) / total, left / total, right / total)


def certainty_density(decoded: torch.Tensor, kernel: DensityKernel) -> torch.Tensor:
    """``decoded [B, G]`` bool → float64 ``[B, G]``: at each position the Gaussian-weighted share of decoded positions
    (:func:`density_kernel`; left of the generation counts as decoded, right of it as the last position)."""
    d = decoded.to(torch.float64)
    return d @ kernel.weights.T + kernel.left + d[:, -1:] * kernel.right
