"""Train the tiny shipped checkpoints (``tiny-llada``, ``tiny-dream``) on the synthetic task suite.

Masked-diffusion objective (LLaDA, also used for the Dream variant since its logits are pre-shifted so that
``logits[:, i]`` predicts token ``i`` in both families):

* a training sequence is the formatted prompt (``format_prompt`` pads every prompt with spaces to ``PROMPT_WIDTH``
  characters, so the answer always starts at the same position) followed by an answer region of exactly ``GEN``
  tokens: the answer characters, then EOS fill;
* per sequence ``t ~ U(eps, 1)`` (stratified over the batch); each answer-region token is replaced by the mask
  id independently with probability ``t``; prompt tokens are never masked;
* loss = cross-entropy on the masked positions weighted by ``1/t`` and by a per-position weight (1 for answer
  characters and the first EOS, ``--eos-weight`` for the EOS fill after it, so the padding does not dominate),
  normalised by the total weight of the answer region.

Curriculum aids (off by default; the shipped checkpoints' cards list the stages that used them):

* ``--init DIR`` starts from a checkpoint's weights and architecture (fine-tuning in stages);
* ``--facts-batch N`` adds a batch of isolated single arith steps ``a<op>b=?`` to every step (the mod-10 tables);
* ``--chain-facts N`` adds ``N`` equation chains (``--chain-facts-tasks``, default ``arith``) cut just before one
  intermediate result (later positions masked at a random rate), with the loss on that result and the next
  operand only: the table lookup where decoding needs it (isolated facts are learned but do not transfer);
* ``--prefix-frac F`` masks a share ``F`` of the rows after a random cut inside the answer instead of at random,
  the context a left-to-right decoder sees (random masking leaves copies of intermediate results visible, so a
  model learns to copy them rather than compute them).

Calibration aid:

* ``--answer-noise EPS`` replaces each digit of an answer in the *loss targets* (never in the visible context) by a
  digit drawn uniformly from 0-9 with probability ``EPS``: irreducible label noise, so a model that has learned the
  task predicts the right digit with probability about ``1 - EPS + EPS / 10`` instead of ~1. This gives the
  calibrated mid-band confidences of a large model on open-ended answers (the regime where a commit rule below
  the threshold can act); accuracy is always scored against the clean answers.

Usage::

    python -m polestar.training.train --family llada --out models/checkpoints/tiny-llada --minutes 40
    python -m polestar.training.train --family llada --init models/checkpoints/tiny-llada --out runs/next \
        --minutes 40 --facts-batch 64 --prefix-frac 0.5

Writes ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``train_log.jsonl`` and a ``README.md`` model
card (with test accuracies measured at the end of training, baseline decoding) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polestar.models.loading import build_model, load_model, save_model
from polestar.models.text import as_transformers_tokenizer
from polestar.models.tokenizer import build_char_tokenizer, special_ids
from polestar.tasks import get_task, iter_split, split

#: Answer-region length (the benchmark generates 64 tokens).
GEN = 64

#: Default training mixture (task -> sampling weight); arith and countdown weighted up.
DEFAULT_MIXTURE: dict[str, float] = {
    "arith": 4.0,
    "countdown": 3.0,
    "countdown4": 1.0,
    "sudoku": 2.0,
    "copy": 0.5,
    "reverse": 0.5,
    "sort": 0.5,
    "pick": 0.5,
}

#: Decoding used for every accuracy number (the benchmark's reference decoder).
EVAL_DECODE = dict(policy="baseline", gen_length=GEN, block_length=16, steps=GEN)


# ---------------------------------------------------------------------------------------------------------------
# arguments and model spec
# ---------------------------------------------------------------------------------------------------------------
def parse_mixture(text: str) -> dict[str, float]:
    """``"arith=4,countdown=3,copy"`` -> ``{"arith": 4.0, "countdown": 3.0, "copy": 1.0}``."""
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, w = part.partition("=")
        out[name.strip()] = float(w) if w else 1.0
    if not out:
        raise ValueError("empty task mixture")
    for name in out:
        get_task(name)  # validates the name
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m polestar.training.train", description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("llada", "dream"), required=True)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--init", default=None,
                   help="start from this checkpoint's weights and architecture "
                        "(fine-tuning; the size flags are ignored)")
    p.add_argument("--minutes", type=float, default=45.0, help="training time budget (wall clock, excl. final eval)")
    p.add_argument("--steps", type=int, default=None, help="fixed number of steps (lr schedule by steps, not time)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: heads (llada), heads/2 (dream)")
    p.add_argument("--mlp-ratio", type=float, default=4.0)
    p.add_argument("--rope-theta", type=float, default=None, help="default: 500000 (llada), 1e6 (dream)")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05, help="final lr as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1)")
    p.add_argument("--eos-weight", type=float, default=0.15, help="loss weight of EOS fill after the first EOS")
    p.add_argument("--tasks", type=parse_mixture, default=dict(DEFAULT_MIXTURE), help="e.g. arith=4,countdown=3,copy=1")
    p.add_argument("--prefix-frac", type=float, default=0.0,
                   help="share of rows masked after a random cut in the answer instead of at random (0: pure LLaDA)")
    p.add_argument("--answer-noise", type=float, default=0.0, metavar="EPS",
                   help="replace each answer digit of the loss targets by a uniform random digit with this probability "
                        "(calibrated mid-band confidences; accuracy is scored on clean answers)")
    p.add_argument("--facts-batch", type=int, default=0,
                   help="auxiliary batch of single arith steps 'a<op>b=r' (r masked) per step; 0: off")
    p.add_argument("--chain-facts-tasks", type=parse_mixture, default={"arith": 1.0},
                   help="task mixture of the --chain-facts rows (equation chains: arith, countdown, countdown4)")
    p.add_argument("--chain-facts", type=int, default=0,
                   help="rows per step of equation chains cut before one result, loss on that result and the "
                        "next operand")
    p.add_argument("--facts-weight", type=float, default=1.0, help="loss weight of the auxiliary facts batch")
    p.add_argument("--eval-every", type=int, default=400, help="steps between accuracy probes (0: never)")
    p.add_argument("--eval-n", type=int, default=16, help="held-out test problems per task in each probe")
    p.add_argument("--eval-tasks", type=lambda s: list(parse_mixture(s)), default=None,
                   help="comma-separated tasks the probes evaluate (default: those of --tasks)")
    p.add_argument("--final-n", type=int, default=200, help="test problems per task in the final evaluation (0: skip)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm bar")
    return p


def spec_kwargs_from_args(args: argparse.Namespace, vocab: int, ids: dict[str, int]) -> dict:
    dream = args.family == "dream"
    kv = args.kv_heads or (max(1, args.heads // 2) if dream else args.heads)
    theta = args.rope_theta or (1e6 if dream else 500000.0)
    return dict(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=kv,
        mlp_hidden=int(round(args.mlp_ratio * args.d_model)),
        vocab_size=vocab,
        embedding_size=vocab,
        rope_theta=float(theta),
        norm_eps=1e-5 if not dream else 1e-6,
        max_seq_len=args.max_seq_len,
        mask_id=ids["mask"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        qkv_bias=dream,  # Dream (Qwen2-style) has q/k/v biases; LLaDA has none
    )


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
class Batcher:
    """Draws training sequences from the train splits of a weighted task mixture, deterministically per seed.

    Each row is ``prompt (right-aligned to the batch's prompt length, left-padded with pad ids that are masked
    out of attention) + answer + EOS fill`` with an answer region of exactly ``gen`` tokens.
    """

    def __init__(self, tok, mixture: dict[str, float], seed: int, gen: int = GEN):
        self.tok = tok
        self.gen = gen
        self.ids = special_ids(tok)
        self.names = list(mixture)
        self.weights = [mixture[n] for n in self.names]
        self.tasks = {n: get_task(n) for n in self.names}
        self.streams = {n: iter_split(self.tasks[n], "train", seed) for n in self.names}
        self.rng = random.Random(seed)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(ids [B, P+gen], attention_mask [B, P+gen] bool, P)``."""
        prompts, answers = [], []
        for name in self.rng.choices(self.names, weights=self.weights, k=batch):
            prob = next(self.streams[name])
            task = self.tasks[name]
            prompts.append(self.encode(task.format_prompt(prob.input)))
            ans = self.encode(prob.output)
            if len(ans) >= self.gen:
                raise ValueError(f"answer of {name} longer than the answer region ({len(ans)} >= {self.gen})")
            answers.append(ans)
        P = max(len(p) for p in prompts)
        pad, eos = self.ids["pad"], self.ids["eos"]
        ids = torch.full((batch, P + self.gen), eos, dtype=torch.long)
        att = torch.ones(batch, P + self.gen, dtype=torch.bool)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            off = P - len(p)
            if off:
                ids[i, :off] = pad
                att[i, :off] = False
            ids[i, off:P] = torch.tensor(p)
            ids[i, P : P + len(a)] = torch.tensor(a)
        return ids, att, P


def sample_mask(ans: torch.Tensor, eos_id: int, gen: torch.Generator, eps: float = 1e-3,
                prefix_frac: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Which answer-region tokens ``ans [B, G]`` to mask: ``(masked [B, G] bool, t [B])``.

    Rows draw ``t ~ U(eps, 1)`` (stratified over the batch) and mask each token with probability ``t``; a
    ``prefix_frac`` share of rows instead keeps the answer up to a random cut inside it (answer characters and
    the first EOS) and masks everything after, with ``t`` the masked fraction -- the context a left-to-right
    decoder sees, which random masking almost never produces (it rarely hides every copy of an intermediate
    result, so the model learns to copy instead of to compute).
    """
    B, G = ans.shape
    u = (torch.arange(B, dtype=torch.float32) + torch.rand(B, generator=gen)) / B
    t = eps + (1 - eps) * u[torch.randperm(B, generator=gen)]
    masked = torch.rand(ans.shape, generator=gen) < t[:, None]
    if prefix_frac > 0:
        length = (ans != eos_id).sum(dim=1) + 1
        cut = (torch.rand(B, generator=gen) * length).long()
        is_prefix = torch.rand(B, generator=gen) < prefix_frac
        masked = torch.where(is_prefix[:, None], torch.arange(G)[None, :] >= cut[:, None], masked)
        t = torch.where(is_prefix, (G - cut).float() / G, t)
    return masked, t


def diffusion_loss(
    model,
    ids: torch.Tensor,
    att: torch.Tensor,
    prompt_len: int,
    gen: torch.Generator,
    eps: float = 1e-3,
    eos_weight: float = 0.15,
    prefix_frac: float = 0.0,
    answer_noise: float = 0.0,
    digit_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The masked-diffusion loss of one batch (see the module docstring); a ``prefix_frac`` share of the rows
    is masked after a random cut instead (see ``--prefix-frac``); with ``answer_noise > 0`` the digit targets
    ``digit_ids [10]`` are replaced at that rate by uniform digits (see ``--answer-noise``)."""
    spec = model.spec
    B, L = ids.shape
    ans = ids[:, prompt_len:]
    masked, t = sample_mask(ans, spec.eos_id, gen, eps, prefix_frac)
    noisy = ids.clone()
    noisy[:, prompt_len:] = torch.where(masked, torch.full_like(ans, spec.mask_id), ans)
    # per-position weight: 1 up to and including the first EOS, eos_weight for the fill after it
    is_eos = ans == spec.eos_id
    after_first = (is_eos.long().cumsum(1) > 1) & is_eos
    weight = torch.where(after_first, torch.full(ans.shape, eos_weight), torch.ones(ans.shape))
    target = noisy_targets(ans, digit_ids, answer_noise, gen) if answer_noise > 0 else ans
    logits = model(noisy, att)[:, prompt_len:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none").view(B, -1)
    loss = (ce * masked * weight / t[:, None]).sum() / weight.sum()
    return loss


def noisy_targets(ans: torch.Tensor, digit_ids: torch.Tensor, rate: float, gen: torch.Generator) -> torch.Tensor:
    """``ans [B, G]`` with each digit token replaced, with probability ``rate``, by a digit drawn uniformly from
    ``digit_ids [10]`` (which may be the same digit): label noise on the training targets."""
    is_digit = torch.isin(ans, digit_ids)
    flip = is_digit & (torch.rand(ans.shape, generator=gen) < rate)
    random_digit = digit_ids[torch.randint(len(digit_ids), ans.shape, generator=gen)]
    return torch.where(flip, random_digit, ans)


def facts_batch(tok, batch: int, rng: random.Random, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single arith steps ``"a<op>b=r"`` with the result masked: ``(ids [B, 5], target [B])``.

    A curriculum aid: the mod-10 tables are the slow part of ``arith`` (a 1M-parameter model needs ~2,000 steps of
    batch 64 to learn them in isolation, and far longer when they are only seen inside diffusion batches); the same
    relative layout ``a<op>b=r`` appears in every arith answer, so with rotary positions the table transfers.
    """
    from polestar.tasks.arith import solve

    rows, target = [], []
    for _ in range(batch):
        text = f"{rng.randrange(10)}{rng.choice('+-*')}{rng.randrange(10)}"
        rows.append(tok.encode(text + "=", add_special_tokens=False).ids + [mask_id])
        target.append(tok.encode(str(solve(text)), add_special_tokens=False).ids[0])
    return torch.tensor(rows), torch.tensor(target)


def facts_loss(model, tok, batch: int, rng: random.Random) -> torch.Tensor:
    x, y = facts_batch(tok, batch, rng, model.spec.mask_id)
    return F.cross_entropy(model(x)[:, -1].float(), y)


def chain_facts_batch(batcher: Batcher, batch: int, gen: torch.Generator, mask_id: int,
                      random_after: bool = False) -> tuple[torch.Tensor, ...]:
    """Equation chains (``arith``, ``countdown``) cut before one intermediate result:
    ``(ids [B, L], att [B, L], pos [B, 3], target [B, 3], valid [B, 3] bool)``.

    Each row is a full training row of ``batcher`` (a batcher over equation-chain tasks) whose answer is kept up
    to and including the ``=`` of a random equation and masked from that equation's result on. ``pos[:, 0]`` is
    the result's first digit, ``pos[:, 1]`` its second digit (``valid`` False for a one-digit result) and
    ``pos[:, 2]`` the token after the comma that ends the result -- in ``arith`` the result's copy, the next
    step's left operand (``...=7,7*2``), in ``countdown`` the next equation's first operand (``valid`` False for
    the last equation). The loss is taken there only, against the original tokens: the table lookup in the context
    where decoding needs it, at the places a decoder may commit the value first. (Isolated ``a<op>b=?`` facts are
    learned in ~1,000 steps yet do not transfer into chains: measured 99.6% isolated, 18% in context after the
    same steps.) With ``random_after`` the positions after the cut are masked at a rate ``t ~ U(0, 1)`` per row
    instead of all (the loss positions always): a confidence-ordered decoder often commits later layout tokens
    first, and a model trained on clean prefixes alone computes badly beside them.
    """
    ids, att, P = batcher.sample(batch)
    L = ids.shape[1]
    eq, comma = batcher.encode("=")[0], batcher.encode(",")[0]
    digits = torch.tensor(batcher.encode("0123456789"))
    is_result = torch.zeros_like(ids, dtype=torch.bool)
    is_result[:, P + 1 :] = ids[:, P:-1] == eq
    first = torch.multinomial(is_result.float(), 1, generator=gen).squeeze(1)
    rows = torch.arange(batch)

    def at(i: torch.Tensor) -> torch.Tensor:
        return ids[rows, i.clamp(max=L - 1)]

    two_digit = torch.isin(at(first + 1), digits) & (first + 1 < L)
    end = first + 1 + two_digit.long()  # the token after the result
    has_next = (at(end) == comma) & (end + 1 < L)
    pos = torch.stack([first, torch.where(two_digit, first + 1, first), torch.where(has_next, end + 1, first)], 1)
    valid = torch.stack([torch.ones_like(has_next), two_digit, has_next], dim=1)
    target = ids[rows[:, None], pos]
    after = torch.arange(L)[None, :] >= first[:, None]
    if random_after:  # later positions masked at a random rate per row; the loss positions always
        keep_rate = torch.rand(batch, 1, generator=gen)
        after = after & (torch.rand(ids.shape, generator=gen) >= keep_rate)
        after[rows[:, None], pos] = True
    noisy = torch.where(after, torch.full_like(ids, mask_id), ids)
    return noisy, att, pos, target, valid


def chain_facts_loss(model, batcher: Batcher, batch: int, gen: torch.Generator) -> torch.Tensor:
    x, att, pos, target, valid = chain_facts_batch(batcher, batch, gen, model.spec.mask_id, random_after=True)
    logits = model(x, att)[torch.arange(batch)[:, None], pos].float()  # [B, 3, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return (ce * valid.reshape(-1)).sum() / valid.sum()


# ---------------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, task_names, n: int, seed: int = 0, batch_size: int = 100, progress: str | None = None,
             **decode) -> dict[str, float]:
    """Accuracy of ``model`` on ``n`` held-out test problems per task (baseline decoding unless overridden).

    ``progress``: a label; with it, one line per decoded batch on stderr (``final evaluation: arith 100/200 ·
    task 1/4 · 12.3s``), so a long evaluation is not silent."""
    import polestar

    kw = dict(EVAL_DECODE)
    kw.update(decode)
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    start = time.time()
    names = list(task_names)
    for k, name in enumerate(names):
        task = get_task(name)
        probs = split(task, n, "test", seed)
        correct = 0
        for i in range(0, n, batch_size):
            chunk = probs[i : i + batch_size]
            texts = polestar.generate(model, [task.format_prompt(p.input) for p in chunk], **kw).texts
            correct += sum(task.check(p.input, g) for p, g in zip(chunk, texts))
            if progress is not None:
                print(f"{progress}: {name} {i + len(chunk)}/{n} · task {k + 1}/{len(names)} · "
                      f"{time.time() - start:.1f}s", file=sys.stderr, flush=True)
        out[name] = correct / n
    model.train(was_training)
    return out


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------
def lr_at(args, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * cos


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"
    log_f = log_path.open("w")

    def log(rec: dict) -> None:
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    tok = build_char_tokenizer()
    ids = special_ids(tok)
    vocab = tok.get_vocab_size()
    if args.init:
        model = load_model(args.init, dtype="float32")
        if model.spec.family != args.family:
            raise ValueError(f"--init {args.init} is a {model.spec.family} checkpoint but --family is {args.family}")
    else:
        model = build_model(args.family, spec_kwargs_from_args(args, vocab, ids), seed=args.seed)
    model.tokenizer = as_transformers_tokenizer(tok)
    model.train()
    params = n_params(model)
    log({"event": "start", "argv": sys.argv, "args": vars(args), "family": args.family, "params": params,
         "spec": {k: getattr(model.spec, k) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "mlp_hidden",
                                                       "vocab_size", "rope_theta", "max_seq_len")},
         "mixture": args.tasks})

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    batcher = Batcher(tok, args.tasks, args.seed)
    digit_ids = torch.tensor([tok.token_to_id(d) for d in "0123456789"])
    gen = torch.Generator().manual_seed(args.seed)
    facts_rng = random.Random(args.seed + 1)
    chain_batcher = Batcher(tok, args.chain_facts_tasks, args.seed + 2) if args.chain_facts else None
    budget = args.minutes * 60.0
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc=f"train {args.family}", dynamic_ncols=True, mininterval=5.0)
    t0 = time.time()
    eval_time = 0.0
    step = 0
    ema = None
    history = []
    while True:
        elapsed = time.time() - t0
        if args.steps is not None:
            if step >= args.steps or elapsed >= budget:
                break
            progress = step / args.steps
        else:
            if elapsed >= budget:
                break
            progress = elapsed / budget
        lr = lr_at(args, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        x, att, P = batcher.sample(args.batch)
        loss = diffusion_loss(model, x, att, P, gen, eps=args.eps, eos_weight=args.eos_weight,
                              prefix_frac=args.prefix_frac, answer_noise=args.answer_noise, digit_ids=digit_ids)
        if args.facts_batch:
            loss = loss + args.facts_weight * facts_loss(model, tok, args.facts_batch, facts_rng)
        if args.chain_facts:
            loss = loss + args.facts_weight * chain_facts_loss(model, chain_batcher, args.chain_facts, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        history.append(lv)
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}", refresh=False)
        if step % args.log_every == 0 or step == 1:
            log({"step": step, "time": round(time.time() - t0, 1), "loss": lv, "loss_ema": ema, "lr": lr,
                 "grad_norm": float(gnorm)})
        if args.eval_every and step % args.eval_every == 0:
            te = time.time()
            acc = evaluate(model, args.eval_tasks or list(args.tasks), args.eval_n, seed=args.seed)
            eval_time += time.time() - te
            log({"step": step, "time": round(time.time() - t0, 1), "eval_n": args.eval_n, "acc": acc})
            msg = " ".join(f"{k}={v:.2f}" for k, v in acc.items())
            (bar.write if bar is not None else print)(f"step {step} loss {ema:.3f} | {msg}")
            save_model(model, out, tokenizer=tok)  # intermediate checkpoint
    if bar is not None:
        bar.close()
    train_time = time.time() - t0
    model.eval()
    save_model(model, out, tokenizer=tok)
    log({"event": "trained", "steps": step, "train_time_s": round(train_time, 1),
         "probe_eval_time_s": round(eval_time, 1), "final_loss_ema": ema})
    print(f"trained {step} steps in {train_time / 60:.1f} min; loss(ema) {ema:.4f}", flush=True)
    final = {}
    eval_s = 0.0
    if args.final_n:
        te = time.time()
        print(f"final evaluation: {args.final_n} test problems per task of {', '.join(DEFAULT_MIXTURE)}",
              file=sys.stderr, flush=True)
        final = evaluate(model, list(DEFAULT_MIXTURE), args.final_n, seed=0, progress="final evaluation")
        eval_s = time.time() - te
        log({"event": "final_eval", "n": args.final_n, "acc": final, "time_s": round(eval_s, 1), **EVAL_DECODE})
        print(f"final accuracy (n={args.final_n}): {json.dumps(final)}", flush=True)
    summary = {"model": model, "steps": step, "train_time_s": train_time, "final_eval_time_s": eval_s, "params": params,
               "final_acc": final, "loss_ema": ema, "history": history}
    write_model_card(out, args, model, summary)
    log_f.close()
    return summary


def write_model_card(out: Path, args: argparse.Namespace, model, summary: dict) -> None:
    s = model.spec
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    name = out.name
    cmd = ("python -m polestar.training.train " + " ".join(sys.argv[1:]) if sys.argv and "train" in sys.argv[0]
           else "(programmatic)")
    acc_rows = "\n".join(f"| {k} | {v * 100:.1f}% |" for k, v in summary["final_acc"].items()) or "| (not measured) | |"
    mix = ", ".join(f"{k}={v:g}" for k, v in args.tasks.items())
    text = f"""# {name}

A tiny randomly-initialised **{ 'LLaDA' if s.family == 'llada' else 'Dream' }-architecture** masked diffusion LM trained
from scratch on polestar's synthetic task suite (`polestar.tasks`), shipped so that the decoding policies can
be tested and benchmarked on CPU. It is *not* a port of the real \
{'LLaDA-8B' if s.family == 'llada' else 'Dream-7B'} weights.

Load with `polestar.load("{name}")` (or `polestar.models.loading.load_model("{name}")`).

## Architecture

| field | value |
|---|---|
| family | {s.family} (`logit_shift={s.logit_shift}`) |
| layers | {s.n_layers} |
| d_model | {s.d_model} |
| heads / kv heads | {s.n_heads} / {s.n_kv_heads} |
| SwiGLU hidden | {s.mlp_hidden} |
| vocab | {s.vocab_size} (character tokenizer, `tokenizer.json`; mask id {s.mask_id}, eos/pad id {s.eos_id}) |
| rope theta | {s.rope_theta:g} |
| qkv bias | {s.qkv_bias} |
| max_seq_len | {s.max_seq_len} |
| parameters | {summary['params']:,} |
| file size (fp32 safetensors) | {size_mb:.2f} MB |

## Training

Command (from the repository root, installed as `polestar`):

```
{cmd}
```

* Objective: LLaDA masked diffusion. Sequence = prompt (padded with spaces to 32 characters by
  `format_prompt`) + answer region of exactly {GEN} tokens (answer characters, then EOS fill). Per sequence
  t ~ U({args.eps:g}, 1) (stratified across the batch); each answer-region token is masked with probability t;
  cross-entropy on masked positions weighted by 1/t; EOS fill after the first EOS weighted {args.eos_weight:g};
  normalised by the total answer-region weight. Prompt tokens are never masked.
* Mixture (train splits only; weights): {mix}.
* AdamW (betas 0.9/0.98, weight decay {args.weight_decay:g}), peak lr {args.lr:g}, {args.warmup} warmup steps,
  cosine decay to {args.min_lr_frac:g}x over the {'step' if args.steps else 'time'} budget, grad clip 1.0,
  batch {args.batch}, seed {args.seed}, {args.threads} CPU thread(s).
* Steps: {summary['steps']}; training wall time {summary['train_time_s'] / 60:.1f} min (includes periodic accuracy
  probes); final loss (EMA) {summary['loss_ema']:.4f}.
* Log: `train_log.jsonl` (loss every {args.log_every} steps; accuracy on {args.eval_n} test problems per task every
  {args.eval_every} steps; final evaluation).

## Test accuracy

Measured at the end of training on n={args.final_n} held-out test problems per task (`split(task, n, "test",
seed=0)`), decoding with `polestar.generate(model, prompts, policy="baseline", gen_length=64, block_length=16,
steps=64)` (greedy, one token per step), checked with `task.check` (final-answer correctness). Evaluation
took {summary['final_eval_time_s'] / 60:.1f} min.

| task | accuracy |
|---|---|
{acc_rows}
"""
    (out / "README.md").write_text(text)


def evaluate_checkpoint(out: str | Path, n: int = 200, threads: int = 1) -> dict[str, float]:
    """Measure the final test accuracies of a checkpoint written by :func:`train` (e.g. one whose run was stopped
    before its final evaluation), append them to its ``train_log.jsonl`` and rewrite its ``README.md``."""
    from polestar.models.loading import load_model

    torch.set_num_threads(threads)
    out = Path(out)
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in records if r.get("event") == "start")
    trained = next((r for r in records if r.get("event") == "trained"), None)
    if "args" in start:
        args = argparse.Namespace(**start["args"])
    else:  # logs written before the parsed arguments were recorded
        args = build_parser().parse_args(start["argv"][1:])
    args.final_n = n
    model = load_model(out)
    te = time.time()
    acc = evaluate(model, list(DEFAULT_MIXTURE), n, seed=0, progress="final evaluation")
    eval_s = time.time() - te
    with (out / "train_log.jsonl").open("a") as f:
        f.write(json.dumps({"event": "final_eval", "n": n, "acc": acc, "time_s": round(eval_s, 1),
                            **EVAL_DECODE}) + "\n")
    steps = trained["steps"] if trained else max(r.get("step", 0) for r in records)
    summary = {"steps": steps, "train_time_s": trained["train_time_s"] if trained else float("nan"),
               "final_eval_time_s": eval_s, "params": n_params(model), "final_acc": acc,
               "loss_ema": trained["final_loss_ema"] if trained else float("nan")}
    argv0 = sys.argv
    sys.argv = start["argv"]
    try:
        write_model_card(out, args, model, summary)
    finally:
        sys.argv = argv0
    print(f"final accuracy (n={n}): {json.dumps(acc)}", flush=True)
    return acc


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--eval-only" in argv:
        # python -m polestar.training.train --eval-only --out DIR [--final-n 200] [--threads 1]
        p = argparse.ArgumentParser(prog="python -m polestar.training.train --eval-only")
        p.add_argument("--eval-only", action="store_true")
        p.add_argument("--out", required=True)
        p.add_argument("--final-n", type=int, default=200)
        p.add_argument("--threads", type=int, default=1)
        a = p.parse_args(argv)
        evaluate_checkpoint(a.out, a.final_n, a.threads)
        return
    args = build_parser().parse_args(argv)
    train(args)


if __name__ == "__main__":
    main()
