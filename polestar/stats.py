"""Counters of one generation run: forward passes, tokens per forward, throughput and compute spent."""

from __future__ import annotations

import attrs


@attrs.frozen
class SequenceStats:
    """Per-sequence counters: ``nfe`` forward passes that computed this sequence, ``tokens`` generated non-EOS
    tokens, ``token_layer_evals`` positions computed summed over layers and steps, ``tpf`` = tokens / nfe;
    ``error``: why the sequence stopped before finishing (non-finite logits), None when it decoded normally."""

    nfe: int
    tokens: int
    token_layer_evals: int
    error: str | None = None

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0


@attrs.frozen
class RunStats:
    """Run counters. ``nfe``: batched forward passes; ``tpf``: generated non-EOS tokens per sequence-forward
    (sum of tokens / sum of per-sequence ``nfe``; equals the paper's TPF at batch 1); ``tps``: generated non-EOS
    tokens per second of wall time; ``token_layer_evals``: positions actually computed, summed over steps,
    layers and sequences; ``sequences``: per-sequence :class:`SequenceStats`."""

    nfe: int
    tokens: int
    wall_s: float
    token_layer_evals: int
    sequences: tuple[SequenceStats, ...]

    @property
    def tpf(self) -> float:
        seq_nfe = sum(s.nfe for s in self.sequences)
        return self.tokens / seq_nfe if seq_nfe else 0.0

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def token_layer_evals_per_token(self) -> float:
        return self.token_layer_evals / max(self.tokens, 1)

    def as_dict(self) -> dict:
        return {
            "nfe": self.nfe,
            "tokens": self.tokens,
            "tpf": self.tpf,
            "tps": self.tps,
            "wall_s": self.wall_s,
            "token_layer_evals": self.token_layer_evals,
            "token_layer_evals_per_token": self.token_layer_evals_per_token,
            "per_sequence": [
                {"nfe": s.nfe, "tokens": s.tokens, "tpf": s.tpf, "token_layer_evals": s.token_layer_evals,
                 "error": s.error}
                for s in self.sequences
            ],
        }
