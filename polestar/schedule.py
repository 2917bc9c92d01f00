"""LLaDA's fixed per-step commit schedule of a block (used by the engine at every block start)."""

from __future__ import annotations

import torch


def transfer_counts(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's schedule (Nie et al. 2025, ``get_num_transfer_tokens``): the masked count of each row spread over
    ``steps`` steps, remainder first.

    ``masked [B, bl]`` bool → long ``[B, steps]`` summing to each row's masked count.
    """
    total = masked.sum(dim=1, keepdim=True)
    base, rem = total // steps, total % steps
    step_idx = torch.arange(steps, device=masked.device)
    return base + (step_idx[None, :] < rem).long()
