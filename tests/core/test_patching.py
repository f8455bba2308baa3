"""Attention patching and head ablation hooks: arithmetic, composition, alignment, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import FLORENCE, arch_or_hooked, live_archs

import ra_lens
from ra_lens import capture
from ra_lens.metrics import target_nll
from ra_lens.patching import (
    attention_patch_hooks,
    forward_patch_hooks,
    head_ablation_hooks,
    mean_head_outputs,
)
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("llama"), n_layers=3)


@pytest.fixture(scope="module")
def ra(model):
    tokens = model.to_tokens([FLORENCE, FLORENCE])  # equal lengths, as the paper averages maps
    return ra_lens.reversed_attention(model, tokens, target_nll([5, 6]))


def capture_patterns(model, tokens, fwd_hooks):
    """Patterns as seen by a hook that runs after the given hooks, on every layer."""
    seen = {}

    def record(layer):
        def hook(pattern, hook):
            seen[layer] = pattern.detach().clone()

        return hook

    after = [(capture.PATTERN.format(la), record(la)) for la in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks) + after):
        logits = model(tokens)
    return seen, logits


def test_patched_pattern_is_pattern_plus_scale_times_map(model, ra):
    tokens = ra.tokens[:1]
    clean, _ = capture_patterns(model, tokens, [])
    hooks = attention_patch_hooks(ra.mean_maps(), -8.0, model=model)
    # Patch one layer at a time so that upstream edits do not change downstream patterns.
    for layer in range(model.cfg.n_layers):
        patched, _ = capture_patterns(model, tokens, [hooks[layer]])
        expected = clean[layer] + -8.0 * ra.mean_maps()[layer]
        torch.testing.assert_close(patched[layer], expected, atol=1e-6, rtol=1e-5)
        # RA rows sum to zero, so the patched rows still sum to one.
        torch.testing.assert_close(patched[layer].sum(-1), torch.ones_like(patched[layer].sum(-1)))


def test_patching_changes_the_output_and_zero_scale_does_not(model, ra):
    tokens = ra.tokens[:1]
    base = model(tokens)
    with torch.no_grad(), model.hooks(fwd_hooks=attention_patch_hooks(ra, 0.0)):
        assert torch.allclose(model(tokens), base, atol=1e-6)
    with torch.no_grad(), model.hooks(fwd_hooks=attention_patch_hooks(ra, -50.0)):
        assert (model(tokens) - base).abs().max() > 1e-3


def test_negative_scale_lowers_the_loss_to_first_order(model, ra):
    """-eta * RA is the gradient-descent direction: a small negative scale lowers the NLL."""
    tokens = ra.tokens
    metric = target_nll([5, 6])
    per_prompt = ra_lens.reversed_attention(model, tokens, metric)
    base = metric(model(tokens)).sum().item()
    for i in range(2):
        maps = per_prompt.maps[i]
        with torch.no_grad(), model.hooks(fwd_hooks=attention_patch_hooks(maps, -1e-2)):
            lowered = metric(model(tokens))[i].item()
        with torch.no_grad(), model.hooks(fwd_hooks=attention_patch_hooks(maps, 1e-2)):
            raised = metric(model(tokens))[i].item()
        assert lowered < metric(model(tokens))[i].item() < raised
    assert base > 0


def test_run_with_hooks_equals_model_hooks(model, ra):
    tokens = ra.tokens[:1]
    hooks = attention_patch_hooks(ra, -10.0)
    with torch.no_grad():
        via_run = model.run_with_hooks(tokens, fwd_hooks=hooks)
        with model.hooks(fwd_hooks=hooks):
            via_context = model(tokens)
    torch.testing.assert_close(via_run, via_context)


def test_composes_with_another_hook_on_the_same_point(model, ra):
    tokens = ra.tokens[:1]
    doubled = []

    def other(pattern, hook):
        doubled.append(True)
        return pattern * 1.0

    hooks = attention_patch_hooks(ra, -10.0)
    with torch.no_grad():
        alone = model.run_with_hooks(tokens, fwd_hooks=hooks)
        both = model.run_with_hooks(tokens, fwd_hooks=hooks + [(hooks[0][0], other)])
    torch.testing.assert_close(alone, both)
    assert doubled == [True]


def test_per_head_scales_and_head_subsets(model, ra):
    tokens = ra.tokens[:1]
    scales = torch.zeros(3, 4)
    scales[1, 2] = -20.0
    with torch.no_grad():
        by_scale = model.run_with_hooks(tokens, fwd_hooks=attention_patch_hooks(ra, scales))
        by_heads = model.run_with_hooks(
            tokens, fwd_hooks=attention_patch_hooks(ra, -20.0, heads=[(1, 2)])
        )
        by_layer = model.run_with_hooks(
            tokens, fwd_hooks=attention_patch_hooks(ra, -20.0, layers=[1])
        )
    torch.testing.assert_close(by_scale, by_heads)
    assert (by_layer - by_heads).abs().max() > 0


def test_alignment_for_shorter_and_longer_prompts(model, ra):
    maps = ra.mean_maps()
    m = maps.shape[-1]
    short = ra.tokens[:1, : m - 3]
    longer = torch.cat([ra.tokens[:1, :4], ra.tokens[:1]], dim=1)
    for tokens in (short, longer):
        n = tokens.shape[1]
        clean, _ = capture_patterns(model, tokens, [])
        hook = attention_patch_hooks(maps, 2.0, layers=[0])
        patched, _ = capture_patterns(model, tokens, hook)
        k = min(n, m)
        expected = clean[0].clone()
        expected[..., n - k :, n - k :] += 2.0 * maps[0, :, m - k :, m - k :]
        torch.testing.assert_close(patched[0], expected)
    with pytest.raises(ValueError, match="align='strict'"):
        with (
            torch.no_grad(),
            model.hooks(fwd_hooks=attention_patch_hooks(maps, 1.0, align="strict")),
        ):
            model(short)


def test_forward_baseline_adds_mean_pattern(model, ra):
    tokens = ra.tokens[:1]
    clean, _ = capture_patterns(model, tokens, [])
    patched, _ = capture_patterns(model, tokens, forward_patch_hooks(ra, 0.5, layers=[0]))
    torch.testing.assert_close(patched[0], clean[0] + 0.5 * ra.mean_patterns()[0])
    torch.testing.assert_close(patched[0].sum(-1), torch.full_like(patched[0].sum(-1), 1.5))


def test_bad_maps_are_refused(model, ra):
    maps = ra.mean_maps().clone()
    with pytest.raises(ValueError, match="layers"):
        attention_patch_hooks(maps[:2], 1.0, model=model)
    with pytest.raises(ValueError, match="heads"):
        attention_patch_hooks(maps[:, :2], 1.0, model=model)
    maps[0, 0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        attention_patch_hooks(maps, 1.0)
    with pytest.raises(
        ValueError,
        match=r"maps must be Float\[Tensor, 'layer head query key'\] with as many queries as "
        r"keys \(ra.mean_maps\(\) of prompts of one length\), got \(4, \d+, \d+\)",
    ):
        attention_patch_hooks(ra.mean_maps()[0], 1.0)
    with pytest.raises(ValueError, match="no maps for layers"):
        attention_patch_hooks(ra.mean_maps(), 1.0, layers=[7])
    with pytest.raises(ValueError, match="unknown align"):
        attention_patch_hooks(ra.mean_maps(), 1.0, align="left")


def test_liveness_error_on_opt_names_live_attention_and_it_works():
    """OPT's adapter delegates attention to HuggingFace: patch hooks in the caller's own forward
    would do nothing, so they are refused, naming ra_lens.live_attention, under which they work."""
    pytest.importorskip("transformer_lens.model_bridge")
    opt = tiny_model("opt")
    tokens = opt.to_tokens(FLORENCE)
    ra = ra_lens.reversed_attention(opt, tokens, target_nll([5]))
    with pytest.raises(
        RuntimeError,
        match=r"hook_pattern of layers \[0, 1\] is not in the autograd graph .* attention "
        r"patching would silently do nothing; wrap the run in `with ra_lens.live_attention",
    ):
        attention_patch_hooks(ra, -10.0, model=opt)
    with torch.no_grad():
        plain = opt(tokens)
        with ra_lens.live_attention(opt):
            hooks = attention_patch_hooks(ra, -10.0, model=opt)
            with opt.hooks(fwd_hooks=hooks):
                patched = opt(tokens)
        assert not hasattr(opt.blocks[0].attn.original_component, "accepts_pattern_fn")
        assert torch.equal(opt(tokens), plain)  # restored
    assert float((patched - plain).abs().max()) > 1e-3


def test_zero_ablation_really_zeroes_head_outputs(model):
    tokens = model.to_tokens(FLORENCE)
    seen = {}

    def record(z, hook):
        seen["z"] = z.detach().clone()

    hooks = head_ablation_hooks([(1, 0), (1, 3)]) + [(capture.Z.format(1), record)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        ablated = model(tokens)
    assert seen["z"][:, :, [0, 3]].abs().max() == 0 and seen["z"][:, :, 1].abs().max() > 0
    assert (ablated - model(tokens)).abs().max() > 0
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 0] = mask[1, 3] = True
    with torch.no_grad():
        torch.testing.assert_close(
            model.run_with_hooks(tokens, fwd_hooks=head_ablation_hooks(mask)), ablated
        )


def test_mean_ablation(model):
    tokens = model.to_tokens([FLORENCE, "The quick brown fox jumps"])
    means = mean_head_outputs(model, [FLORENCE, "The quick brown fox jumps"])
    assert means.shape == (3, 4, model.cfg.d_head)
    seen = {}

    def record(z, hook):
        seen["z"] = z.detach().clone()

    hooks = head_ablation_hooks([(2, 1)], mode="mean", means=means) + [
        (capture.Z.format(2), record)
    ]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens)
    torch.testing.assert_close(seen["z"][:, :, 1], means[2, 1].expand_as(seen["z"][:, :, 1]))
    with pytest.raises(ValueError, match="needs means"):
        head_ablation_hooks([(0, 0)], mode="mean")


@pytest.mark.parametrize(
    "heads, message",
    [([(1, 4)], r"head \(1, 4\) does not exist: the model has layers 0\.\.2 of heads 0\.\.3"),
     ([(1, -1)], r"head \(1, -1\) does not exist"),
     ([(3, 0)], r"head \(3, 0\) does not exist"),
     ([(-1, 0)], r"head \(-1, 0\) does not exist")],
)  # fmt: skip
def test_head_ablation_checks_heads_where_they_enter(model, heads, message):
    with pytest.raises(ValueError, match=message):
        head_ablation_hooks(heads, model=model)
    if heads[0][0] < 0 or heads[0][1] < 0:  # negative: refused even without the model
        with pytest.raises(ValueError, match="a negative one does not count from the end"):
            head_ablation_hooks(heads)


def test_head_ablation_without_the_model_names_the_missing_head_in_the_forward(model):
    tokens = model.to_tokens(FLORENCE)
    with pytest.raises(ValueError, match="head 4 of layer 1 does not exist: the layer has 4"):
        with torch.no_grad(), model.hooks(fwd_hooks=head_ablation_hooks([(1, 4)])):
            model(tokens)
    means = torch.zeros(3, 4, model.cfg.d_head)
    with pytest.raises(ValueError, match=r"head \(1, 4\) does not exist"):
        head_ablation_hooks([(1, 4)], mode="mean", means=means)


@pytest.fixture(scope="module", params=live_archs())
def tiny(request):
    return tiny_model(request.param, n_layers=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_patch_scale_is_refused(tiny, bad):
    maps = torch.zeros(tiny.cfg.n_layers, tiny.cfg.n_heads, 4, 4)
    with pytest.raises(ValueError, match="finite"):
        ra_lens.attention_patch_hooks(maps, bad)
    per_head = torch.full((tiny.cfg.n_layers, tiny.cfg.n_heads), -1.0)
    per_head[0, 1] = bad
    with pytest.raises(ValueError, match="finite"):
        ra_lens.attention_patch_hooks(maps, per_head)


def test_clear_errors_for_heads_and_maps(tiny):
    with pytest.raises(ValueError, match=r"heads=\[\(layer, head\)\]"):
        ra_lens.head_ablation_hooks((0, 1))
    maps = torch.zeros(tiny.cfg.n_layers, tiny.cfg.n_heads, 4, 4)
    with pytest.raises(ValueError, match=r"heads=\[\(layer, head\)\]"):
        ra_lens.attention_patch_hooks(maps, -1.0, heads=(0, 1))
    with pytest.raises(ValueError, match="as many queries as keys"):
        ra_lens.attention_patch_hooks(torch.zeros(2, 4, 3, 5), -1.0)
