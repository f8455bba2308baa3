"""The gradient rankings (ranking/gradient.py: RA, temperature, first-order mediation, attribution
patching, exact q/k) against hand computations, finite differences and activation patching."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_CORRUPTED as CORRUPTED
from helpers import TOY_TARGETS as TARGETS
from helpers import arch_or_hooked, clean_z, has_bridge, live_archs, prob_last

import ra_lens
from ra_lens import capture
from ra_lens import ranking as rk
from ra_lens.capture import PATTERN, Z
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def model(request):
    return tiny_model(request.param, n_layers=2)


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


@pytest.fixture(scope="module")
def small_llama(llama):
    """`llama` with HuggingFace's initial weight scale (std 0.02). HookedTransformer starts at
    0.8 / sqrt(d_model) = 0.14: its heads then move p(target) too far for a first-order estimate
    to track, so its matrices are scaled down to the HF toys' size."""
    if has_bridge():
        return llama
    model = tiny_model("hooked", n_layers=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # embeddings and weight matrices; layer norms stay at 1
                p.mul_(0.02 / model.cfg.initializer_range)
    return model


def test_ra_ranking_equals_reversed_attention_head_norms(model):
    reference = ra_lens.reversed_attention(model, CLEAN, target_nll(TARGETS)).head_norms()
    scores = rk.ra_ranking(model, CLEAN, TARGETS, batch_size=2)
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-8)


def test_ra_loss_row_is_the_norm_of_the_last_row(model):
    expected = []
    for text, target in zip(CLEAN, TARGETS, strict=True):
        ra = ra_lens.reversed_attention(model, text, target_nll([target]), keep="maps")
        expected.append(ra.maps[0, :, :, -1, :].double().norm(dim=-1).float())
    scores = rk.ra_ranking(model, CLEAN, TARGETS, loss_row=True, batch_size=2)
    torch.testing.assert_close(scores, torch.stack(expected).mean(0), rtol=1e-5, atol=1e-8)
    full = rk.ra_ranking(model, CLEAN, TARGETS)
    assert (scores <= full + 1e-6).all()  # one row of a map is never larger than the whole map


def test_attribution_patching_equals_grad_times_difference_by_hand(model):
    n_layers = model.cfg.n_layers
    expected = torch.zeros(n_layers, model.cfg.n_heads, dtype=torch.float64)
    for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
        source = clean_z(model, model.to_tokens(clean))
        tokens = model.to_tokens(corrupted)
        base = clean_z(model, tokens)
        for layer in range(n_layers):
            # One layer at a time: its hook_z becomes a leaf, later layers still see its effect.
            leaf = base[layer].clone().requires_grad_(True)
            hook = (Z.format(layer), lambda z, hook, leaf=leaf: leaf)
            with torch.enable_grad(), model.hooks(fwd_hooks=[hook]):
                p = model(tokens)[0, -1].softmax(-1)[target]
                (grad,) = torch.autograd.grad(p, [leaf])
            diff = source[layer] - base[layer]
            expected[layer] += (grad * diff).sum((0, 1, 3)).double() / len(CLEAN)
    scores = rk.attribution_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-9)
    assert not any(p.grad is not None for p in model.parameters())


def pattern_grad_and_values(model, tokens, target, layer):
    """(dp(target)/dA, A) of one layer's hook_pattern, [head query key]: the pattern is swapped
    for a leaf of the same value."""
    seen = {}

    def leaf(pattern, hook):
        seen["a"] = pattern.detach().clone().requires_grad_(True)
        return seen["a"]

    with torch.enable_grad(), model.hooks(fwd_hooks=[(PATTERN.format(layer), leaf)]):
        p = model(tokens)[0, -1].double().softmax(-1)[target]
        (grad,) = torch.autograd.grad(p, [seen["a"]])
    return grad[0].double(), seen["a"][0].detach().double()


def patched_patterns(model, tokens, name, source):
    """One layer's pattern [position head query key] with activation `name` (hook_q or hook_k)
    at that position taken from `source`: the exact softmax, whatever the model computes. One
    forward pass of one row per position (rows never mix)."""
    n = tokens.shape[1]
    rows = torch.arange(n)

    def patch(x, hook):
        x = x.clone()
        x[rows, rows] = source[0, rows]
        return x

    pattern = PATTERN.format(int(name.split(".")[1]))
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, patch)]):
        with capture.recorded(model, [pattern]) as acts:
            model(tokens.expand(n, -1))
    return acts[pattern].double()


@pytest.mark.parametrize("arch", live_archs())
def test_exact_qk_attribution_equals_exact_patterns_times_the_gradient(arch):
    model = tiny_model(arch, n_layers=2, dtype=torch.float64)
    # score[l, h] = mean_i sum_q R[q] . (A with h's query at q from clean - A)[q]
    #             + sum_k sum_q R[q] . (A with h's key/value head's key at k from clean - A)[q],
    # R = dp(target)/dA of head h on the corrupted run; each patched pattern read from the model.
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
        clean_tokens, tokens = model.to_tokens(clean), model.to_tokens(corrupted)
        names = [f"blocks.{la}.attn.hook_{x}" for la in range(n_layers) for x in "qk"]
        with torch.no_grad(), capture.recorded(model, names) as acts:
            model(clean_tokens)
        sources = {name: acts[name].detach().clone() for name in names}
        for layer in range(n_layers):
            grad, base = pattern_grad_and_values(model, tokens, target, layer)
            for kind in "qk":
                name = f"blocks.{layer}.attn.hook_{kind}"
                # every head (or key/value head) at once: a head's pattern reads only its own
                # query and its key/value head's keys; summed over the patched positions
                new = patched_patterns(model, tokens, name, sources[name])
                expected[layer] += (grad * (new - base)).sum((0, 2, 3)) / len(CLEAN)
    scores = rk.exact_qk_attribution(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    # the HF toys' near-uniform attention gives effects of 1e-8..1e-7 (HF takes the softmax in
    # float32 even for float64 models: errors up to 6e-11); HookedTransformer's are ~1e-5
    assert expected.abs().max() > 1e-8
    torch.testing.assert_close(scores.double(), expected, rtol=1e-3, atol=1e-10)
    assert not any(p.grad is not None for p in model.parameters())


def test_attribution_patching_approximates_activation_patching(llama):
    exact = rk.activation_patching(llama, CLEAN, CORRUPTED, TARGETS)
    approx = rk.attribution_patching(llama, CLEAN, CORRUPTED, TARGETS)
    assert rk.spearman(exact, approx) > 0.8


@pytest.fixture(scope="module")
def gpt2_64():
    # float64 throughout (HF's Llama RMSNorm computes in float32, too coarse for a finite difference)
    return tiny_model(arch_or_hooked("gpt2"), n_layers=2, dtype=torch.float64)


def _prob_along(model, tokens, target, layer, head, direction, t):
    """p(target) with z[layer, :, head] moved by t * direction (every position)."""

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = z[:, :, head] + t * direction(z[:, :, head])
        return z

    with torch.no_grad(), model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
        return prob_last(model(tokens), target)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_first_order_mediation_equals_a_finite_difference(gpt2_64, ablation):
    model = gpt2_64
    means = rk.last_token_means(model, CLEAN) if ablation == "mean" else None
    eps = 1e-4
    expected = torch.zeros(2, model.cfg.n_heads, dtype=torch.float64)
    for text, target in zip(CLEAN, TARGETS, strict=True):
        tokens = model.to_tokens(text)
        lengths = torch.tensor([tokens.shape[1]])
        for layer in range(2):
            for head in range(model.cfg.n_heads):
                if means is None:
                    ablated = torch.zeros(1, tokens.shape[1], model.cfg.d_head)
                else:  # what mean ablation writes into this head's hook_z
                    ablate = rk.ablation_hooks([(layer, head)], means=means, lengths=lengths)
                    with torch.no_grad(), model.hooks(fwd_hooks=ablate):
                        with capture.recorded(model, [Z.format(layer)]) as seen:
                            model(tokens)
                    ablated = seen[Z.format(layer)][:, :, head]

                def direction(z, ablated=ablated):  # towards the ablated value
                    return ablated.to(z) - z

                up = _prob_along(model, tokens, target, layer, head, direction, eps)
                down = _prob_along(model, tokens, target, layer, head, direction, -eps)
                expected[layer, head] -= (up - down) / (2 * eps) / len(CLEAN)  # p - p(ablated)
    scores = rk.first_order_mediation(model, CLEAN, TARGETS, means=means, batch_size=2)
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_first_order_mediation_ranks_like_causal_mediation_on_a_tiny_model(small_llama, ablation):
    model = small_llama
    means = rk.last_token_means(model, CLEAN) if ablation == "mean" else None
    exact = rk.causal_mediation(model, CLEAN, TARGETS, means=means)
    approx = rk.first_order_mediation(model, CLEAN, TARGETS, means=means)
    # random small weights: every head's effect is small, so the Taylor term is close
    assert rk.spearman(exact, approx) > 0.8
    torch.testing.assert_close(approx, exact, rtol=0.5, atol=1e-5)


def beta_gradient(model, text, target):
    """d(-log p(target))/d(beta[l, h]) at beta = 1, beta scaling the head's attention logits at
    hook_attn_scores (the masked entries stay masked)."""
    beta = torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    beta.requires_grad_(True)

    def scale(layer):
        def hook(scores, hook):
            b = beta[layer].to(scores.dtype)[None, :, None, None]
            # masked entries (-inf) stay out of the product: -inf * 0 would make the gradient NaN
            finite = torch.isfinite(scores)
            return torch.where(finite, scores, 0.0) * b + torch.where(finite, 0.0, scores)

        return hook

    hooks = [(f"blocks.{la}.attn.hook_attn_scores", scale(la)) for la in range(model.cfg.n_layers)]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        logits = model(model.to_tokens(text))
        loss = -logits[0, -1].double().log_softmax(-1)[target]
        (grad,) = torch.autograd.grad(loss, [beta])
    return grad


@pytest.mark.parametrize("arch", live_archs())
def test_temperature_score_is_the_gradient_of_a_per_head_logit_scale(arch):
    # GPT-2 and Llama bridges compute attention themselves: hook_attn_scores is in the graph
    # (on boot_native it is a copy of the pattern, so the reference cannot be built there).
    model = tiny_model(arch, n_layers=2, dtype=torch.float64)
    expected = torch.stack(
        [beta_gradient(model, text, t) for text, t in zip(CLEAN, TARGETS, strict=True)]
    )
    assert expected.abs().max() > 1e-4
    scores = rk.temperature_scores(model, CLEAN, TARGETS, batch_size=2)  # padded batches
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-7)
    ranking = rk.temperature_ranking(model, CLEAN, TARGETS)
    torch.testing.assert_close(ranking.double(), expected.abs().mean(0), rtol=1e-4, atol=1e-7)
    assert not any(p.grad is not None for p in model.parameters())


def test_exact_qk_attribution_per_prompt_averages_to_its_mean(llama):
    per_prompt = rk.exact_qk_attribution(llama, CLEAN, CORRUPTED, TARGETS, per_prompt=True)
    mean = rk.exact_qk_attribution(llama, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    torch.testing.assert_close(per_prompt.double().mean(0).float(), mean, atol=1e-7, rtol=1e-5)
