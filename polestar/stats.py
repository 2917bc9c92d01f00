"""Counters of one generation run: forward passes, tokens per forward, throughput and compute spent."""

from __future__ import annotations

import sys

import attrs


@attrs.frozen
class SequenceStats:
    """Per-sequence counters: ``nfe`` forward passes that computed this sequence, ``tokens`` generated non-EOS
    tokens, ``token_layer_evals`` this sequence's own positions (not left padding) that went through a layer's
    MLP, plan slots and sparse-update members, summed over layers and steps while the sequence was decoding (the
    run's total in :class:`RunStats` also counts padding, unused buffer slots and frozen rows, so the sum of these
    is at most the total and, unlike it, does not depend on the batch), ``tpf`` = tokens / nfe,
    ``error``: why decoding of this sequence stopped early (e.g. non-finite logits), None when it finished;
    ``revoked``: committed tokens the commit rule took back (masked again, e.g. WINO's narrow-out), counted beside
    ``tokens``, which counts only the final ones."""

    nfe: int
    tokens: int
    token_layer_evals: int
    error: str | None = None
    revoked: int = 0

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0


@attrs.frozen
class RunStats:
    """Run counters. ``nfe``: batched forward passes; ``tpf``: generated non-EOS tokens per sequence-forward
    (sum of tokens / sum of per-sequence ``nfe``; equals the paper's TPF at batch 1); ``tps``: generated non-EOS
    tokens per second of wall time; ``token_layer_evals``: every row that went through a layer's MLP (the block's
    plan slots, padding and rows of finished sequences included, and the rows of a sparse update's fixed-capacity
    member buffer), summed over steps, layers and sequences; ``proxy_query_evals``: query-only rows (Polestar's
    centroid proxies, Elastic-Cache's tracked keys, dLLM-Cache's value probes) summed over steps, layers and
    sequences; ``weight_bytes``: bytes of weights read, summed over steps (each projection call reads its whole
    weight once; embedding lookups read their rows; the LM head once per call); ``kv_bytes``: bytes of cached K/V
    read by attention (proxy attention reads K only); ``sequences``: per-sequence :class:`SequenceStats`;
    ``compile_s``: seconds spent compiling (``torch.compile``) during the run, excluded from ``wall_s`` and so
    from ``tps``; ``compiled_steps``: steps that ran as one compiled graph (one CUDA-graph replay on CUDA), the
    other ``nfe - compiled_steps`` ran eagerly; ``revoked``: committed tokens the commit rule took back, summed
    over sequences (``tokens`` and ``tpf`` count only final tokens; ``revoked / tokens`` is the revocation rate)."""

    nfe: int
    tokens: int
    wall_s: float
    token_layer_evals: int
    sequences: tuple[SequenceStats, ...]
    compile_s: float = 0.0
    weight_bytes: int = 0
    kv_bytes: int = 0
    proxy_query_evals: int = 0
    compiled_steps: int = 0
    revoked: int = 0

    @property
    def errors(self) -> list[tuple[int, str]]:
        """``(sequence index, error)`` of every sequence that stopped with an error."""
        return [(i, s.error) for i, s in enumerate(self.sequences) if getattr(s, "error", None)]

    @classmethod
    def merge(cls, runs: list[RunStats]) -> RunStats:
        """The counters of consecutive runs (batches) as one run: sums, sequences concatenated."""
        return cls(
            nfe=sum(r.nfe for r in runs), tokens=sum(r.tokens for r in runs), wall_s=sum(r.wall_s for r in runs),
            token_layer_evals=sum(r.token_layer_evals for r in runs),
            sequences=tuple(s for r in runs for s in r.sequences), compile_s=sum(r.compile_s for r in runs),
            weight_bytes=sum(r.weight_bytes for r in runs), kv_bytes=sum(r.kv_bytes for r in runs),
            proxy_query_evals=sum(r.proxy_query_evals for r in runs),
            compiled_steps=sum(r.compiled_steps for r in runs), revoked=sum(r.revoked for r in runs),
        )

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

    @property
    def sequence_token_layer_evals(self) -> int:
        """The sequences' own token-layer evaluations (sum of :attr:`SequenceStats.token_layer_evals`)."""
        return sum(s.token_layer_evals for s in self.sequences)

    @property
    def weight_bytes_per_token(self) -> float:
        return self.weight_bytes / max(self.tokens, 1)

    @property
    def weight_bytes_per_step(self) -> float:
        """Weight bytes per batched forward pass (``weight_bytes / nfe``)."""
        return self.weight_bytes / max(self.nfe, 1)

    def as_dict(self) -> dict:
        return {
            "nfe": self.nfe,
            "tokens": self.tokens,
            "tpf": self.tpf,
            "tps": self.tps,
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "token_layer_evals": self.token_layer_evals,
            "token_layer_evals_per_token": self.token_layer_evals_per_token,
            "sequence_token_layer_evals": self.sequence_token_layer_evals,
            "proxy_query_evals": self.proxy_query_evals,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_per_token": self.weight_bytes_per_token,
            "weight_bytes_per_step": self.weight_bytes_per_step,
            "kv_bytes": self.kv_bytes,
            "revoked": self.revoked,
            "per_sequence": [
                {"nfe": s.nfe, "tokens": s.tokens, "tpf": s.tpf, "token_layer_evals": s.token_layer_evals,
                 "error": s.error, "revoked": s.revoked}
                for s in self.sequences
            ],
        }


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (TorchDynamo's own timer of every frame
    compile, backend included). The difference across a run is that run's compile time. A process that has not
    imported dynamo has compiled nothing: 0.0, without importing it (~1.5 s that a command running eagerly does not
    pay)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - every supported torch has it
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
