"""Checkpoints as wide as the published LLaDA-8B-Instruct (and, where CUDA exists, Dream-v0-Instruct-7B) —
published config.json, tokenizer and generation files; one layer; sharded bf16; random weights: loading in the
memory of the weights, logits against the independent reference forward, and the chat format of the real-id
tokenizer. On CPU one family is loaded at full width (the loader's path is the same for both; Dream's fields,
chat ids and grouped K/V are checked narrow in tests/test_published_files.py, tests/test_chat.py and
tests/test_models.py), which keeps the suite within its time budget."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import polestar
from polestar.fixtures import write_published_checkpoint
from polestar.models.published import PUBLISHED
from tests.test_chat import expected_chat_ids

ROOT = Path(__file__).resolve().parents[1]
#: families loaded at full width by the CPU tests (one 2.5 GB checkpoint write and load each)
FULL_WIDTH_ON_CPU = ["llada"]
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
peak = status("VmHWM")
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"base": base, "peak": peak, "weights": weights, "dtype": str(model.dtype)}))
"""

# after the measurement, the same process checks what it loaded (one 2.5 GB load per family)
_CHECK = """
from safetensors import safe_open
from tests.reference import naive_logits

directory = sys.argv[1]
index = json.load(open(directory + "/model.safetensors.index.json"))["weight_map"]
state = model.state_dict()
same = []
for name in sorted(index):
    with safe_open(directory + "/" + index[name], framework="pt") as f:
        same.append(bool(torch.equal(state[name], f.get_tensor(name))))
ids = polestar.api.encode_prompts(model, ["Hello there"], chat=True)[0]
with torch.inference_mode():
    bf16 = model(ids).float()
    model.float()  # the reference forward computes in float32; compare both at that precision
    got, ref = model(ids), naive_logits(model, ids)
print(json.dumps({"same": same, "chat_ids": ids[0].tolist(), "f32_diff": (got - ref).abs().max().item(),
                  "bf16_diff": (bf16 - ref).abs().max().item(), "ref_scale": ref.abs().max().item()}))
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


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL_WIDTH_ON_CPU)
def test_config_is_published_but_for_depth(real_width, family):
    directory = real_width(family)
    published, _, generation, layers_key = PUBLISHED[family]
    cfg = json.loads((directory / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != layers_key} == {k: v for k, v in published.items() if k != layers_key}
    assert cfg[layers_key] == 1
    assert json.loads((directory / "generation_config.json").read_text()) == generation
    assert len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 3


@pytest.fixture(scope="session")
def measured(real_width):
    """family → (memory facts, checks) from one subprocess that loads the checkpoint."""
    done = {}

    def get(family: str):
        if family not in done:
            directory = real_width(family)
            run = subprocess.run([sys.executable, "-c", _MEASURE + _CHECK, str(directory)], capture_output=True,
                                 text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert run.returncode == 0, run.stderr[-3000:]
            lines = run.stdout.strip().splitlines()
            done[family] = json.loads(lines[-2]), json.loads(lines[-1])
        return done[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL_WIDTH_ON_CPU)
def test_peak_host_memory_while_loading(real_width, measured, family):
    m, _ = measured(family)
    disk = _disk_bytes(real_width(family))
    ratio = (m["peak"] - m["base"]) / disk
    print(f"\n{family}: {disk / 1e9:.2f} GB on disk, peak RSS above import {(m['peak'] - m['base']) / 1e9:.2f} GB "
          f"= {ratio:.3f}x")
    assert m["dtype"] == "torch.bfloat16" and m["weights"] <= disk
    assert ratio <= HOST_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL_WIDTH_ON_CPU)
def test_weights_logits_and_chat_at_full_width(measured, family):
    _, c = measured(family)
    assert c["same"] and all(c["same"])  # every tensor holds its file's bytes
    assert c["chat_ids"] == expected_chat_ids(family, "Hello there", None)
    assert c["f32_diff"] <= 1e-4 * max(1.0, c["ref_scale"])
    assert c["bf16_diff"] <= 0.05 + 0.02 * c["ref_scale"]  # bf16 rounding only (random logits tie too often for argmax)


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
