"""Published checkpoints exactly as published: the fixture generator against verbatim copies of the published
non-weight files (tests/data/published), the dtype a checkpoint loads in, fields the engine refuses, the text
fields the loader reads, the evaluation prompt format per preset, and ``polestar inspect``."""

import json
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import jinja2
import pytest
import torch
from lm_eval.api.instance import Instance
from safetensors.torch import load_file, save_file

import polestar
from polestar.cli import main
from polestar.evaluation.lm_eval_model import PolestarLM
from polestar.fixtures import write_published_checkpoint, write_published_files
from polestar.inspection import inspect_checkpoint
from polestar.models.loading import FAMILIES as FAMILY_TABLE
from polestar.models.loading import expected_shapes, resolve_checkpoint
from polestar.models.published import LLADA_ADDED_TOKENS, PUBLISHED_MODELS
from polestar.presets import get_preset, preset_names
from tests.test_chat import NARROW, _bytes, expected_chat_ids

FAMILIES_SPEC = {family: entry[0] for family, entry in FAMILY_TABLE.items()}
GOLDEN = Path(__file__).parent / "data" / "published"
#: files the generator writes that are not copied from the published repository: the tokenizer vocabularies
#: (LLaDA's 126k-entry tokenizer.json, Dream's vocab.json / merges.txt) are filler vocabularies on purpose
DELIBERATELY_NOT_PUBLISHED = {"llada-8b-instruct": {"tokenizer.json"},
                              "dream-v0-instruct-7b": {"vocab.json", "merges.txt"}}


@pytest.mark.parametrize("name", sorted(DELIBERATELY_NOT_PUBLISHED))
def test_generator_writes_every_published_field(name, tmp_path):
    written = write_published_files(tmp_path, name)
    golden = sorted(p.name for p in (GOLDEN / name).glob("*.json"))
    assert sorted(p.name for p in written.iterdir()) == sorted(golden + list(DELIBERATELY_NOT_PUBLISHED[name]))
    for file in golden:
        ours, theirs = json.loads((written / file).read_text()), json.loads((GOLDEN / name / file).read_text())
        assert set(ours) == set(theirs), (file, set(ours) ^ set(theirs))
        for key in theirs:
            assert ours[key] == theirs[key], (file, key)


def test_llada_15_fixture_is_the_instruct_files():
    assert PUBLISHED_MODELS["llada-1.5"].files == PUBLISHED_MODELS["llada-8b-instruct"].files
    assert "not checked" in PUBLISHED_MODELS["llada-1.5"].verified


def test_llada_added_tokens_are_contiguous_and_named():
    assert sorted(LLADA_ADDED_TOKENS) == list(range(126080, 126349))
    assert (LLADA_ADDED_TOKENS[126084] == "<|reserved_token_0|>"
            and LLADA_ADDED_TOKENS[126337] == "<|reserved_token_253|>")


FAMILIES = ["llada", "dream"]


@pytest.fixture(scope="module")
def narrow_dirs(tmp_path_factory):
    """Published-shaped directories, sizes shrunk, bf16 weights (LLaDA's config.json without torch_dtype)."""
    return {f: write_published_checkpoint(tmp_path_factory.mktemp(f), f, 1, NARROW[f]) for f in FAMILIES}


@pytest.fixture(params=FAMILIES)
def narrow_bf16(request, narrow_dirs):
    return request.param, narrow_dirs[request.param]


def test_published_config_loads_in_the_weights_dtype(narrow_bf16, capsys):
    family, directory = narrow_bf16
    config = json.loads((directory / "config.json").read_text())
    assert ("torch_dtype" in config) == (family == "dream")  # LLaDA publishes none
    assert polestar.load(directory).dtype == torch.bfloat16
    assert main(["generate", "--model", str(directory), "--prompt", "hi", "--gen-length", "8", "--block-length", "8",
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[0])["dtype"] == "bfloat16"
    assert "loads in bfloat16" in captured.err  # the one-line summary printed before loading
    report = inspect_checkpoint(directory)
    assert report.dtype.dtype == torch.bfloat16 and report.dtype.on_disk[0][0] == "bfloat16"
    assert report.refused == () and report.preset is None and "no preset matches" in report.preset_reason


def _rewrite(directory: Path, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_mixed_dtypes_load_in_the_majority_and_say_so(tmp_path):
    directory = tmp_path / "mixed"
    shutil.copytree(resolve_checkpoint("tiny-llada"), directory)
    _rewrite(directory, lambda c: c.pop("torch_dtype"))
    tensors = load_file(str(directory / "model.safetensors"))
    big = max(tensors, key=lambda n: tensors[n].numel())  # the embedding: fewer bytes than everything else
    tensors = {n: t if n == big else t.to(torch.bfloat16) for n, t in tensors.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = polestar.load(directory)
    assert model.dtype == torch.bfloat16
    lines = [str(w.message) for w in caught if "mixed weight dtypes" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and "bfloat16" in lines[0] and "float32" in lines[0]


def test_float32_weights_without_torch_dtype_stay_float32(tmp_path):
    directory = tmp_path / "f32"
    shutil.copytree(resolve_checkpoint("tiny-dream"), directory)
    _rewrite(directory, lambda c: c.pop("torch_dtype"))
    assert polestar.load(directory).dtype == torch.float32


REFUSED = {
    "llada": [("rope", False), ("alibi", True), ("yarn", True), ("rope_scaling", {"type": "linear", "factor": 2.0}),
              ("rope_full_precision", False)],
    "dream": [("use_sliding_window", True), ("use_mrope", True), ("rope_scaling", {"type": "yarn", "factor": 4.0}),
              ("hidden_act", "gelu")],
}


@pytest.mark.parametrize("family,field,value", [(f, k, v) for f, items in REFUSED.items() for k, v in items])
def test_fields_the_engine_cannot_honour_are_refused_before_the_weights(family, field, value, narrow_dirs, tmp_path):
    source = narrow_dirs[family]
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    (only_config / "config.json").write_text((source / "config.json").read_text())
    _rewrite(only_config, lambda c: c.__setitem__(field, value))
    with pytest.raises(ValueError, match=rf"{field}=") as err:  # not "no model.safetensors": weights never looked at
        polestar.load(only_config)
    assert "\n" not in str(err.value)
    full = tmp_path / "full"
    shutil.copytree(source, full)
    _rewrite(full, lambda c: c.__setitem__(field, value))
    report = inspect_checkpoint(full)  # inspect reports, does not raise
    assert any(field in r for r in report.refused) and "REFUSED" in report.summary()


def test_text_fields_the_loader_reads(narrow_bf16):
    family, directory = narrow_bf16
    model = polestar.load(directory)
    tok = model.tokenizer
    assert tok("ab")["input_ids"] == _bytes("ab")  # add_bos_token false: no BOS is added
    if family == "dream":
        assert (tok.bos_token, tok.bos_token_id) == ("<|beginoftext|>", 151665)
        assert tok.mask_token_id == model.spec.mask_id == 151666
        assert tok.decode([151657], skip_special_tokens=True) == "<tool_call>"  # ids 151657-151664 are not special
        assert tok.decode([151644], skip_special_tokens=True) == ""
    else:
        assert (tok.bos_token, tok.bos_token_id) == ("<|startoftext|>", 126080)
        assert tok.convert_tokens_to_ids("<|mdm_mask|>") == model.spec.mask_id == 126336
        assert tok.cls_token == "[CLS]" and tok.convert_tokens_to_ids("<role>") == 126340
        assert tok.decode([126340], skip_special_tokens=True) == ""  # every added LLaDA token is special
    assert inspect_checkpoint(directory).tokenizer.stop_ids == model.text_defaults.stop_ids


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_inspect_stop_ids_match_the_loader_on_shipped_checkpoints(name):
    assert inspect_checkpoint(name).tokenizer.stop_ids == polestar.load(name).text_defaults.stop_ids


def test_chat_ids_equal_the_published_template(narrow_bf16):
    family, directory = narrow_bf16
    name = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}[family]
    published = json.loads((GOLDEN / name / "tokenizer_config.json").read_text())
    model = polestar.load(directory)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "2+2?"}]
        text = env.from_string(published["chat_template"]).render(
            messages=messages, add_generation_prompt=True, bos_token=published["bos_token"], tools=None)
        want = model.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, _ = polestar.api.encode_prompts(model, ["2+2?"], chat=True, system=system)
        assert ids[0].tolist() == want == expected_chat_ids(family, "2+2?", system)


GSM8K_STYLE = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"


@pytest.mark.parametrize("preset", preset_names())
def test_lm_eval_prompt_ids_per_preset(preset, narrow_dirs, monkeypatch):
    directory = narrow_dirs[get_preset(preset).match["model_type"].lower()]
    lm = PolestarLM(pretrained=str(directory), preset="table1", model_preset=preset, policy="fast-dllm",
                    gen_length=8, block_length=8, device="cpu")
    seen = []
    monkeypatch.setattr(polestar, "generate", lambda model, prompts, **kw: seen.append(prompts) or _Stub(prompts))
    lm.generate_until([Instance("generate_until", {}, (GSM8K_STYLE, {"until": ["\n\n"]}), 0, ("gsm8k", 0, 1))])
    ids = seen[0][0]
    if preset == "dream-v0-instruct-7b":  # Dream's add_bos_token=true
        assert ids == [151665] + _bytes(GSM8K_STYLE)
    elif preset == "llada-8b-instruct":  # the authors' harness: chat template for instruct models
        assert ids == expected_chat_ids("llada", GSM8K_STYLE, None)
    else:  # llada-1.5: plain text
        assert ids == _bytes(GSM8K_STYLE)


class _Stub:
    """What :meth:`PolestarLM._generate` reads of a :func:`polestar.generate` result."""

    def __init__(self, prompts):
        from polestar.stats import RunStats

        self.generations = torch.zeros(len(prompts), 8, dtype=torch.long)
        self.stats = RunStats.merge([])


def test_inspect_cli_json(narrow_bf16, capsys):
    family, directory = narrow_bf16
    assert main(["inspect", str(directory), "--json", "--batch-size", "4", "--length", "100"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["family"] == family and facts["load_dtype"] == "bfloat16"
    assert facts["kv_bytes"]["bytes"] == facts["kv_bytes_per_token"] * 400
    assert facts["tokenizer"]["chat_template"] is True and facts["refused"] == []


def _sparse_checkpoint(directory: Path, name: str, n_layers: int) -> Path:
    """A published-shaped directory at full width whose shards are real safetensors headers over sparse (unwritten)
    data: the sizes of a real download, none of its disk space."""
    model = PUBLISHED_MODELS[name]
    config = {**model.config, model.layers_key: n_layers}
    write_published_files(directory, name, config)
    spec = FAMILIES_SPEC[model.family](config)
    header, offset = {}, 0
    for tensor, shape in expected_shapes(spec).items():
        n = 2 * int(torch.Size(shape).numel())
        header[tensor] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("n_layers", [1, 32])
def test_inspect_full_width_in_seconds(n_layers, tmp_path):
    """Full-width LLaDA-8B-Instruct directories (one layer: 2.6 GB of bf16 weights; 32 layers: 16 GB) are read
    from their headers only, in under 10 s and under 1 GB of memory."""
    directory = _sparse_checkpoint(tmp_path / "LLaDA-8B-Instruct", "llada-8b-instruct", n_layers)
    # peak memory of the command's own address space (VmHWM; ru_maxrss would also count the forking parent's) and
    # the command's own time (not the interpreter's start and torch's import, which a loaded machine stretches)
    code = ("import sys, time; from polestar.cli import main; t = time.perf_counter(); "
            "main(['inspect', sys.argv[1], '--json']); print(time.perf_counter() - t, file=sys.stderr); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, check=True)
    elapsed = float(done.stderr.strip().splitlines()[-2])
    facts = json.loads(done.stdout)
    assert facts["load_dtype"] == "bfloat16" and facts["refused"] == []
    assert "no torch_dtype" in facts["load_dtype_source"]
    if n_layers == 32:  # the published model: its preset, chat-formatted evaluation prompts
        assert facts["preset"]["name"] == "llada-8b-instruct" and facts["preset"]["chat"] is True
        assert 7.9e9 < facts["n_params"] < 8.1e9
    else:
        assert facts["preset"] is None and "n_layers=1 (preset: 32)" in facts["preset_reason"]
    assert int(done.stderr.strip().splitlines()[-1]) < 1 << 20  # VmHWM in KiB: under 1 GiB
    assert elapsed < 10, elapsed
