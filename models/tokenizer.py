"""Character-level Hugging Face tokenizer for the synthetic task suite (``polestar.tasks``).

Vocabulary layout (ids are fixed, so checkpoints stay compatible):

* id 0: ``<|endoftext|>`` -- EOS, also used as padding
* id 1: ``<|mdm_mask|>``  -- the diffusion mask token
* id 2: ``<|unk|>``       -- unknown character
* ids 3..: one token per character of :data:`BASE_CHARS` (in that order), then any ``extra_chars``.

Every character is its own token (``Split`` pre-tokenizer on the empty pattern) and the decoder concatenates
tokens (``Fuse``), so ``tok.decode(tok.encode(s).ids) == s`` for any string over the vocabulary, including
spaces and newlines. Decode generations with ``skip_special_tokens=False`` (or :func:`decode_generation`) so
that the EOS marker stays visible to the task checkers.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mdm_mask|>"
UNK_TOKEN = "<|unk|>"

#: Special tokens in id order (ids 0, 1, 2).
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, MASK_TOKEN, UNK_TOKEN)

#: Characters every task of the suite can emit (prompts and answers), in vocabulary order.
BASE_CHARS: str = string.digits + string.ascii_lowercase + "+-*/=,:|\n "

#: Upper bound on the vocabulary size (the tiny models use a 64-row embedding).
MAX_VOCAB_SIZE = 64


def build_char_tokenizer(extra_chars: str = "") -> Tokenizer:
    """Build the character tokenizer: specials at ids 0-2, then :data:`BASE_CHARS`, then new ``extra_chars``.

    Characters of ``extra_chars`` already in the vocabulary are ignored; order of first appearance is kept.
    Raises ValueError if the vocabulary would exceed :data:`MAX_VOCAB_SIZE`.
    """
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in BASE_CHARS + extra_chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    if len(vocab) > MAX_VOCAB_SIZE:
        raise ValueError(f"vocabulary size {len(vocab)} exceeds {MAX_VOCAB_SIZE}")
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save(tok: Tokenizer, path: str | os.PathLike[str]) -> None:
    """Write ``tok`` as a ``tokenizer.json`` file at ``path`` (parent directories are created)."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tok.save(path)


def load(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer saved with :func:`save`."""
    return Tokenizer.from_file(os.fspath(path))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens: ``{"mask": ..., "eos": ..., "pad": ..., "unk": ...}`` (pad == eos)."""
    ids = {
        name: tok.token_to_id(t) for name, t in (("mask", MASK_TOKEN), ("eos", EOS_TOKEN), ("unk", UNK_TOKEN))
    }
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens: {missing}")
    return {"mask": ids["mask"], "eos": ids["eos"], "pad": ids["eos"], "unk": ids["unk"]}


def decode_generation(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Decode answer ids to text, stopping before the first EOS id (specials before it are kept verbatim)."""
    eos = special_ids(tok)["eos"]
    ids = list(ids)
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tok.decode(ids, skip_special_tokens=False)
