"""edit_dynamics: RA's first-order prediction of the logit change after one SGD step on W_q, W_k
against the real step, on tiny float64 models; the model left untouched; clear errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import PROMPTS as ALL_PROMPTS
from helpers import bridge_model

import ra_lens
from ra_lens.dynamics import EditDynamics, edit_dynamics
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model

PROMPTS = ALL_PROMPTS[:2]  # unequal lengths: padded
TARGETS = [5, 7]
# Bridges the prediction is exact for: GPT-2 (biases, split fused qkv), Llama (rotary + GQA),
# OPT (attention delegated to HF, RA via hook_z) and boot_native (biases, no real scores hook).
ARCHS = ["llama", "gpt2", "native", "opt"]


def bridge(arch: str, **kwargs):
    return bridge_model(arch, dtype=torch.float64, **kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return bridge(request.param)


@pytest.fixture(scope="module")
def llama():
    return bridge("llama")


def run(model, lr: float, **kwargs) -> EditDynamics:
    return edit_dynamics(model, PROMPTS, target_nll(TARGETS), lr, **kwargs)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_prediction_matches_small_step(model):
    dyn = run(model, 1e-3)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    n_pos = int(ra_lens.to_batch(model, PROMPTS).tokens.shape[1])
    assert dyn.predicted.shape == (2, n_layers, n_heads, n_pos, n_pos)
    assert dyn.actual.shape == dyn.predicted.shape == dyn.predicted_pattern.shape
    assert dyn.cosine.shape == dyn.relative_error.shape == (n_layers, n_heads)
    assert dyn.layers == list(range(n_layers)) and dyn.lr == 1e-3
    assert dyn.actual.abs().max() > 0
    assert dyn.cosine.min() > 0.99
    assert dyn.relative_error.max() < 1e-2
    assert dyn.pattern_cosine.min() > 0.99
    # RA gives dL/dW_q, dL/dW_k exactly (up to RA's float32 storage) ...
    assert dyn.grad_error.max() < 1e-5
    # ... and Z is bilinear in (W_q, W_k) with X fixed: first + second order is the whole change.
    assert relative(dyn.predicted + dyn.second_order, dyn.actual) < 1e-5


def test_error_is_first_order_and_grows_with_lr(llama):
    lrs = [1e-3, 1e-1, 10.0, 100.0]
    runs = [run(llama, lr) for lr in lrs]
    errors = [float(d.relative_error.mean()) for d in runs]
    assert errors == sorted(errors) and errors[-1] > 10 * errors[0]
    # O(lr): 100x the step gives about 100x the relative error while the step is small.
    assert 30 < errors[1] / errors[0] < 300
    cosines = [float(d.cosine.mean()) for d in runs]
    assert cosines[0] > 0.999 and cosines[-1] < cosines[0]
    # The neglected term is exactly dQ dK^T, however large the step.
    for d in runs:
        assert relative(d.predicted + d.second_order, d.actual) < 1e-5


def test_masked_to_real_causal_triangle(llama):
    dyn = run(llama, 1e-2)
    n_pos = dyn.predicted.shape[-1]
    upper = torch.ones(n_pos, n_pos, dtype=torch.bool).triu(1)
    for field in (dyn.predicted, dyn.actual, dyn.second_order, dyn.predicted_pattern):
        assert (field[..., upper] == 0).all()
        for i, n in enumerate(dyn.lengths.tolist()):
            assert (field[i, :, :, n:] == 0).all()
    assert dyn.lengths.tolist()[0] != dyn.lengths.tolist()[1]


def test_pattern_change_rows_sum_to_zero(llama):
    dyn = run(llama, 1e-2)
    assert dyn.predicted_pattern.sum(-1).abs().max() < 1e-12
    assert dyn.actual_pattern.sum(-1).abs().max() < 1e-12


def test_layer_subset(llama):
    dyn = run(llama, 1e-3, layers=[1])
    assert dyn.layers == [1] and dyn.predicted.shape[1] == 1
    assert dyn.cosine.shape == (1, llama.cfg.n_heads)
    full = run(llama, 1e-3)
    assert torch.allclose(dyn.predicted[:, 0], full.predicted[:, 1])


def test_tokens_as_ids(llama):
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 61, 12]])
    dyn = edit_dynamics(llama, ids, target_nll([4]), 1e-3)
    assert dyn.cosine.min() > 0.99


@pytest.mark.parametrize("lr", [0, -1e-3, math.nan, math.inf, True, "0.1"])
def test_bad_lr(llama, lr):
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        edit_dynamics(llama, PROMPTS, target_nll(TARGETS), lr)


@pytest.mark.parametrize("layers", [[2], [-1], []])
def test_layer_out_of_range(llama, layers):
    with pytest.raises(ValueError, match="out of range"):
        run(llama, 1e-3, layers=layers)


def test_unsupported_projection():
    model = bridge("native", n_layers=1)
    model.blocks[0].attn.q._original_component = torch.nn.Identity()
    with pytest.raises(NotImplementedError, match="nn.Linear.*supported"):
        run(model, 1e-3)


def test_unsupported_attention_form():
    """A q projection that is not the bare affine map (here doubled by a hook) is refused."""
    model = bridge("native", n_layers=1)
    model.blocks[0].attn.q.original_component.register_forward_hook(lambda m, i, out: 2 * out)
    with pytest.raises(NotImplementedError, match="hook_q = X W_q"):
        run(model, 1e-3)


def test_pattern_not_the_softmax_of_qk(monkeypatch):
    """A pattern that is not the softmax the facts describe (here facts read with half the true
    scale) fails the one recompute check every route uses, as edit dynamics' refusal."""
    model = bridge("native", n_layers=1)
    read = ra_lens.contract.attention_facts

    def wrong_scale(model, layer):
        facts = read(model, layer)
        return dataclasses.replace(facts, scale=facts.scale / 2)

    monkeypatch.setattr(ra_lens.contract, "attention_facts", wrong_scale)  # model_facts reads it
    with pytest.raises(NotImplementedError, match="differs from hook_pattern.*supported"):
        run(model, 1e-3)


def test_hooked_transformer_not_supported():
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:
        pytest.skip("HookedTransformer needs TransformerLens 2.x")
    model = tiny_model("hooked", dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="supported"):
        run(model, 1e-3)


def test_a_rotation_the_facts_name_but_cannot_be_read_is_refused(monkeypatch, llama):
    """Whether a layer rotates q/k is read once per call (`AttentionFacts.rotary`); a layer the
    facts call rotary whose rotation cannot be read (here a GPT-2-style bridge's facts marked
    rotary: no rotation hooks, no cos/sin tables) is refused before any prediction."""
    assert [f.rotary for f in ra_lens.contract.model_facts(llama).attention] == [True, True]
    model = bridge("native", n_layers=1)
    assert not ra_lens.contract.model_facts(model).attention[0].rotary
    read = ra_lens.contract.attention_facts

    def rotary(model, layer):
        return dataclasses.replace(read(model, layer), rotary=True)

    monkeypatch.setattr(ra_lens.contract, "attention_facts", rotary)  # model_facts reads it
    with pytest.raises(NotImplementedError, match="layer 0 rotates q/k and ra-lens cannot read"):
        run(model, 1e-3)
