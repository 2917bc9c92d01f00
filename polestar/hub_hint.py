"""What to say when a checkpoint that is not found looks like a Hugging Face hub id (``GSAI-ML/LLaDA-8B-Instruct``):
polestar reads local Hugging Face-format folders and never downloads, so the fix is a download command."""

from __future__ import annotations

import re
from pathlib import Path

#: ``owner/name`` as the hub spells repository ids (one slash, no leading dot or tilde)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_hub_id(name: str | Path) -> bool:
    """Whether ``name`` reads as a hub id and is no path that exists here."""
    text = str(name)
    return bool(HUB_ID.fullmatch(text)) and not Path(text).exists()


def hub_hint(name: str | Path) -> str | None:
    """The sentence for a missing checkpoint ``name`` that looks like a hub id (how to download it and what to
    pass instead), else None."""
    if not looks_like_hub_id(name):
        return None
    folder = f"~/models/{str(name).rsplit('/', 1)[-1]}"
    return (f"{str(name)!r} is not a local folder: polestar reads local Hugging Face-format folders (config.json + "
            f"model.safetensors) and downloads nothing; download it first, e.g. `huggingface-cli download {name} "
            f"--local-dir {folder}`, then pass the folder ({folder})")
