"""Log-likelihood of a continuation under a masked diffusion LM: LLaDA's Monte-Carlo masked-token bound.

A masked diffusion LM has no left-to-right factorisation; LLaDA (Nie et al., 2025, §2 and Appendix B.6; the
authors' ``eval_llada.py``) scores a continuation ``y`` (``T`` tokens) after a prefix ``c`` with the evidence
lower bound

    log p(y | c)  >=  - E_{k ~ U{1..T}} E_{S subset of y, |S| = k} [ (T / k) * sum_{i in S} -log p(y_i | c, y \\ S) ]

where ``y \\ S`` is ``y`` with the positions of ``S`` replaced by the mask token. :func:`masked_bound` estimates it
with ``mc_num`` random maskings drawn ``batch_size`` at a time (within a batch the mask counts are stratified
over ``1..T`` as in the reference), :func:`masked_bound_exact` computes it by enumerating every mask (tests, tiny
``T``), and :func:`greedy_matches` is the reference's ``is_check_greedy``: whether unmasking ``y`` one most-confident
token at a time reproduces it.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F


def _logits(model, ids: torch.Tensor, prompt_len: int, cfg: float, exclude_mask: bool = False) -> torch.Tensor:
    """Log-probabilities ``[B, L, V]`` (float32) of ``ids [B, L]``; with ``cfg`` > 0, classifier-free guidance
    against the same rows with the prompt masked: ``un + (cfg + 1) * (cond - un)`` on the logits.
    ``exclude_mask`` drops the mask token from the softmax (for predictions; the bound uses the full softmax,
    as the reference does)."""
    logits = model(ids).float()
    if cfg > 0:
        uncond = ids.clone()
        uncond[:, :prompt_len] = model.spec.mask_id
        un = model(uncond).float()
        logits = un + (cfg + 1.0) * (logits - un)
    if exclude_mask:
        logits[..., model.spec.mask_id] = float("-inf")  # the mask token is never a prediction
    return F.log_softmax(logits, dim=-1)


def sample_masks(target_len: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random masks over ``target_len`` positions → bool ``[batch, target_len]``.

    Row ``j`` masks ``k_j`` positions chosen uniformly, with ``k_j`` spread evenly over ``1..target_len`` from a
    random start ``k`` (``k_j = ((round(k + j * T / batch) - 1) mod T) + 1``, LLaDA's stratified draw), so each
    row's ``k_j`` is marginally uniform on ``1..T``.
    """
    T = target_len
    k = int(torch.randint(1, T + 1, (), generator=generator))
    counts = torch.round(torch.linspace(float(k), k + (batch - 1) * (T / batch), steps=batch)).long()
    counts = ((counts - 1) % T) + 1
    order = torch.rand(batch, T, generator=generator).argsort(dim=1)  # a random permutation per row
    return order < counts[:, None]


@torch.no_grad()
def masked_bound(model, prefix: list[int], target: list[int], mc_num: int = 128, batch_size: int = 32,
                 cfg: float = 0.0, generator: torch.Generator | None = None) -> float:
    """Monte-Carlo estimate of the masked-token lower bound on ``log p(target | prefix)`` (see module docstring).

    ``prefix``, ``target``: token ids (``target`` non-empty); ``mc_num`` maskings in batches of ``batch_size``
    (``mc_num`` must be a multiple of it); ``cfg``: classifier-free guidance scale (0 = off). Each batch is a
    ``[batch_size, len(prefix) + len(target)]`` forward. Returns a float (nats, ≤ 0 in expectation).
    """
    if not target:
        raise ValueError("the continuation is empty; a log-likelihood needs at least one continuation token")
    if mc_num % batch_size:
        raise ValueError(f"mc_num ({mc_num}) must be a multiple of batch_size ({batch_size})")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    device = model.device
    seq = torch.tensor(prefix + target, dtype=torch.long, device=device)
    P, T = len(prefix), len(target)
    y = seq[P:].expand(batch_size, T)
    losses = []
    for _ in range(mc_num // batch_size):
        masked = sample_masks(T, batch_size, generator).to(device)
        ids = seq.repeat(batch_size, 1)
        ids[:, P:] = torch.where(masked, model.spec.mask_id, y)
        logp = _logits(model, ids, P, cfg)[:, P:]
        nll = -logp.gather(-1, y[..., None]).squeeze(-1)  # [batch, T]
        weight = T / masked.sum(dim=1, keepdim=True).float()  # 1 / p_mask
        losses.append(float((nll * masked * weight).sum() / batch_size))
    return -sum(losses) / len(losses)


@torch.no_grad()
def masked_bound_exact(model, prefix: list[int], target: list[int], cfg: float = 0.0) -> float:
    """The bound :func:`masked_bound` estimates, computed by enumerating every non-empty mask of ``target``
    (``2**T - 1`` forwards; for tests with a few target tokens). Returns a float (nats)."""
    P, T = len(prefix), len(target)
    if not 1 <= T <= 10:
        raise ValueError(f"exact enumeration is for 1..10 continuation tokens, got {T}")
    seq = torch.tensor(prefix + target, dtype=torch.long, device=model.device)
    total = 0.0
    for k in range(1, T + 1):
        subsets = list(itertools.combinations(range(T), k))
        ids = seq.repeat(len(subsets), 1)
        for row, subset in enumerate(subsets):
            ids[row, [P + i for i in subset]] = model.spec.mask_id
        logp = _logits(model, ids, P, cfg)[:, P:]
        nll = -logp.gather(-1, seq[P:].expand(len(subsets), T)[..., None]).squeeze(-1)
        masked = ids[:, P:] == model.spec.mask_id
        per_subset = (nll * masked).sum(dim=1) * (T / k)
        total += float(per_subset.mean()) / T  # k uniform on 1..T, the subset uniform among those of size k
    return -total


@torch.no_grad()
def greedy_matches(model, prefix: list[int], target: list[int], cfg: float = 0.0) -> bool:
    """Whether greedy unmasking reproduces ``target``: start from ``prefix`` + ``len(target)`` masks and, ``T``
    times, commit the single most confident prediction (LLaDA's ``is_check_greedy``); ``T`` forwards of
    ``[1, len(prefix) + len(target)]``."""
    P, T = len(prefix), len(target)
    mask_id = model.spec.mask_id
    ids = torch.tensor([prefix + [mask_id] * T], dtype=torch.long, device=model.device)
    for _ in range(T):
        masked = ids[0, P:] == mask_id
        logp = _logits(model, ids, P, cfg, exclude_mask=True)[0, P:]
        conf, pred = logp.max(dim=-1)
        conf = conf.masked_fill(~masked, -math.inf)
        pos = int(conf.argmax())
        ids[0, P + pos] = pred[pos]
    return ids[0, P:].tolist() == list(target)
