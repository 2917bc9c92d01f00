"""Run Research dLLM's own decoding code (the d2Cache repository: ``src/generation``, ``src/cache``, its LLaDA
and Dream classes) on this library's shipped tiny checkpoints, so its decoding methods can be compared token by
token with this library's policies (``bench/research_dllm_compare.py``).

Two steps, one file:

1. ``prompts`` -- run with this library's environment: the problems of ``polestar bench --task T --n N`` (same
   draw: :func:`polestar.problems.load_problems`), formatted by the task and encoded exactly as ``polestar bench``
   encodes them (:func:`polestar.api.encode_prompts`), written to a JSON file::

       /work/venv213/bin/python bench/research_dllm.py prompts --model tiny-llada --task arith --n 100 \\
           --out prompts.json

2. ``run`` -- run with an environment that has the peer's requirements (torch, transformers 4.52.4, loguru,
   omegaconf, hydra-core, accelerate, python-dotenv, dill, pydantic, lm-eval) and the peer's checkout::

       /work/venv-rdllm/bin/python bench/research_dllm.py run --peer-root /path/to/d2Cache \\
           --checkpoint models/checkpoints/tiny-llada --prompts prompts.json \\
           --strategy threshold --threshold 0.9 --cache dual --out peer.json

   (``--peer-root`` defaults to ``$RESEARCH_DLLM_ROOT``.) Without ``--prompts`` the run step calls step 1 itself
   with ``--polestar-python`` (default ``/work/venv213/bin/python``).

Decoding: batch 1, float32, greedy (temperature 0), one torch thread, ``--gen-length`` 64 and ``--block-length``
16 by default, every block decoded (the peer never stops at EOS; compare with ``polestar bench --no-stop-at-eos``).
Methods (``--strategy``), each the peer's ``generate(strategy=...)`` with its own keyword arguments:

* ``vanilla``: ``num_transfer_tokens`` most confident tokens per step (LLaDA's low-confidence remasking);
* ``threshold``: Fast-dLLM parallel decoding, ``threshold=``;
* ``factor``: Fast-dLLM factor rule, ``factor=``;
* ``eb``: EB-Sampler, ``gamma=``;
* ``pc_sampler``: PC-Sampler, ``debias=True, clip_alpha=`` (see the shim below);
* ``klass``: the peer's ``klass`` strategy, ``kl_threshold=``, ``kl_history_length=`` (and ``threshold=`` when
  given: without it the peer's stable set is always empty and every step commits the fallback top-k);
* ``wino``: the peer's ``wino`` strategy, ``wide_in_thres=``, ``narrow_out_thres=``.

``--sigma`` adds the peer's certainty prior to any of them. Caches (``--cache``): ``none``, ``prefix``
(``PrefixCache``), ``dual`` (``PrefixCache(use_dual=True)``), ``dllm`` (``dLLMCache(kp, kr, rou)``), ``d2cache``
(``d2Cache(rollout_p, current_k, sigma, inflate_w)``; it needs attention weights, so the model runs with the
peer's ``eager`` attention then).

Output JSON: the settings, and per item its index, input, prompt ids, the ``gen_length`` generated ids, the
number of model forwards (a forward hook on the model), ``mask_ids_left`` (mask ids among the final tokens:
seen with the peer's ``wino`` on tiny-llada, whose proposals come from a softmax that includes the mask token;
the decoded text drops them as special tokens), ``mlp_rows`` (rows through each layer's MLP -- the
input rows of its first MLP projection -- summed over layers and forwards, the count ``polestar bench`` reports
as ``sequence_token_layer_evals``) and ``q_rows`` (query rows through each layer's attention, the input rows of
its query projection, likewise summed).

Loading: the peer's ``LLaDAModelLM`` / ``DreamModel`` built from the checkpoint's ``config.json`` and filled from
``model.safetensors`` with a strict ``load_state_dict`` (no missing or unexpected key).

Shims (each one forced by the peer's API on these checkpoints; nothing else of the peer is changed):

* ``MASK_TOKEN_ID`` is set in the environment from the checkpoint's config (the peer's caches and ``Frame`` read
  the mask id only from there). Configuration, not a change of behaviour.
* ``PAD_TOKEN_ID`` likewise (``wino`` reads ``pad_token_id or $PAD_TOKEN_ID`` and refuses a missing one, so the
  tiny checkpoints' pad id 0 counts as missing when passed as an argument). The prompts hold no id 0, so the
  attention mask it builds is all ones.
* ``lm_eval`` (imported by the peer's package ``__init__`` through its evaluation wrappers, never used by
  decoding): when the installed lm-eval cannot be imported, two empty stand-in modules
  (``lm_eval.api.model.TemplateLM``, ``lm_eval.api.instance.Instance``) are registered so that ``src.models``
  imports. With lm-eval installed (the venv has it) this shim is inactive; the JSON says which.
* PC-Sampler's debias table: the peer's token-frequency table (``src/third_party/llada_corpus.json`` /
  ``dream_corpus.json``) counts token ids of LLaDA-8B's / Dream-7B's 126k/152k vocabularies; scattering it into a
  table of a 49-token vocabulary fails (index out of range). The peer builds this table at every forward
  (``prepare_logits_for_generation``), whatever the strategy, so every run needs the shim; only PC-Sampler
  (``debias=True``) reads the table. The shim replaces ``get_token_freq`` with the same
  construction (count / num_token, background 1 / num_token) over ``--token-freq FILE`` (same JSON layout:
  ``{"num_token": N, "p_baseline_dict": {id: count}}``) when given, else over the peer's table with the ids the
  small vocabulary lacks dropped (whose frequencies then describe other tokens: only a smoke test).
* KLASS: the peer keeps ``prev_probs`` (and ``kl_history``) in float64 buffers and stores the step's float32
  probabilities into them with an index put (``prev_probs[active_index] = curr_probs``), which torch refuses
  ("Index put requires the source and destination dtypes match"). The shim wraps the ``generate_step`` that the
  peer's ``klass`` module calls so that the returned ``delta.extra["curr_probs"]`` is cast to float64 first: the
  value stored is exactly what a dtype-converting copy would store, the KL is still computed in float64 against
  float32 current probabilities, as the peer's code computes it.
* EB-Sampler: the peer takes ``torch.cummax(entropy, dim=0)`` -- over the batch dimension -- where the paper
  subtracts the running maximum over the sorted tokens (dim 1). At batch 1 the cummax over dim 0 is the entropy
  itself, so the peer's bound reads "sum of the entropies before the k-th token <= gamma". Not an API obstacle, so
  not shimmed by default; ``--eb-cummax-tokens`` replaces ``confidence_unmasking``'s ``torch.cummax`` call by one
  over dim 1 (the paper's rule) to measure the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("vanilla", "threshold", "factor", "eb", "pc_sampler", "klass", "wino")
CACHES = ("none", "prefix", "dual", "dllm", "d2cache")


# ----------------------------------------------------------------------------------------------------------------
# step 1: the problems and prompt ids, with this library
# ----------------------------------------------------------------------------------------------------------------

def dump_prompts(model_name: str, task_name: str, n: int, out: str) -> None:
    """The problems ``polestar bench --model M --task T --n N`` decodes, with the prompt ids it feeds the model."""
    import polestar
    from polestar.api import encode_prompts
    from polestar.problems import load_problems
    from polestar.tasks import get_task

    model = polestar.load(model_name)
    task = get_task(task_name)
    items = []
    for i, prob in enumerate(load_problems(task_name, n)):
        ids, _ = encode_prompts(model, [task.format_prompt(prob.input)])
        items.append({"index": i, "input": prob.input, "output": prob.output, "prompt_ids": ids[0].tolist()})
    spec = model.spec
    Path(out).write_text(json.dumps({"model": model_name, "task": task_name, "n": n, "mask_id": int(spec.mask_id),
                                     "eos_id": int(spec.eos_id), "items": items}))


# ----------------------------------------------------------------------------------------------------------------
# step 2: the peer's code
# ----------------------------------------------------------------------------------------------------------------

def _lm_eval_shim() -> bool:
    """Register stand-in ``lm_eval.api.model`` / ``lm_eval.api.instance`` modules when lm-eval cannot be imported;
    True when the shim was needed."""
    try:
        import lm_eval.api.instance  # noqa: F401
        import lm_eval.api.model  # noqa: F401
        return False
    except ImportError:
        pass
    root, api = types.ModuleType("lm_eval"), types.ModuleType("lm_eval.api")
    model, instance = types.ModuleType("lm_eval.api.model"), types.ModuleType("lm_eval.api.instance")
    model.TemplateLM = type("TemplateLM", (), {})
    instance.Instance = type("Instance", (), {})
    root.api, api.model, api.instance = api, model, instance
    sys.modules.update({"lm_eval": root, "lm_eval.api": api, "lm_eval.api.model": model,
                        "lm_eval.api.instance": instance})
    return True


def import_peer(peer_root: str):
    """The peer's ``src`` package (its root put first on ``sys.path``)."""
    sys.path.insert(0, str(Path(peer_root).resolve()))
    shimmed = _lm_eval_shim()
    import src.generation  # noqa: F401  (registers the strategies)
    import src.models  # noqa: F401
    return shimmed


def load_peer_model(checkpoint: Path, attn: str):
    """The peer's model class for ``checkpoint/config.json``, weights loaded strictly from model.safetensors."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    kind = cfg["model_type"].lower()
    if kind == "llada":
        from src.models.llada import LLaDAConfig, LLaDAModelLM
        config = LLaDAConfig(**cfg)
        config._attn_implementation = attn
        model = LLaDAModelLM(config)
    elif kind == "dream":
        from src.models.dream import DreamConfig, DreamModel
        config = DreamConfig(**cfg)
        config._attn_implementation = attn
        model = DreamModel(config)
    else:
        raise ValueError(f"unsupported model_type {cfg['model_type']!r}")
    state = load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict(state, strict=True)
    return model.to(torch.float32).eval(), cfg, kind


class RowCounter:
    """Forward hooks: model forwards, and rows through each layer's query projection and first MLP projection."""

    def __init__(self, model, kind: str):
        self.forwards = self.q_rows = self.mlp_rows = 0
        self.handles = [model.register_forward_hook(self._forward)]
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if (kind == "llada" and leaf == "q_proj") or (kind == "dream" and name.endswith("self_attn.q_proj")):
                self.handles.append(mod.register_forward_hook(self._q))
            if (kind == "llada" and leaf == "ff_proj") or (kind == "dream" and name.endswith("mlp.gate_proj")):
                self.handles.append(mod.register_forward_hook(self._mlp))

    @staticmethod
    def _rows(t) -> int:
        return t.numel() // t.shape[-1]

    def _forward(self, mod, args, out):
        self.forwards += 1

    def _q(self, mod, args, out):
        self.q_rows += self._rows(args[0])

    def _mlp(self, mod, args, out):
        self.mlp_rows += self._rows(args[0])

    def reset(self):
        self.forwards = self.q_rows = self.mlp_rows = 0


def _token_freq_shim(token_freq_file: str | None):
    """A ``get_token_freq`` for a small vocabulary (see the module docstring)."""
    import torch

    @functools.lru_cache
    def get_token_freq(model_family: str, model_vocab_size: int):
        path = Path(token_freq_file) if token_freq_file else (
            Path(sys.modules["src.third_party"].__file__).parent / f"{model_family}_corpus.json")
        if not path.exists():
            return None
        corpus = json.loads(path.read_text())
        num_token = corpus["num_token"]
        freqs = torch.full((model_vocab_size,), 1 / num_token)
        for token_id, count in corpus["p_baseline_dict"].items():
            if int(token_id) < model_vocab_size:
                freqs[int(token_id)] = count / num_token
        return freqs

    return get_token_freq


@contextlib.contextmanager
def _cummax_over_tokens():
    """``torch.cummax(x, dim=0)`` inside the peer's ``confidence_unmasking`` taken over dim 1 instead."""
    import src.generation.vanilla as vanilla
    import torch

    real = torch.cummax
    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.cummax = lambda x, dim: real(x, dim=1 if dim == 0 else dim)
    vanilla.torch = proxy
    try:
        yield
    finally:
        vanilla.torch = torch


def _klass_store_shim() -> None:
    """Cast the step's probabilities to float64 before the peer's KLASS loop stores them (module docstring)."""
    import src.generation.klass as klass
    import torch

    real = klass.generate_step

    @functools.wraps(real)
    def generate_step(*args, **kwargs):
        delta = real(*args, **kwargs)
        if delta is not None and "curr_probs" in delta.extra:
            delta.extra["curr_probs"] = delta.extra["curr_probs"].to(torch.float64)
        return delta

    klass.generate_step = generate_step


def peer_kwargs(args, mask_id: int, eos_id: int) -> tuple[str, dict]:
    """The peer's strategy name and ``generate`` keyword arguments for ``args``."""
    kw = dict(gen_length=args.gen_length, block_length=args.block_length,
              num_transfer_tokens=args.num_transfer_tokens, temperature=0.0, mask_token_id=mask_id,
              eos_token_id=eos_id, stop_until_eos=False)
    if args.sigma is not None:
        kw["sigma"] = args.sigma
    strategy = "vanilla"
    if args.strategy == "threshold":
        kw["threshold"] = args.threshold
    elif args.strategy == "factor":
        kw["factor"] = args.factor
    elif args.strategy == "eb":
        kw["gamma"] = args.gamma
    elif args.strategy == "pc_sampler":
        kw.update(debias=True, clip_alpha=args.clip_alpha)
    elif args.strategy == "klass":
        strategy = "klass"
        kw.update(kl_threshold=args.kl_threshold, kl_history_length=args.kl_history_length)
        if args.threshold is not None:
            kw["threshold"] = args.threshold
    elif args.strategy == "wino":
        strategy = "wino"
        kw.update(wide_in_thres=args.wide_in, narrow_out_thres=args.narrow_out)
    return strategy, kw


def cache_class(args):
    """The peer's cache class for ``--cache`` with its options bound, or None."""
    from src.cache import PrefixCache, d2Cache, dLLMCache

    if args.cache == "none":
        return None
    if args.cache in ("prefix", "dual"):
        return functools.partial(PrefixCache, use_dual=args.cache == "dual")
    if args.cache == "dllm":
        return functools.partial(dLLMCache, kp=args.kp, kr=args.kr, rou=args.rou)
    return functools.partial(d2Cache, rollout_p=args.rollout_p, current_k=args.current_k, sigma=args.d2_sigma,
                             inflate_w=args.inflate_w)


def run_peer(args) -> dict:
    import torch

    torch.set_num_threads(1)
    peer_root = args.peer_root or os.environ.get("RESEARCH_DLLM_ROOT")
    if not peer_root:
        raise SystemExit("pass --peer-root or set RESEARCH_DLLM_ROOT to the peer's checkout")
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        checkpoint = REPO / "models" / "checkpoints" / args.checkpoint
    prompts_path = args.prompts
    if prompts_path is None:
        prompts_path = str(Path(args.out).with_suffix(".prompts.json"))
        subprocess.run([args.polestar_python, __file__, "prompts", "--model", str(checkpoint), "--task", args.task,
                        "--n", str(args.n), "--out", prompts_path], check=True, cwd=REPO)
    prompts = json.loads(Path(prompts_path).read_text())
    cfg = json.loads((checkpoint / "config.json").read_text())
    mask_id, eos_id = int(cfg["mask_token_id"]), int(cfg["eos_token_id"])
    if (prompts.get("mask_id"), prompts.get("eos_id")) != (mask_id, eos_id):
        raise SystemExit(f"{prompts_path} was made for another tokenizer (mask/eos ids differ)")
    os.environ["MASK_TOKEN_ID"] = str(mask_id)  # the peer's caches and Frame read it from here
    os.environ["PAD_TOKEN_ID"] = str(cfg.get("pad_token_id", eos_id))  # wino: `pad_token_id or $PAD_TOKEN_ID`
    shims = {"lm_eval_stub": import_peer(peer_root)}
    import src.generation.utils as gen_utils
    from src.generation import generate

    # the peer builds the table at every forward, whatever the strategy (prepare_logits_for_generation)
    gen_utils.get_token_freq = _token_freq_shim(args.token_freq)
    shims["token_freq"] = args.token_freq or "peer corpus, ids >= vocab dropped"
    if args.strategy == "klass":
        _klass_store_shim()
        shims["klass_store"] = "curr_probs cast to float64 before the index put"
    model, _, kind = load_peer_model(checkpoint, "eager" if args.cache == "d2cache" else "sdpa")
    counter = RowCounter(model, kind)
    strategy, kw = peer_kwargs(args, mask_id, eos_id)
    cls = cache_class(args)
    if cls is not None and strategy == "wino":
        raise SystemExit("the peer's wino strategy takes no cache (its generate has no cache_cls); pass --cache none")
    cache_kw = {} if strategy == "wino" else {"cache_cls": cls}
    eb_ctx = _cummax_over_tokens if args.eb_cummax_tokens else contextlib.nullcontext
    if args.eb_cummax_tokens:
        shims["eb_cummax"] = "dim 1 (tokens)"
    items = []
    start = time.perf_counter()
    for rec in prompts["items"][: args.n]:
        counter.reset()
        ids = torch.tensor([rec["prompt_ids"]], dtype=torch.long)
        with torch.no_grad(), eb_ctx():
            record = generate(model, ids, strategy=strategy, ignore_unknown_args="forbid", **kw, **cache_kw)
        final = record[-1].as_batch()
        gen = final.generated_tokens[0].tolist()
        items.append({"index": rec["index"], "input": rec["input"], "prompt_ids": rec["prompt_ids"],
                      "tokens": [int(t) for t in gen], "forwards": counter.forwards, "mlp_rows": counter.mlp_rows,
                      "q_rows": counter.q_rows, "mask_ids_left": gen.count(mask_id)})
    settings = {k: v for k, v in vars(args).items() if k not in ("func",)}
    return {"peer_root": str(peer_root), "checkpoint": str(checkpoint), "model_kind": kind, "strategy": strategy,
            "generate_kwargs": kw, "cache": args.cache, "settings": settings, "shims": shims,
            "eos_id": eos_id, "mask_id": mask_id, "wall_s": time.perf_counter() - start, "items": items}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prompts", help="write the bench problems and prompt ids (this library's environment)")
    pr.add_argument("--model", default="tiny-llada")
    pr.add_argument("--task", default="arith")
    pr.add_argument("--n", type=int, default=100)
    pr.add_argument("--out", required=True)
    r = sub.add_parser("run", help="decode them with the peer's code (the peer's environment)")
    r.add_argument("--peer-root", default=None, help="the peer's checkout (default $RESEARCH_DLLM_ROOT)")
    r.add_argument("--checkpoint", default="tiny-llada", help="checkpoint dir or a shipped name")
    r.add_argument("--prompts", default=None, help="JSON from the prompts step (default: made with --polestar-python)")
    r.add_argument("--polestar-python", default="/work/venv213/bin/python")
    r.add_argument("--task", default="arith")
    r.add_argument("--n", type=int, default=100)
    r.add_argument("--out", required=True)
    r.add_argument("--strategy", choices=STRATEGIES, default="threshold")
    r.add_argument("--gen-length", type=int, default=64)
    r.add_argument("--block-length", type=int, default=16)
    r.add_argument("--num-transfer-tokens", type=int, default=1)
    r.add_argument("--threshold", type=float, default=None, help="threshold (default 0.9 for --strategy threshold)")
    r.add_argument("--factor", type=float, default=1.0)
    r.add_argument("--gamma", type=float, default=0.1)
    r.add_argument("--eb-cummax-tokens", action="store_true", help="EB: cummax over the tokens (paper), not dim 0")
    r.add_argument("--clip-alpha", type=float, default=10.0)
    r.add_argument("--token-freq", default=None, help="PC-Sampler frequency table for the small vocabulary")
    r.add_argument("--kl-threshold", type=float, default=0.01)
    r.add_argument("--kl-history-length", type=int, default=2)
    r.add_argument("--wide-in", type=float, default=0.7)
    r.add_argument("--narrow-out", type=float, default=0.9)
    r.add_argument("--sigma", type=float, default=None, help="the peer's certainty-prior sigma")
    r.add_argument("--cache", choices=CACHES, default="none")
    r.add_argument("--kp", type=int, default=50, help="dLLM-Cache prompt interval")
    r.add_argument("--kr", type=int, default=7, help="dLLM-Cache response interval")
    r.add_argument("--rou", type=float, default=0.25, help="dLLM-Cache adaptive ratio")
    r.add_argument("--rollout-p", type=float, default=0.1)
    r.add_argument("--current-k", type=int, default=32)
    r.add_argument("--d2-sigma", type=float, default=10.0)
    r.add_argument("--inflate-w", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "prompts":
        dump_prompts(args.model, args.task, args.n, args.out)
        return
    if args.strategy == "threshold" and args.threshold is None:
        args.threshold = 0.9
    out = run_peer(args)
    Path(args.out).write_text(json.dumps(out))
    n = len(out["items"])
    toks = sum(len(i["tokens"]) for i in out["items"])
    left = sum(i["mask_ids_left"] > 0 for i in out["items"])
    if left:
        print(f"note: {left} items end with the mask id among their tokens")
    print(f"{n} items, {sum(i['forwards'] for i in out['items']) / max(n, 1):.2f} forwards/item, "
          f"{toks / max(sum(i['forwards'] for i in out['items']), 1):.3f} tokens/forward, wall {out['wall_s']:.1f} s "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
