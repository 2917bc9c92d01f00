"""Read safetensors files straight into preallocated tensors: header parsing and one-copy tensor reads.

Format (huggingface/safetensors): an 8-byte little-endian header length ``N``, ``N`` bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header), then the tensor bytes. Reading a tensor whose file dtype matches its destination is a single
``readinto`` into the destination's own memory (no intermediate copy); other dtypes and non-CPU destinations go
through a staging buffer of one tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import attrs
import torch

#: safetensors dtype codes → torch dtypes (the floating types checkpoints use)
ST_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                     "F64": torch.float64}


@attrs.frozen
class TensorEntry:
    """Where one tensor lives: ``file``, byte range ``[start, end)`` from the file's beginning, ``dtype`` and
    ``shape`` as the header states them."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


#: first bytes of the formats ``torch.save`` and ``pickle.dump`` write (never opened here, only recognised)
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOLS = range(2, 6)


def pickle_format(head: bytes) -> str | None:
    """What a file whose first 9 bytes are ``head`` is when it is a pickle in disguise: ``"a torch.save zip
    archive (a pickle)"``, ``"a pickle (protocol N)"`` or None (by its first bytes only; nothing is unpickled). A
    safetensors file starts with its header's length (8 bytes, little-endian) followed by the header's ``{``; a
    pickle starts with PROTO (0x80, its protocol) and another opcode, never a zero byte."""
    if head[8:9] == b"{":
        return None
    if head.startswith(_ZIP_MAGIC):
        return "a torch.save zip archive (a pickle)"
    if len(head) >= 3 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS and head[2] != 0:
        return f"a pickle (protocol {head[1]})"
    return None


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse the header of safetensors file ``path`` → ``{name: TensorEntry}`` (``__metadata__`` dropped).

    Raises ValueError naming the file when it is a pickle under a safetensors name (:func:`pickle_format`; never
    unpickled), when the header is unreadable, names an unsupported dtype, or points past the end of the file (a
    truncated download).
    """
    size = os.path.getsize(path)
    fix = "re-download or re-export it"
    with open(path, "rb") as f:
        raw = f.read(8)
        pickled = pickle_format(raw + f.read(1))
        f.seek(len(raw))
        if pickled is not None:
            raise ValueError(f"{path} is {pickled}, not safetensors (only its name says safetensors); polestar never "
                             "unpickles weights (a pickle can run code): convert it to safetensors where you trust "
                             "it, or download the checkpoint's real model.safetensors")
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated ({size} bytes, shorter than a safetensors header); {fix}")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise ValueError(f"{path} is truncated: its header says {n} header bytes but the file has {size}; {fix}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} has an unreadable safetensors header ({err}); {fix}") from err
    base = 8 + n
    entries = {}
    need = base
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}; polestar reads "
                             f"{sorted(ST_DTYPES)} weights only")
        begin, end = info["data_offsets"]
        dtype, shape = ST_DTYPES[info["dtype"]], tuple(info["shape"])
        if end - begin != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{path}: tensor {name} spans {end - begin} bytes, which does not fit its shape "
                             f"{shape} and dtype {info['dtype']}; {fix}")
        entries[name] = TensorEntry(Path(path), dtype, shape, base + begin, base + end)
        need = max(need, base + end)
    if need > size:
        raise ValueError(f"{path} is truncated: its header says the tensors need {need} bytes but the file has "
                         f"{size}; {fix}")
    return entries


def _read_exact(f: BinaryIO, view: memoryview) -> None:
    """Fill ``view`` from ``f`` (a raw read can return fewer bytes than asked, e.g. above 2 GiB)."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{f.name} ended early while reading tensor bytes; re-download or re-export it")
        done += got


def _bytes_of(t: torch.Tensor) -> memoryview:
    """Writable byte view ``[t.nbytes]`` of a contiguous CPU tensor's memory."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_into(f: BinaryIO, entry: TensorEntry, dest: torch.Tensor) -> None:
    """Read ``entry``'s bytes from the open file ``f`` into ``dest`` (same shape; any dtype / device).

    CPU destination of the file's dtype: one ``readinto`` into ``dest`` itself. Otherwise the bytes land in a
    staging tensor of the file dtype, then ``dest.copy_`` converts and moves them.
    """
    f.seek(entry.start)
    if dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous():
        _read_exact(f, _bytes_of(dest))
        return
    staging = torch.empty(entry.shape, dtype=entry.dtype)
    _read_exact(f, _bytes_of(staging))
    dest.copy_(staging)
