"""The in-place safetensors loader (polestar.models.loading / safetensors_io): exact bytes, dtype handling and
one-line errors for broken checkpoint directories."""

import json
import struct

import pytest
import torch
from safetensors import safe_open

from polestar.models.loading import load_model, save_model
from polestar.models.safetensors_io import read_header
from tests.conftest import make_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small LLaDA saved as bf16 in two layouts: one file, and shards."""
    model = make_model("llada").to(torch.bfloat16)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    save_model(model, single)
    save_model(model, sharded, shard_size=3)
    return model, single, sharded


def _file_tensors(directory):
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(directory / name, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_weights_are_the_files_bytes(saved, layout):
    _, single, sharded = saved
    directory = single if layout == "single" else sharded
    loaded = load_model(directory)
    assert loaded.dtype == torch.bfloat16  # the checkpoint's torch_dtype is the default
    state = loaded.state_dict()
    for name, t in _file_tensors(directory).items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], t), name


def test_explicit_dtype_converts_through_staging(saved):
    model, single, _ = saved
    loaded = load_model(single, dtype="float32")
    assert loaded.dtype == torch.float32
    for name, t in _file_tensors(single).items():
        assert torch.equal(loaded.state_dict()[name], t.float()), name
    ids = torch.randint(0, 38, (1, 7))
    torch.testing.assert_close(loaded(ids), model.float()(ids))
    model.to(torch.bfloat16)


def test_default_dtype_follows_config(tmp_path):
    save_model(make_model("dream"), tmp_path)  # float32 weights
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert load_model(tmp_path).dtype == torch.float32
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path).dtype == torch.bfloat16


def test_truncated_file_is_named(saved, tmp_path):
    _, single, _ = saved
    data = (single / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json"):
        if (single / name).is_file():
            (tmp_path / name).write_bytes((single / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated: .* but the file has \d+; re-download"):
        load_model(tmp_path)
    (n,) = struct.unpack("<Q", data[:8])
    (tmp_path / "model.safetensors").write_bytes(data[: 8 + n // 2])
    with pytest.raises(ValueError, match="truncated: its header says"):
        load_model(tmp_path)


def test_missing_shard_is_named(saved, tmp_path):
    _, _, sharded = saved
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard {shard.name}, which is missing"):
        load_model(tmp_path)


def test_header_entries_match_safetensors(saved):
    _, single, _ = saved
    entries = read_header(single / "model.safetensors")
    with safe_open(single / "model.safetensors", framework="pt") as f:
        assert set(entries) == set(f.keys())
        for name, e in entries.items():
            assert e.shape == tuple(f.get_slice(name).get_shape()) and e.dtype == torch.bfloat16
            assert e.end - e.start == f.get_tensor(name).numel() * 2


def test_non_finite_weights_load_as_they_are(tmp_path):
    """NaN / inf in a weight tensor is the checkpoint's content, not a loading error: it arrives unchanged."""
    model = make_model("llada")
    with torch.no_grad():
        model.model.transformer["ln_f"].weight[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    save_model(model, tmp_path)
    loaded = load_model(tmp_path).model.transformer["ln_f"].weight
    assert loaded[0].isnan() and loaded[1] == float("inf") and loaded[2] == -float("inf")
