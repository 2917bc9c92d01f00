"""``polestar.trace``: decode one prompt with one or two policies, record every step, and write the pictures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from polestar.api import generate, load
from polestar.overrides import Overrides
from polestar.policy import assemble

from .figures import PolicyFigures, first_difference, policy_figures
from .record import TraceRecorder
from .stage_figure import figures_of

#: names of the files :func:`trace` writes into ``out`` (the PNGs are listed in :attr:`Trace.pngs`)
HTML_NAME, JSON_NAME = "trace.html", "trace.json"


@attrs.frozen
class Trace:
    """A traced decode of one prompt.

    ``title``: the page's title; ``prompt``: the prompt as shown; ``prompt_len``: the column where generation
    starts; ``block_length``; ``n_layers``; ``figures``: one :class:`~polestar.tracing.figures.PolicyFigures` per
    policy, in the order given; ``first_difference``: the first generated column where the two policies' final
    tokens differ (None with one policy or equal outputs); ``reference``: the expected answer when known;
    ``html``, ``json`` and ``pngs``: the files written (None / empty when no ``out`` was given)."""

    title: str
    prompt: str
    prompt_len: int
    block_length: int
    n_layers: int
    figures: tuple[PolicyFigures, ...]
    first_difference: int | None
    reference: str | None = None
    html: Path | None = None
    json: Path | None = None
    pngs: tuple[Path, ...] = ()


def check_policies(policies: Sequence[str], overrides: dict[str, Any]) -> list[str]:
    """One or two policy names, each assembling with the options that apply to it; every option must apply to at
    least one of them (one ValueError naming the problem otherwise)."""
    names = [policies] if isinstance(policies, str) else list(policies)
    if not 1 <= len(names) <= 2:
        raise ValueError(f"a trace shows one policy or two side by side; got {len(names)}: {', '.join(names) or '-'}")
    if len(names) == 2 and names[0] == names[1]:
        raise ValueError(f"the two policies are the same ({names[0]}); trace two different ones, or one")
    given = Overrides.parse(overrides)
    for name in names:
        assemble(name, given.as_optional() if len(names) > 1 else given)
    for key, value in overrides.items():  # each option must apply to one policy, with the others optional
        errors = []
        for name in names:
            try:
                assemble(name, Overrides.parse({k: v for k, v in overrides.items() if k != key}).as_optional()
                         .merge({key: value}))
            except (ValueError, TypeError) as err:
                errors.append(err)
        if len(errors) == len(names):
            raise errors[0]
    return names


def token_label(model, token: int) -> str:
    """A short printable label of one token: ``_`` the mask, ``∎`` a stop token, ``↵`` a newline, ``␣`` a space."""
    spec = model.spec
    stops = set(getattr(getattr(model, "text_defaults", None), "stop_ids", ()) or (spec.eos_id,))
    if token == spec.mask_id:
        return "_"
    if token in stops:
        return "∎"
    tok = model.tokenizer
    text = tok.decode([token]) if tok is not None else str(token)
    return text.replace("\n", "↵").replace(" ", "␣") or "?"


def trace(model, prompt: str | Sequence[int], policies: str | Sequence[str] = "fast-dllm",
          out: str | Path | None = None, *, gen_length: int = 64, block_length: int = 16, steps: int | None = None,
          temperature: float | None = None, seed: int = 0, stop_at_eos: bool = True, chat: bool = False,
          title: str | None = None, reference: str | None = None, png: bool = True, **overrides: Any) -> Trace:
    """Decode ``prompt`` (a string, or token ids) with one policy or two, record every step (commits and their
    origins, the plan, each sparse update's members, the step's cost counters, and what the stages' own figures
    read: Polestar-Cache's cluster drifts, Elastic-Cache's trigger) and, when ``out`` is given, write into that
    folder a self-contained HTML page (``trace.html``: inline SVG, no network), the figure data (``trace.json``)
    and, with ``png``, PNG figures.

    ``model``: a loaded model or a checkpoint name / directory (see :func:`polestar.load`); the decoding settings
    and ``overrides`` (stage options) are those of :func:`polestar.generate` (with two policies an option applies
    to the policies that have it); ``reference``: the expected answer, shown under the outputs. Steps run eagerly
    (a trace reads every step's tensors back). Returns a :class:`Trace`."""
    names = check_policies(policies, overrides)
    if png and out is not None:
        from .png import check_backend

        check_backend()
    if isinstance(model, (str, Path)):
        model = load(model)
    options = Overrides.parse(overrides).as_optional() if len(names) > 1 else Overrides.parse(overrides)
    n_layers = model.spec.n_layers
    figures = []
    prompt_len = 0
    for name in names:
        pipeline = assemble(name, options)
        figures_here = figures_of(pipeline)
        recorder = TraceRecorder(getattr(pipeline.commit.config, "threshold", None), n_layers, figures_here)
        result = generate(model, [prompt], policy=pipeline, gen_length=gen_length, block_length=block_length,
                          steps=steps, temperature=temperature, seed=seed, stop_at_eos=stop_at_eos, chat=chat,
                          on_step=recorder)
        final = result.tokens[0].tolist()
        prompt_len = result.prompt_len
        text = result.texts[0] if result.texts is not None else " ".join(map(str, final[prompt_len:]))
        stages = {kind: stage.name for kind, stage in result.pipeline.stages.items()}
        figures.append(policy_figures(name, stages, recorder.steps, prompt_len, block_length, final,
                                      [token_label(model, t) for t in final], text, n_layers, figures_here))
    diff = None
    if len(figures) == 2:
        at = first_difference(*(f.tokens[prompt_len:] for f in figures))
        diff = None if at is None else prompt_len + at
    shown = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    result = Trace(title or " vs ".join(names), shown, prompt_len, block_length, n_layers, tuple(figures), diff,
                   reference)
    if out is None:
        return result
    return write(result, Path(out), png)


def write(result: Trace, out: Path, png: bool = True) -> Trace:
    """Write ``result``'s HTML page, figure data and (with ``png``) PNG figures into ``out``; returns the trace
    with the paths."""
    from .html import render_html

    out.mkdir(parents=True, exist_ok=True)
    html = out / HTML_NAME
    html.write_text(render_html(result), encoding="utf-8")
    data = out / JSON_NAME
    data.write_text(json.dumps(_plain(result), indent=1), encoding="utf-8")
    pngs: tuple[Path, ...] = ()
    if png:
        from .png import write_pngs

        pngs = tuple(write_pngs(result, out))
    return attrs.evolve(result, html=html, json=data, pngs=pngs)


def _plain(value):
    """Named tuples as dicts, tuples as lists, paths as strings: a JSON-ready copy of a trace."""
    if attrs.has(type(value)):
        return {f.name: _plain(getattr(value, f.name)) for f in attrs.fields(type(value))
                if f.name not in ("html", "json", "pngs")}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
