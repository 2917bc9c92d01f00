"""The backbone's fused projections and its rotation form: q/k/v and gate/up each one weight whose rows the
checkpoint's parameters are views of, kept so through moves, casts and hand-assigned parameters; the rotation of
q and k heads together equal to the half-split formula bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import polestar
from polestar.models.backbone import _fused_groups
from polestar.models.layers import Rotary
from polestar.testing import tiny_model
from tests.reference import naive_logits


def _all_fused(model) -> bool:
    """Every fused group's parameters lie back to back in the layer's fused tensor (shared storage)."""
    for layer in range(model.spec.n_layers):
        with torch.no_grad():  # under autograd the pass concatenates the parameters instead
            fused = model.projections(layer)
        parts = model.layer_parts(layer)
        for whole, params in zip(fused, _fused_groups(parts)):
            if whole is None:
                assert params[0] is None
                continue
            offset = 0
            for p in params:
                if p.data_ptr() != whole[offset].data_ptr():
                    return False
                offset += p.shape[0]
            assert offset == whole.shape[0]
    return True


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_parameters_are_views_of_one_fused_tensor_per_group(family):
    model = tiny_model(family)
    assert _all_fused(model)
    weights = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        fused = sum(t.numel() for layer in range(model.spec.n_layers) for t in model.projections(layer)
                    if t is not None)
    parts = [model.layer_parts(layer) for layer in range(model.spec.n_layers)]
    separate = sum(p.numel() for ps in parts for group in _fused_groups(ps) for p in group if p is not None)
    assert fused == separate  # nothing stored twice: the fused tensors are the parameters' storage
    assert weights == sum(p.numel() for p in tiny_model(family).parameters())


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fused_pass_equals_the_separate_projections(family):
    model = tiny_model(family, seed=5)
    ids = torch.randint(0, 38, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), naive_logits(model, ids), atol=1e-5, rtol=1e-5)
        parts, w = model.layer_parts(0), model.projections(0)
        x = torch.randn(2, 5, model.spec.d_model)
        separate = torch.cat([parts.q(x), parts.k(x), parts.v(x)], dim=-1)
        assert torch.equal(F.linear(x, w.qkv, w.qkv_bias), separate)
        assert torch.equal(F.linear(x, w.gate_up, w.gate_up_bias), torch.cat([parts.gate(x), parts.up(x)], dim=-1))


def test_a_cast_and_a_move_keep_the_projections_fused_and_the_logits():
    model = tiny_model("llada", seed=2)
    ids = torch.randint(0, 38, (1, 9))
    with torch.no_grad():
        before = model(ids)
        model.double()
        assert model.projections(0).qkv.dtype == torch.float64 and _all_fused(model)
        model.to(torch.float32)
        assert _all_fused(model)
        assert torch.equal(model(ids), before)


def test_a_parameter_replaced_by_hand_is_fused_again_before_the_next_decode():
    model = tiny_model("llada", seed=4)
    prompts = [[5, 17, 3]]
    first = polestar.generate(model, prompts, policy="fast-dllm", gen_length=16, block_length=8)
    parts = model.layer_parts(1)
    with torch.no_grad():
        parts.k.weight = torch.nn.Parameter(parts.k.weight.detach().clone() * 3.0)  # no longer in the fused tensor
        assert not _all_fused(model)
        expected = naive_logits(model, torch.tensor([[5, 17, 3, 39, 39]]))
        changed = polestar.generate(model, prompts, policy="fast-dllm", gen_length=16, block_length=8)
        assert _all_fused(model)
        assert torch.equal(model.projections(1).qkv[model.spec.d_model : 2 * model.spec.d_model], parts.k.weight)
        torch.testing.assert_close(model(torch.tensor([[5, 17, 3, 39, 39]])), expected, atol=1e-5, rtol=1e-5)
    assert changed.tokens.shape == first.tokens.shape


def test_training_reaches_every_projection_parameter_through_the_fused_pass():
    model = tiny_model("dream", seed=6).train()
    logits = model(torch.randint(0, 38, (2, 7)))
    logits.logsumexp(-1).sum().backward()
    for group in _fused_groups(model.layer_parts(0)):
        for p in group:
            if p is not None:
                assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():  # an optimizer's in-place update lands in the fused tensor the decode reads
        w = model.layer_parts(0).up.weight
        w.add_(1.0)
        assert torch.equal(model.projections(0).gate_up[model.spec.mlp_hidden :], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_q_and_k_heads_together_equals_the_half_split_formula(dtype):
    rotary = Rotary(16, 10000.0)
    positions = torch.randint(0, 300, (3, 9))
    x = torch.randn(3, 9, 6, 16).to(dtype)
    cos, sin = rotary.cos_sin(positions)
    expected = Rotary.apply(x.transpose(1, 2), cos, sin).transpose(1, 2)
    table = rotary.table(positions)
    assert torch.equal(Rotary.rotate(x, table.cos, table.sin), expected)
    rows = torch.tensor([[4, 0], [8, 8], [1, 2]])
    picked = table.rows(rows)
    assert torch.equal(picked.cos, table.cos.gather(1, rows[:, :, None, None].expand(-1, -1, 1, 16)))
    assert table.cat(picked).cos.shape == (3, 11, 1, 16)
