"""Tokenizers, chat templates and stop tokens (polestar.models.text) on narrow checkpoints that carry the published
LLaDA-8B-Instruct / Dream-v0-Instruct-7B config, tokenizer and generation files."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase

import polestar
from polestar.cli import main
from polestar.fixtures import write_published_checkpoint
from polestar.models.text import decode_texts
from polestar.models.tokenizer import decode_generation
from polestar.step import eos_finished

NARROW = {
    "llada": {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128},
    "dream": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128},
}
EOT = {"llada": 126348, "dream": 151645}


def _force_token(directory, family: str, token: int) -> None:
    """Rewrite the shards so every position predicts ``token``: the same embedding for every id, no residual
    updates from the layers, and a head whose only non-zero row is ``token``'s."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(index.values())):
        tensors = load_file(str(directory / shard))
        for name, t in tensors.items():
            if name.endswith(("wte.weight", "embed_tokens.weight")):
                t.fill_(1.0)
            elif name.endswith(("attn_out.weight", "o_proj.weight", "down_proj.weight")) or (
                ".blocks." in name and name.endswith("ff_out.weight")
            ):
                t.zero_()
            elif name in ("model.transformer.ff_out.weight", "lm_head.weight"):
                t.zero_()
                t[token] = 1.0
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["llada", "dream"])
def narrow(request, tmp_path_factory):
    family = request.param
    directory = write_published_checkpoint(tmp_path_factory.mktemp(family), family, 1, NARROW[family])
    yield family, directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def forced(narrow, tmp_path_factory):
    family, directory = narrow
    copy = tmp_path_factory.mktemp(f"{family}-eot")
    shutil.copytree(directory, copy, dirs_exist_ok=True)
    _force_token(copy, family, EOT[family])
    return family, copy


def _bytes(text: str) -> list[int]:
    return list(text.encode())  # the fixtures' byte-level vocabularies put byte b at id b


def expected_chat_ids(family: str, prompt: str, system: str | None) -> list[int]:
    """The chat formats written out by hand (Llama-3 style for LLaDA, ChatML for Dream)."""
    if family == "llada":
        bos, start, end, eot = 126080, 126346, 126347, 126348
        ids = [bos]
        for role, content in ([("system", system)] if system else []) + [("user", prompt)]:
            ids += [start] + _bytes(role) + [end] + _bytes("\n\n" + content) + [eot]
        return ids + [start] + _bytes("assistant") + [end] + _bytes("\n\n")
    im_start, im_end = 151644, 151645
    ids = [im_start] + _bytes("system\n" + (system or "You are a helpful assistant.")) + [im_end] + _bytes("\n")
    ids += [im_start] + _bytes("user\n" + prompt) + [im_end] + _bytes("\n")
    return ids + [im_start] + _bytes("assistant\n")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_template_ids_follow_the_published_format(narrow, system):
    family, directory = narrow
    model = polestar.load(directory)
    ids, mask = polestar.api.encode_prompts(model, ["What is 2+2?"], chat=True, system=system)
    assert ids[0].tolist() == expected_chat_ids(family, "What is 2+2?", system) and mask.all()


def test_stop_ids_come_from_generation_config_and_the_chat_format(narrow):
    family, directory = narrow
    model = polestar.load(directory)
    eos = {"llada": 126081, "dream": 151643}[family]
    assert set(model.text_defaults.stop_ids) == {eos, EOT[family]}
    assert model.text_defaults.decoding == ({"temperature": 0.0} if family == "dream" else {})
    assert isinstance(model.tokenizer, PreTrainedTokenizerBase)  # the contract lm-eval integration codes against


def test_texts_are_cut_at_end_of_turn_and_free_of_special_tokens(narrow):
    family, directory = narrow
    tok = polestar.load(directory).tokenizer
    special = {"llada": 126346, "dream": 151644}[family]  # a header / im_start token inside the text
    row = _bytes("Hi") + [special] + _bytes(" you") + [EOT[family]] + _bytes("tail")
    assert decode_texts(tok, [row], [EOT[family]]) == ["Hi you"]


def test_generation_stops_at_end_of_turn_through_the_cli(forced, capsys):
    family, directory = forced
    args = ["generate", "--model", str(directory), "--chat", "--prompt", "Hi", "--policy", "fast-dllm",
            "--gen-length", "32", "--block-length", "8", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == [expected_chat_ids(family, "Hi", None)]
    gen = out["tokens"][0][out["prompt_len"]:]
    assert gen[0] == EOT[family] and out["texts"] == [""]
    assert out["stats"]["nfe"] == 1  # finished in the first block, not 32 // 8 blocks
    assert main(args + ["--no-stop-at-eos"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["nfe"] >= 4


def test_system_prompt_through_the_cli(forced, capsys):
    family, directory = forced
    assert main(["generate", "--model", str(directory), "--chat", "--system", "Be brief.", "--prompt", "Hi",
                 "--gen-length", "8", "--block-length", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [expected_chat_ids(family, "Hi", "Be brief.")]


def test_eos_finished_with_a_set_of_stop_ids():
    mask, stops = 9, torch.tensor([5, 7])
    gen = torch.tensor([[1, 7, 9, 9], [1, 9, 5, 9], [2, 3, 4, 9], [5, 9, 7, 9]])
    finished, fill = eos_finished(gen, mask, stops)
    assert finished.tolist() == [True, False, False, True]
    assert fill.tolist() == [[False, False, True, True], [False] * 4, [False] * 4, [False, True, False, True]]
    same, _ = eos_finished(gen, mask, 7)
    assert same.tolist() == [True, False, False, False]


def test_char_tokenizer_texts_match_the_tokenizers_decoding():
    """The shipped checkpoints keep their ids and texts under the transformers wrapper (task checkers see the
    same strings as with the raw ``tokenizers`` decoding up to EOS)."""
    model = polestar.load("tiny-llada")
    prompts = ["12+34=", "7*8-2=", "a b, c:d\n"]
    out = polestar.generate(model, prompts, policy="fast-dllm", gen_length=16, block_length=16)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(polestar.models.loading.resolve_checkpoint("tiny-llada") / "tokenizer.json"))
    assert out.prompt_ids == [raw.encode(p).ids for p in prompts]
    assert out.texts == [decode_generation(raw, row) for row in out.generations.tolist()]


def test_errors_name_the_problem():
    model = polestar.load("tiny-llada")
    with pytest.raises(ValueError, match=r"outside the tokenizer's vocabulary: \['H', 'Q'\]"):
        polestar.generate(model, ["Hi Q1+1="], gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="needs a chat template"):
        polestar.generate(model, ["1+1="], gen_length=16, block_length=16, chat=True)
    with pytest.raises(ValueError, match="pass chat=True"):
        polestar.generate(model, ["1+1="], gen_length=16, block_length=16, system="x")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_garbage_tokenizer_file_is_named(narrow, tmp_path, name):
    family, directory = narrow
    if family == "dream" and name == "tokenizer.json":
        name = "tokenizer_config.json"
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        polestar.load(tmp_path)


def test_mask_id_disagreement_is_refused(narrow, tmp_path):
    family, directory = narrow
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mask_token_id"] = 126000 if family == "llada" else 151000
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id=.*disagree|so they agree"):
        polestar.load(tmp_path)


def test_chat_needs_string_prompts():
    model = polestar.load("tiny-llada")
    for prompts in ([[3, 4, 5]], torch.tensor([[3, 4, 5]])):
        with pytest.raises(ValueError, match="chat=True formats string prompts"):
            polestar.api.encode_prompts(model, prompts, chat=True)
