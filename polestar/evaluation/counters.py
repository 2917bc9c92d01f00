"""Decoding counters summed over an evaluation run (every ``generate`` call of the lm-eval model)."""

from __future__ import annotations

import attrs

from polestar.stats import RunStats


@attrs.define
class DecodingCounters:
    """Running sums over many :class:`~polestar.stats.RunStats` (defined in docs/performance.md, "Counters").

    ``nfe``: batched forward passes; ``sequence_nfe``: forward passes summed over sequences (the paper's NFE at
    batch 1); ``tokens``: generated non-EOS tokens; ``wall_s``: decoding wall time; ``token_layer_evals``: rows
    computed summed over layers, steps and sequences (padding and frozen rows included);
    ``sequence_token_layer_evals``: the sequences' own rows (independent of how requests were batched);
    ``proxy_query_evals``: query-only probe rows summed over
    layers, steps and sequences; ``weight_bytes``: weight bytes read, summed over steps; ``kv_bytes``: cached
    K/V bytes read by attention; ``sequences``: generations; ``loglikelihood_forwards``: batched forwards spent
    on log-likelihood requests (not part of TPF/TPS, nor of the byte counters).
    """

    nfe: int = 0
    sequence_nfe: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    token_layer_evals: int = 0
    sequence_token_layer_evals: int = 0
    sequences: int = 0
    loglikelihood_forwards: int = 0
    proxy_query_evals: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0

    def add(self, stats: RunStats) -> None:
        """Add one generation run's counters."""
        self.nfe += stats.nfe
        self.sequence_nfe += sum(s.nfe for s in stats.sequences)
        self.tokens += stats.tokens
        self.wall_s += stats.wall_s
        self.token_layer_evals += stats.token_layer_evals
        self.sequence_token_layer_evals += stats.sequence_token_layer_evals
        self.sequences += len(stats.sequences)
        self.proxy_query_evals += stats.proxy_query_evals
        self.weight_bytes += stats.weight_bytes
        self.kv_bytes += stats.kv_bytes

    @classmethod
    def total(cls, parts: list[DecodingCounters]) -> DecodingCounters:
        """Sum of several counters (e.g. one per rank)."""
        out = cls()
        for p in parts:
            for f in attrs.fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(p, f.name))
        return out

    def as_dict(self) -> dict:
        """The sums plus ``tpf`` (tokens / sequence_nfe), ``tps`` (tokens / wall_s; with several ranks, per
        process), ``token_layer_evals_per_token``, ``sequence_token_layer_evals_per_token``,
        ``weight_bytes_per_token``, ``weight_bytes_per_step`` (weight_bytes / nfe), ``kv_bytes_per_token`` and
        ``proxy_query_evals_per_token``."""
        out = attrs.asdict(self)
        tokens = max(self.tokens, 1)
        out["tpf"] = self.tokens / self.sequence_nfe if self.sequence_nfe else 0.0
        out["tps"] = self.tokens / self.wall_s if self.wall_s > 0 else 0.0
        out["token_layer_evals_per_token"] = self.token_layer_evals / tokens
        out["sequence_token_layer_evals_per_token"] = self.sequence_token_layer_evals / tokens
        out["weight_bytes_per_token"] = self.weight_bytes / tokens
        out["weight_bytes_per_step"] = self.weight_bytes / max(self.nfe, 1)
        out["kv_bytes_per_token"] = self.kv_bytes / tokens
        out["proxy_query_evals_per_token"] = self.proxy_query_evals / tokens
        return out
