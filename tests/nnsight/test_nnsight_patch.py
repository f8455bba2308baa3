"""Attention patching (`attention_patch_hooks`, `forward_patch_hooks`) and `tasks.evaluate` on
nnsight models: the hooks edit the softmax output inside HuggingFace's attention, as found by
the adapter, and match both HuggingFace ground truth and the TransformerLens bridge."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from helpers import hf_logits_with_pattern_added

# nnsight.modeling, not nnsight: with tests/ on sys.path, this folder itself imports as a
# namespace package "nnsight" where the real one is not installed.
pytest.importorskip(
    "nnsight.modeling",
    reason="nnsight 0.8.1 needs transformers >= 5: installed in .venv (TL 4) only",
)
import nnsight  # noqa: E402

import ra_lens  # noqa: E402
from ra_lens.metrics import target_nll  # noqa: E402
from ra_lens.nnsight import run_with_pattern_hooks  # noqa: E402
from ra_lens.patching import attention_patch_hooks, forward_patch_hooks  # noqa: E402
from ra_lens.tasks import build_prompts, evaluate  # noqa: E402
from ra_lens.toy_models import MATRIX_ARCHITECTURES, hf_model, tiny_model, tiny_tokenizer_dir  # noqa: E402

TOKENS = torch.tensor([[0, 51, 28, 288, 75, 73, 90]])


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def wrapped(arch: str) -> tuple[Any, Any]:
    hf = hf_model(arch, spread=True)
    return nnsight.TransformersModel(hf, tokenizer=tokenizer()), hf


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_patching_adds_eta_ra_after_huggingfaces_softmax(arch: str) -> None:
    model, hf = wrapped(arch)
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    scale = torch.linspace(-3.0, 2.0, 4 * len(ra.layers)).reshape(len(ra.layers), 4)
    got = run_with_pattern_hooks(model, TOKENS, attention_patch_hooks(ra, scale))
    added = [ra.mean_maps()[i][None] * scale[i][:, None, None] for i in ra.layers]
    expected = hf_logits_with_pattern_added(hf, TOKENS, added)
    plain = run_with_pattern_hooks(model, TOKENS, [])
    assert not torch.allclose(got, plain, atol=1e-4)  # the patch bites
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_patching_with_heads_and_right_alignment_equals_the_bridge() -> None:
    pytest.importorskip("transformer_lens.model_bridge")
    model, _ = wrapped("llama")
    bridge = tiny_model("llama", dtype=torch.float32, spread=True)
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    shorter = TOKENS[:, 2:]  # align="right": the maps' last 5 positions meet these 5
    for hooks in (
        attention_patch_hooks(ra, -4.0, heads=[(0, 1), (1, 3)]),
        attention_patch_hooks(ra, 3.0, layers=[1]),
        forward_patch_hooks(ra, 0.5, heads=[(1, 0)]),
    ):
        with bridge.hooks(fwd_hooks=hooks):
            tl = bridge(shorter)
        assert torch.allclose(run_with_pattern_hooks(model, shorter, hooks), tl, atol=1e-5)


def test_accuracy_moves_exactly_as_on_the_bridge() -> None:
    pytest.importorskip("transformer_lens.model_bridge")
    model, _ = wrapped("llama")
    bridge = tiny_model("llama", dtype=torch.float32, spread=True)
    pairs = [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("quick", "fox"), ("e", "the")]
    prompts = build_prompts(pairs, shots=1, seed=0)
    text = [p.text for p in prompts]
    targets = [int(bridge.to_tokens(" " + p.answer, prepend_bos=False)[0, 0]) for p in prompts]
    ra = ra_lens.reversed_attention(bridge, text[:1], target_nll(targets[:1]))
    before_tl, before_nn = evaluate(bridge, prompts), evaluate(model, prompts)
    assert torch.equal(before_tl.ranks, before_nn.ranks)
    for eta in (-50.0, 50.0):
        hooks = attention_patch_hooks(ra, eta)
        tl, ours = (
            evaluate(bridge, prompts, fwd_hooks=hooks),
            evaluate(model, prompts, fwd_hooks=hooks),
        )
        assert torch.equal(tl.ranks, ours.ranks) and tl.to_dict() == ours.to_dict()
        assert not torch.equal(tl.ranks, before_tl.ranks)  # the patch moves the ranks


def test_hooks_elsewhere_are_refused_by_name() -> None:
    model, _ = wrapped("llama")
    with pytest.raises(ValueError, match="hook_pattern only"):
        run_with_pattern_hooks(model, TOKENS, [("blocks.0.hook_resid_pre", lambda x, hook: x)])


def test_patching_leaves_the_model_as_found_even_when_a_hook_refuses() -> None:
    model, hf = wrapped("llama")
    hf.train()
    params = list(hf.parameters())
    params[0].requires_grad_(False)
    params[2].grad = torch.ones_like(params[2])
    before = ([m.training for m in hf.modules()], [p.requires_grad for p in params])
    plain = hf(TOKENS).logits.detach()
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    with pytest.raises(ValueError, match="align='strict'"):
        run_with_pattern_hooks(model, TOKENS[:, 1:], attention_patch_hooks(ra, 1.0, align="strict"))
    run_with_pattern_hooks(model, TOKENS, attention_patch_hooks(ra, 1.0))
    assert ([m.training for m in hf.modules()], [p.requires_grad for p in params]) == before
    assert params[0].grad is None and torch.equal(params[2].grad, torch.ones_like(params[2]))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in hf.modules())
    hf.eval()
    assert torch.equal(hf(TOKENS).logits.detach(), plain)  # no edit left behind
