"""A run of layers as one scan over the layer-stacked tensors (polestar.models.layer_scan): equal to the layers run
one by one, the stacks the storage of every layer's tensors, and the step's Python writes after a scan kept by a
compile."""

import pytest
import torch

from polestar.models import layer_regions, layer_scan
from polestar.models.layer_regions import LayerWeights
from polestar.testing import tiny_model

pytestmark = pytest.mark.skipif(not layer_scan.available(), reason="this torch has no usable scan operator")


def _inputs(model, layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    spec = model.spec
    B, X, T = 2, 5, 11
    h = torch.randn(B, X, spec.d_model, generator=g)
    index = torch.tensor([[0, 2, 4, 6, 8], [1, 3, 5, 7, T]])  # the second row's last slot is the trash slot
    cos, sin = model.rotary.table(index)
    key_valid = torch.ones(B, T + 1, dtype=torch.bool)
    key_valid[:, -1] = False
    kv = (layers, B, spec.n_kv_heads, T + 1, spec.head_dim)
    keys, values = torch.randn(*kv, generator=g), torch.randn(*kv, generator=g)
    return h, index, cos, sin, key_valid, keys, values


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_scan_of_plain_layers_equals_the_layers_one_by_one(family):
    model = tiny_model(family, seed=1, n_layers=3)
    spec = model.spec
    h, index, cos, sin, key_valid, keys, values = _inputs(model, 3)
    weights = model.stacked_weights()
    args = (h, index, cos, sin, key_valid, keys, values, weights, spec.norm_eps, spec.n_heads, spec.n_kv_heads)
    with torch.no_grad():
        expected = layer_scan.plain_layers_eager(*args)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # as a compiled step traces
            compiled = torch.compile(layer_scan.plain_layers, backend="aot_eager", fullgraph=True)(*args)
    for a, b in zip(compiled, expected):  # (a scan is traced in a compile only: a whole-step compile runs it)
        assert torch.equal(a, b)
    assert torch.equal(keys, _inputs(model, 3)[5])  # the given stacks left as they were; the rows written after:
    layer_scan.write_rows(keys, index, compiled[1])
    with torch.no_grad():
        cache = _inputs(model, 3)[5]
        rows = h
        for layer in range(3):  # the layers one by one, each writing its cache in place
            rows, cache_k, _ = layer_regions.decoder_layer(rows, index, cos, sin, key_valid, cache[layer],
                                                           values[layer], *(t[layer] if t is not None else None
                                                                            for t in weights),
                                                           spec.norm_eps, spec.n_heads, spec.n_kv_heads)
            cache[layer].copy_(cache_k)
    assert torch.equal(keys, cache)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_layer_tensor_is_a_row_of_its_stack(family):
    model = tiny_model(family, seed=2, n_layers=3).requires_grad_(False)  # (under autograd a pass concatenates)
    stacks = model.stacked_weights()
    assert isinstance(stacks, LayerWeights)
    for layer in range(3):
        for field, row in zip(LayerWeights._fields, model.layer_weights(layer)):
            stack = getattr(stacks, field)
            assert (row is None) == (stack is None), field
            if row is not None:
                assert row.data_ptr() == stack[layer].data_ptr() and torch.equal(row, stack[layer]), field
    model.double()  # a cast moves each stack as one tensor and keeps the layers' tensors its rows
    stacks = model.stacked_weights()
    assert stacks.down.dtype == torch.float64
    assert model.layer_parts(2).down.weight.data_ptr() == stacks.down[2].data_ptr()


def test_a_python_write_made_after_a_scan_is_kept_by_a_compiled_function():
    class Counter:
        def __init__(self):
            self.n = 0

    def body(carry, xs):
        return carry @ xs[0], (carry + 1).clone()

    def step(x, w, counter):
        counter.n += 5  # touched before the scan ...
        y, _ = layer_scan.scan(body, x, (w,))
        counter.n += 7  # ... written after it
        counter.seen = counter.n
        return y

    x, w = torch.randn(3, 3), torch.randn(4, 3, 3)
    counter = Counter()
    y = torch.compile(step, backend="aot_eager", fullgraph=True)(x, w, counter)
    assert (counter.n, counter.seen) == (12, 12)
    assert torch.allclose(y, step(x, w, Counter()))
