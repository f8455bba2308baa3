"""The causal rankings (ranking/causal.py: causal mediation, indirect effect, activation patching)
against hand-written loops of forward passes."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_CORRUPTED as CORRUPTED
from helpers import TOY_TARGETS as TARGETS
from helpers import arch_or_hooked, clean_z, live_archs, prob_last

from ra_lens import ranking as rk
from ra_lens.capture import Z
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def model(request):
    return tiny_model(request.param, n_layers=2)


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


def z_setter(head: int, value: torch.Tensor | None = None):
    """A hand-written hook writing zeros (or `value`) into one head of hook_z."""

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0 if value is None else value[:, :, head]
        return z

    return hook


def test_causal_mediation_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(CLEAN, TARGETS, strict=True):
            tokens = model.to_tokens(text)
            before = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):
                    with model.hooks(fwd_hooks=[(Z.format(layer), z_setter(head))]):
                        after = prob_last(model(tokens), target)
                    expected[layer, head] += (before - after) / len(CLEAN)
    scores = rk.causal_mediation(model, CLEAN, TARGETS, batch_size=2)
    assert scores.shape == (n_layers, n_heads)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-7)


def test_activation_patching_with_transformer_lens_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
            source = clean_z(model, model.to_tokens(clean))
            tokens = model.to_tokens(corrupted)
            base = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):
                    hook = z_setter(head, source[layer])
                    with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                        patched = prob_last(model(tokens), target)
                    expected[layer, head] += (patched - base) / len(CLEAN)
    scores = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    assert scores.shape == (n_layers, n_heads)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)


def test_patching_rankings_vanish_without_corruption(llama):
    same = rk.activation_patching(llama, CLEAN, CLEAN, TARGETS)
    torch.testing.assert_close(same, torch.zeros_like(same))
    attribution = rk.attribution_patching(llama, CLEAN, CLEAN, TARGETS)
    torch.testing.assert_close(attribution, torch.zeros_like(attribution))


def test_causal_mediation_with_aligned_means_equals_a_loop_over_prompts(llama):
    means = rk.last_token_means(llama, CLEAN)
    expected = torch.zeros(2, llama.cfg.n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(CLEAN, TARGETS, strict=True):
            tokens = llama.to_tokens(text)
            before = prob_last(llama(tokens), target)
            for layer in range(2):
                for head in range(llama.cfg.n_heads):
                    with llama.hooks(fwd_hooks=rk.ablation_hooks([(layer, head)], means=means)):
                        after = prob_last(llama(tokens), target)
                    expected[layer, head] += (before - after) / len(CLEAN)
    scores = rk.causal_mediation(llama, CLEAN, TARGETS, means=means, batch_size=3)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)
    per_prompt = rk.causal_mediation(llama, CLEAN, TARGETS, means=means, per_prompt=True)
    assert per_prompt.shape == (3, 2, llama.cfg.n_heads)
    torch.testing.assert_close(per_prompt.mean(0), scores, rtol=1e-5, atol=1e-9)


def test_indirect_effect_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    clean = [clean_z(model, model.to_tokens(text)) for text in CLEAN]
    mean_last = {la: torch.stack([z[la][0, -1] for z in clean]).mean(0) for la in range(n_layers)}
    corrupted = CORRUPTED[:2] + ["Q: d\nA: of\n\nQ: the city to\nA:"]  # other lengths are fine
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(corrupted, TARGETS, strict=True):
            tokens = model.to_tokens(text)
            base = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):

                    def hook(z, hook, layer=layer, head=head):
                        z = z.clone()
                        z[:, -1, head] = mean_last[layer][head]
                        return z

                    with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                        patched = prob_last(model(tokens), target)
                    expected[layer, head] += (patched - base) / len(corrupted)
    scores = rk.indirect_effect(model, CLEAN, corrupted, TARGETS, batch_size=2)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)


def test_activation_patching_per_prompt_averages_to_its_mean(model):
    per_prompt = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, per_prompt=True)
    mean = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    assert per_prompt.shape == (3, 2, model.cfg.n_heads)
    torch.testing.assert_close(per_prompt.double().mean(0).float(), mean, atol=1e-7, rtol=1e-5)
    one = rk.activation_patching(model, CLEAN[2:], CORRUPTED[2:], TARGETS[2:])
    torch.testing.assert_close(per_prompt[2], one, atol=1e-7, rtol=1e-5)
