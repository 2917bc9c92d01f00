"""Load and save Hugging Face-format checkpoint directories (config.json + safetensors), strictly, without pickle."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from .backbone import DiffusionLM
from .dream import Dream, dream_config, dream_spec
from .dream import refused_fields as dream_refused
from .llada import LLaDA, llada_config, llada_spec
from .llada import refused_fields as llada_refused
from .safetensors_io import TensorEntry, read_header, read_into
from .spec import ModelSpec
from .text import check_mask_id, load_tokenizer, text_defaults

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"

# model_type (lower-cased) -> (config.json -> spec, backbone class, spec -> config.json)
FAMILIES: dict[str, tuple[Callable[[dict], ModelSpec], type[DiffusionLM], Callable[[ModelSpec], dict]]] = {
    "llada": (llada_spec, LLaDA, llada_config),
    "dream": (dream_spec, Dream, dream_config),
}
# model_type (lower-cased) -> config.json fields the backbone cannot honour (see each family's refused_fields)
REFUSALS: dict[str, Callable[[dict], list[str]]] = {"llada": llada_refused, "dream": dream_refused}
# buffers some exporters write that are not parameters of the architecture
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def shipped_checkpoints() -> list[str]:
    """Names of the checkpoints shipped inside the package (``polestar.load(name)`` finds them)."""
    if not CHECKPOINT_DIR.is_dir():
        return []
    return sorted(p.name for p in CHECKPOINT_DIR.iterdir() if (p / "config.json").is_file())


def resolve_checkpoint(path_or_name: str | Path) -> Path:
    """A directory path, or the name of a shipped checkpoint, → the checkpoint directory."""
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    shipped = CHECKPOINT_DIR / str(path_or_name)
    if (shipped / "config.json").is_file():
        return shipped
    raise FileNotFoundError(
        f"checkpoint {str(path_or_name)!r} not found: it is neither a directory nor a shipped checkpoint name "
        f"(shipped: {', '.join(shipped_checkpoints()) or 'none'}). Pass a Hugging Face-format directory "
        "holding config.json and model.safetensors."
    )


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def read_config(directory: Path) -> dict[str, Any]:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; "
                                "a Hugging Face-format checkpoint directory is expected")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_path} is not valid JSON: {err}") from err


def family_of(cfg: dict[str, Any], where: Path) -> str:
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where / 'config.json'}: model_type {cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(['llada', 'Dream'])}"
        )
    return model_type


def tensor_entries(directory: Path) -> dict[str, TensorEntry]:
    """Map tensor name → :class:`TensorEntry` from ``model.safetensors`` or a sharded index (headers only)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except json.JSONDecodeError as err:
            raise ValueError(f"{index} is not valid JSON ({err}); re-download or re-export it") from err
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (directory / shard).is_file():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {directory}; "
                                        "download every shard the index lists")
        entries: dict[str, TensorEntry] = {}
        for shard in shards:
            header = read_header(directory / shard)
            entries.update({name: e for name, e in header.items() if weight_map.get(name) == shard})
        return entries
    single = directory / "model.safetensors"
    if single.is_file():
        return read_header(single)
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise ValueError(f"{directory} holds only pickled weights (*.bin/*.pt), which polestar never loads; "
                         "convert them to safetensors")
    raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")


@attrs.frozen
class DtypeChoice:
    """The dtype a checkpoint loads in and why.

    ``dtype``: the dtype the weights are allocated in; ``source``: why (asked for, config.json's
    ``torch_dtype``, or the safetensors headers); ``on_disk``: ``(dtype name, bytes)`` of the checkpoint's
    floating-point tensors as their headers state, most bytes first.
    """

    dtype: torch.dtype
    source: str
    on_disk: tuple[tuple[str, int], ...]

    @property
    def disk_dtype(self) -> str | None:
        """The dtype holding most of the checkpoint's floating-point bytes (None without floating tensors)."""
        return self.on_disk[0][0] if self.on_disk else None

    @property
    def mixed(self) -> bool:
        return len(self.on_disk) > 1

    def line(self) -> str:
        """One line: the load dtype, why, and the bytes per dtype on disk when they are mixed."""
        disk = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.on_disk) or "no floating tensors"
        return f"loads in {dtype_name(self.dtype)} ({self.source}; on disk: {disk})"


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``3.81 MiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def disk_dtypes(entries: dict[str, TensorEntry]) -> tuple[tuple[str, int], ...]:
    """``(dtype name, bytes)`` of the floating-point tensors of ``entries`` (safetensors headers), most bytes
    first."""
    sizes: dict[str, int] = {}
    for entry in entries.values():
        if entry.dtype.is_floating_point:
            name = dtype_name(entry.dtype)
            sizes[name] = sizes.get(name, 0) + entry.end - entry.start
    return tuple(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])))


def choose_dtype(cfg: dict[str, Any], entries: dict[str, TensorEntry],
                 requested: torch.dtype | str | None = None) -> DtypeChoice:
    """The dtype to load in: ``requested`` when given; else config.json's ``torch_dtype`` when it names a
    supported dtype; else the dtype of the majority of the floating-point bytes as the safetensors headers
    state them (LLaDA's published config.json has no ``torch_dtype``: its weights load in their bfloat16, never
    upcast). float64 weights load as float32 (the widest supported), and the source says so."""
    on_disk = disk_dtypes(entries)
    if requested is not None:
        return DtypeChoice(resolve_dtype(requested), "as requested", on_disk)
    named = cfg.get("torch_dtype")
    if isinstance(named, str) and named in _DTYPES:
        return DtypeChoice(_DTYPES[named], "config.json torch_dtype", on_disk)
    if not on_disk:
        return DtypeChoice(torch.float32, "no floating-point tensors; float32", on_disk)
    majority = on_disk[0][0]
    share = "all" if len(on_disk) == 1 else "the majority of"
    if majority not in _DTYPES:
        return DtypeChoice(torch.float32, f"safetensors headers: {share} bytes are {majority}, loaded as float32, "
                           "the widest supported dtype", on_disk)
    return DtypeChoice(_DTYPES[majority], f"safetensors headers: {share} bytes are {majority}; config.json has no "
                       "torch_dtype", on_disk)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of every parameter the ``spec.family`` backbone of ``spec`` has (built on meta)."""
    return {name: tuple(p.shape) for name, p in build_on_meta(FAMILIES[spec.family][1], spec).state_dict().items()}


def build_on_meta(cls: type[DiffusionLM], spec: ModelSpec) -> DiffusionLM:
    """``cls(spec)`` on the meta device, its random initialisation skipped (:class:`_ShapesOnly`): the shapes of a
    model whose weights come from elsewhere (a checkpoint, ``to_empty``)."""
    with torch.device("meta"), _ShapesOnly():
        return cls(spec)


class _ShapesOnly(torch.overrides.TorchFunctionMode):
    """Skips the in-place random fills of parameter initialisation. A meta tensor holds no values to fill, yet the
    first ``normal_`` on the meta device imports dynamo (~1.5 s): every load builds its model on meta first, and a
    command that never compiles would pay it at each start."""

    _FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.normal_, torch.nn.init.uniform_,
                        torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def tensor_problems(expected: dict[str, tuple[int, ...]], entries: dict[str, TensorEntry]) -> list[str]:
    """Missing, unexpected and mis-shaped tensors of ``entries`` (headers) against ``expected``, one string per
    kind (empty when the checkpoint matches)."""
    names = {n for n in entries if not n.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    misshaped = [f"{n} has shape {entries[n].shape}, expected {expected[n]}"
                 for n in sorted(names & set(expected)) if entries[n].shape != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:20])}{' ...' if len(unexpected) > 20 else ''}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped[:20]))
    return problems


def load_model(path_or_name: str | Path, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu") -> DiffusionLM:
    """Load an LLaDA or Dream checkpoint directory strictly: every parameter present with its exact shape.

    ``dtype`` None: config.json's ``torch_dtype``, else the dtype of most of the weights' bytes as the safetensors
    headers state it (:func:`choose_dtype`; with mixed dtypes one warning line says which). The model is built on
    the meta device, allocated once in its final dtype on ``device``, and each tensor is read from its shard
    straight into its parameter (see :func:`polestar.models.safetensors_io.read_into`), shard by shard: host memory
    stays near the weights' size. Raises one error naming every missing, unexpected or mis-shaped tensor, before any
    weight is read. The tokenizer, when present, is attached as ``model.tokenizer`` (see :func:`attach_text`).
    """
    directory = resolve_checkpoint(path_or_name)
    cfg = read_config(directory)
    family = family_of(cfg, directory)
    spec_fn, cls, _ = FAMILIES[family]
    spec = spec_fn(cfg)
    entries = tensor_entries(directory)
    choice = choose_dtype(cfg, entries, dtype)
    if dtype is None and choice.mixed:
        warnings.warn(f"{directory}: mixed weight dtypes; {choice.line()}", stacklevel=2)
    dtype = choice.dtype
    model = build_on_meta(cls, spec)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    problems = tensor_problems(expected, entries)
    if problems:
        raise ValueError(
            f"checkpoint {directory} does not match its config.json ({family}): " + " | ".join(problems)
            + ". Re-export the checkpoint or fix config.json."
        )
    model = model.to(dtype=dtype).to_empty(device=device)
    state = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected, key=lambda n: entries[n].start):
        by_file.setdefault(entries[name].file, []).append(name)
    with torch.no_grad():
        for file, members in by_file.items():
            with open(file, "rb", buffering=0) as f:
                for name in members:
                    read_into(f, entries[name], state[name].data)
    model.rotary.inv_freq = (1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32)
                                                        / spec.head_dim))).to(device)
    model.eval()
    attach_text(model, directory)
    model.name_or_path = str(directory)
    return model


def attach_text(model: DiffusionLM, directory: Path) -> None:
    """Attach the checkpoint's tokenizer (``model.tokenizer``) and stop ids / decoding defaults
    (``model.text_defaults``); raises ValueError when the tokenizer's mask token contradicts config.json."""
    tokenizer = load_tokenizer(directory)
    check_mask_id(directory, tokenizer, model.spec.mask_id)
    model.tokenizer = tokenizer
    model.text_defaults = text_defaults(directory, tokenizer, model.spec.eos_id)


def save_model(model: DiffusionLM, directory: str | Path, tokenizer=None, shard_size: int | None = None) -> Path:
    """Write ``model`` as a Hugging Face-format directory (config.json, safetensors, optional tokenizer.json).

    ``shard_size`` (number of tensors per shard) writes a sharded ``model.safetensors.index.json`` layout.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = FAMILIES[model.spec.family][2](model.spec)
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: t.detach().contiguous().cpu() for k, t in model.state_dict().items()}
    if shard_size is None:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(state)
        chunks = [names[i : i + shard_size] for i in range(0, len(names), shard_size)]
        weight_map = {}
        for i, chunk in enumerate(chunks):
            shard = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
            save_file({n: state[n] for n in chunk}, str(directory / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk, shard))
        total = sum(t.numel() * t.element_size() for t in state.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    if tokenizer is not None:  # a tokenizers.Tokenizer, or a transformers tokenizer wrapping one
        getattr(tokenizer, "backend_tokenizer", tokenizer).save(str(directory / "tokenizer.json"))
    return directory


def build_model(family: str, spec_kwargs: dict[str, Any], seed: int = 0) -> DiffusionLM:
    """A randomly initialised backbone of ``family`` (``"llada"`` or ``"dream"``); used by tests and training."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    spec = ModelSpec(family=family, logit_shift=1 if family == "dream" else 0, **spec_kwargs)
    gen = torch.Generator().manual_seed(seed)
    model = FAMILIES[family][1](spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()
