"""capture.recorded, the one recorder of hook-point values and gradients, and
capture.require_live_patterns, the model-contract check that patching and attribution share."""

from __future__ import annotations

import pytest
import torch
from helpers import FLORENCE, all_archs, bridge_model, hook_count, live_archs

from ra_lens import capture
from ra_lens.capture import PATTERN, RESID_PRE, Z
from ra_lens.toy_models import tiny_model


def _kept(store: dict, name: str):
    def hook(x, hook):
        store[name] = x

    return hook


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return -logits[0, -1].log_softmax(-1)[5]


@pytest.mark.parametrize("arch", all_archs())
def test_recorded_keeps_detached_copies_of_the_forward_values(arch):
    model = tiny_model(arch)
    tokens = model.to_tokens(FLORENCE)
    names = [Z.format(1), PATTERN.format(0)]
    expected: dict = {}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, _kept(expected, n)) for n in names]):
        model(tokens)
    hooks_before = hook_count(model)
    with torch.no_grad(), capture.recorded(model, [*names, "blocks.0.attn.hook_nope"]) as acts:
        model(tokens)
        model(tokens[:, :3])  # a second pass does not overwrite the first value
    assert hook_count(model) == hooks_before
    assert sorted(acts) == sorted(names)  # a name the model lacks is skipped
    for name in names:
        torch.testing.assert_close(acts[name], expected[name], rtol=0, atol=0)
        assert acts[name].data_ptr() != expected[name].data_ptr()  # a copy, not a view


@pytest.mark.parametrize("arch", live_archs())
def test_recorded_gradients_equal_autograd(arch):
    model = tiny_model(arch, dtype=torch.float64)
    tokens = model.to_tokens(FLORENCE)
    names = [PATTERN.format(layer) for layer in range(model.cfg.n_layers)]
    patterns: dict = {}
    with model.hooks(fwd_hooks=[(n, _kept(patterns, n)) for n in names]):
        loss = _loss(model(tokens))
    expected = torch.autograd.grad(loss, [patterns[n] for n in names])
    store: dict = {}
    leaf = [(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]
    hooks_before = hook_count(model)
    with model.hooks(fwd_hooks=leaf), capture.recorded(model, names, grad=True) as grads:
        torch.autograd.grad(_loss(model(tokens)), [store["leaf"]])
    assert hook_count(model) == hooks_before
    assert list(grads) == names[::-1]  # the backward pass reaches the last layer first
    for name, grad in zip(names, expected, strict=True):
        assert grad.abs().max() > 0
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", live_archs())
def test_require_live_patterns_passes_live_models(arch):
    model = tiny_model(arch)
    assert capture.live_pattern_layers(model) == [True, True]
    assert capture.require_live_patterns(model, [0, 1], "anything") is None


def test_require_live_patterns_names_layers_reason_and_fix(monkeypatch):
    opt = bridge_model("opt")  # the OPT adapter delegates attention to HuggingFace
    # inside ra-lens calls live_attention makes it live; in the caller's own forward it is not
    assert capture.live_pattern_layers(opt) == [True, True]
    assert capture.live_pattern_layers(opt, in_call=False) == [False, False]
    with pytest.raises(
        RuntimeError,
        match=r"^hook_pattern of layers \[1\] is not in the autograd graph of the output \(the "
        r"adapter delegates attention to HuggingFace\), .*: the check would fail; wrap the run "
        r"in `with ra_lens.live_attention\(model\):`",
    ):
        capture.require_live_patterns(opt, [1], "the check would fail", in_call=False)
    from ra_lens import liveness

    monkeypatch.setattr(liveness, "_seamable", lambda model: set())  # where the seam cannot help
    with pytest.raises(
        RuntimeError,
        match=r"the check would fail; use a model that computes attention through its hooks "
        r"\(GPT-2/Llama-style TransformerBridge, boot_native, HookedTransformer\)$",
    ):
        capture.require_live_patterns(opt, [1], "the check would fail")
