"""Tests of the character-level tokenizer (polestar.models.tokenizer)."""

from __future__ import annotations

import pytest

from polestar.models.tokenizer import (
    BASE_CHARS,
    EOS_TOKEN,
    MASK_TOKEN,
    MAX_VOCAB_SIZE,
    UNK_TOKEN,
    build_char_tokenizer,
    decode_generation,
    load,
    save,
    special_ids,
)
from polestar.tasks import get_task, split, task_names


@pytest.fixture(scope="module")
def tok():
    """The default tokenizer."""
    return build_char_tokenizer()


def _roundtrip(tok, text: str) -> None:
    enc = tok.encode(text)
    assert len(enc.ids) == len(text)
    assert UNK_TOKEN not in enc.tokens, text
    assert tok.decode(enc.ids) == text


def test_specials_at_fixed_ids(tok):
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert tok.token_to_id(MASK_TOKEN) == 1
    assert tok.token_to_id(UNK_TOKEN) == 2
    assert special_ids(tok) == {"mask": 1, "eos": 0, "pad": 0, "unk": 2}


def test_vocab_size(tok):
    assert tok.get_vocab_size() == 3 + len(BASE_CHARS) == len(set(BASE_CHARS)) + 3
    assert tok.get_vocab_size() <= MAX_VOCAB_SIZE
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(len(vocab)))


def test_roundtrip_punctuation_and_whitespace(tok):
    for text in ["a b\nc", "\n", ",", "=", "|", ":", " ", "  x  ", "3+4=7,7*2=4", "12/3-1=3", "cat|dog"]:
        _roundtrip(tok, text)


@pytest.mark.parametrize("name", task_names())
def test_roundtrip_every_task(tok, name):
    task = get_task(name)
    for p in split(task, 100, "train", 0) + split(task, 20, "test", 0):
        _roundtrip(tok, task.format_prompt(p.input))
        _roundtrip(tok, p.output)
        _roundtrip(tok, task.format_prompt(p.input) + p.output)


def test_specials_are_single_tokens(tok):
    enc = tok.encode("ab" + MASK_TOKEN + "c" + EOS_TOKEN)
    assert enc.ids[2] == 1 and enc.ids[4] == 0 and len(enc.ids) == 5
    assert tok.decode(enc.ids, skip_special_tokens=False) == "ab" + MASK_TOKEN + "c" + EOS_TOKEN


def test_unknown_char_maps_to_unk(tok):
    assert tok.encode("A").ids == [2]


def test_decode_generation_stops_at_eos(tok):
    ids = tok.encode("3+4=7" + EOS_TOKEN + "junk" + EOS_TOKEN).ids
    assert decode_generation(tok, ids) == "3+4=7"
    task = get_task("arith")
    assert task.check("3+4", decode_generation(tok, ids))
    # decoding the whole sequence keeping specials also works with the checker
    assert task.check("3+4", tok.decode(ids, skip_special_tokens=False))


def test_extra_chars_and_save_load(tok, tmp_path):
    ext = build_char_tokenizer("ABa")
    assert ext.get_vocab_size() == tok.get_vocab_size() + 2
    assert ext.token_to_id("a") == tok.token_to_id("a")
    assert ext.token_to_id("A") == tok.get_vocab_size()
    path = tmp_path / "sub" / "tokenizer.json"
    save(ext, path)
    loaded = load(path)
    text = "sudoku:0423\n0340\n4032\n3010=AB 1"
    assert loaded.encode(text).ids == ext.encode(text).ids
    assert loaded.decode(loaded.encode(text).ids) == text
    assert special_ids(loaded) == special_ids(ext)


def test_vocab_limit():
    with pytest.raises(ValueError):
        build_char_tokenizer("".join(chr(0x100 + i) for i in range(40)))
