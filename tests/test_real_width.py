"""Checkpoints as wide as the published LLaDA-8B-Instruct and Dream-v0-Instruct-7B (published config.json,
tokenizer and generation files; one layer; sharded bf16; random weights): loading in the memory of the weights,
logits against the independent reference forward, and the chat format of the real-id tokenizers."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import polestar
from polestar.models.published import PUBLISHED, write_published_checkpoint
from tests.reference import naive_logits
from tests.test_chat import expected_chat_ids

#: peak host memory while loading, above the import baseline, as a multiple of the checkpoint's bytes on disk
HOST_BOUND = 1.3
#: peak device memory while loading on CUDA, as a multiple of the weights' bytes
DEVICE_BOUND = 1.05

_MEASURE = """
import json, sys
import torch, transformers, tokenizers  # noqa: F401  (the import baseline includes every library loading uses)
import polestar

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
base = status("VmRSS")
model = polestar.load(sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"base": base, "peak": status("VmHWM"), "weights": weights, "dtype": str(model.dtype)}))
"""


@pytest.fixture(scope="session")
def real_width(tmp_path_factory):
    """family → directory, each built on first use (about 2.5 GB on disk) and deleted at the end."""
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = write_published_checkpoint(tmp_path_factory.mktemp(f"{family}-real"), family, 1)
        return built[family]

    yield get
    for directory in built.values():
        shutil.rmtree(directory, ignore_errors=True)


def _disk_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_config_is_published_but_for_depth(real_width, family):
    directory = real_width(family)
    published, _, generation, layers_key = PUBLISHED[family]
    cfg = json.loads((directory / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != layers_key} == {k: v for k, v in published.items() if k != layers_key}
    assert cfg[layers_key] == 1
    assert json.loads((directory / "generation_config.json").read_text()) == generation
    assert len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 3


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_peak_host_memory_while_loading(real_width, family):
    directory = real_width(family)
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(directory)], capture_output=True, text=True, check=True)
    m = json.loads(run.stdout.strip().splitlines()[-1])
    disk = _disk_bytes(directory)
    ratio = (m["peak"] - m["base"]) / disk
    print(f"\n{family}: {disk / 1e9:.2f} GB on disk, peak RSS above import {(m['peak'] - m['base']) / 1e9:.2f} GB "
          f"= {ratio:.3f}x")
    assert m["dtype"] == "torch.bfloat16" and m["weights"] <= disk
    assert ratio <= HOST_BOUND


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-memory bound needs CUDA")
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_peak_device_memory_while_loading(real_width, family):
    directory = real_width(family)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = polestar.load(directory, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - before <= DEVICE_BOUND * weights
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_weights_logits_and_chat_at_full_width(real_width, family):
    directory = real_width(family)
    model = polestar.load(directory)
    state = model.state_dict()
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    for name in (sorted(index)[0], sorted(index)[-1]):
        with safe_open(directory / index[name], framework="pt") as f:
            assert torch.equal(state[name], f.get_tensor(name)), name
    ids = polestar.api.encode_prompts(model, ["Hello there"], chat=True)[0]
    assert ids[0].tolist() == expected_chat_ids(family, "Hello there", None)
    with torch.inference_mode():
        bf16 = model(ids).float()
        model.float()  # the reference forward computes in float32; compare both at that precision
        got, ref = model(ids), naive_logits(model, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bf16, ref, atol=0.1, rtol=0.05)
    del model, state
