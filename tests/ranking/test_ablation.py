"""ranking/ablation.py: ablation curves ablate what they say, the last-token-aligned means, and
the evaluator's head checks."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_TARGETS as TARGETS
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked, clean_z

from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens.capture import Z
from ra_lens.patching import head_ablation_hooks, mean_head_outputs
from ra_lens.tasks import Accuracy, task_prompts
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


def test_ablation_hooks_really_zero_the_heads(llama):
    scores = rk.random_ranking(2, llama.cfg.n_heads, seed=3)
    kept = rk.kept_heads(scores, 0.5)
    ablated = [h for h in rk.head_order(scores) if h not in kept]
    seen = clean_z(llama, llama.to_tokens(CLEAN[0]))  # unablated
    after = {}

    def record(layer):
        def hook(z, hook):
            after[layer] = z.detach().clone()

        return hook

    hooks = head_ablation_hooks(ablated) + [(Z.format(la), record(la)) for la in range(2)]
    with torch.no_grad(), llama.hooks(fwd_hooks=hooks):
        llama(llama.to_tokens(CLEAN[0]))
    for layer, head in ablated:
        assert after[layer][:, :, head].abs().max() == 0
    for layer, head in kept:
        assert after[layer][:, :, head].abs().max() > 0
    # Layer 0 sees the unablated input, so its kept heads are untouched.
    for layer, head in kept:
        if layer == 0:
            torch.testing.assert_close(after[0][:, :, head], seen[0][:, :, head])
    # Every head ablated: the attention blocks add nothing (the tiny Llama has no o bias,
    # HookedTransformer's b_O starts at zero).
    everything = head_ablation_hooks(torch.ones(2, llama.cfg.n_heads, dtype=torch.bool))
    out = {}

    def attn_out(layer):
        def hook(x, hook):
            out[layer] = x.detach().clone()

        return hook

    with (
        torch.no_grad(),
        llama.hooks(
            fwd_hooks=everything + [(f"blocks.{la}.hook_attn_out", attn_out(la)) for la in range(2)]
        ),
    ):
        llama(llama.to_tokens(CLEAN[0]))
    assert all(out[la].abs().max() == 0 for la in range(2))


def test_ablation_curve_ablates_the_complement(llama):
    n_heads = llama.cfg.n_heads
    scores = torch.arange(2.0 * n_heads).reshape(2, n_heads)  # later heads score higher
    calls = []

    def fake(ablated):
        calls.append(list(ablated))
        return Accuracy.from_ranks(torch.tensor([len(ablated)]))

    curve = rk.ablation_curve(llama, ["unused"], scores, (0.0, 0.25, 1.0), evaluate=fake)
    total = 2 * n_heads
    assert curve.n_kept == [0, round(0.25 * total), total]
    assert calls[0] == sorted(rk.head_order(scores)) and calls[-1] == []
    assert set(calls[1]) == set(rk.head_order(scores)[curve.n_kept[1] :])
    reverse = rk.ablation_curve(llama, ["x"], scores, (0.25,), reverse=True, evaluate=fake)
    assert set(calls[-1]) == set(rk.head_order(scores, reverse=True)[reverse.n_kept[0] :])


def test_ablation_curve_on_the_task(llama):
    _, test = _toy_prompts(llama)
    scores = rk.random_ranking(2, llama.cfg.n_heads)
    curve = rk.ablation_curve(llama, test, scores, (0.0, 1.0))
    unablated = tasks.evaluate(llama, test)
    assert curve.accuracies[1].ranks.tolist() == unablated.ranks.tolist()
    everything = head_ablation_hooks(torch.ones(2, llama.cfg.n_heads, dtype=torch.bool))
    none_kept = tasks.evaluate(llama, test, fwd_hooks=everything)
    assert curve.accuracies[0].ranks.tolist() == none_kept.ranks.tolist()
    means = mean_head_outputs(llama, [p.text for p in test])
    mean_curve = rk.ablation_curve(llama, test, scores, (0.5,), mode="mean", means=means)
    ablated = sorted(rk.head_order(scores)[mean_curve.n_kept[0] :])
    hooks = head_ablation_hooks(ablated, mode="mean", means=means)
    expected = tasks.evaluate(llama, test, fwd_hooks=hooks)
    assert mean_curve.accuracies[0].ranks.tolist() == expected.ranks.tolist()
    with pytest.raises(ValueError, match="means"):
        rk.ablation_curve(llama, test, scores, (0.5,), mode="mean")


def _toy_prompts(model):
    return task_prompts(model, TOY, shots=2)


def test_last_token_means_by_hand(llama):
    means = rk.last_token_means(llama, CLEAN, batch_size=2)  # padded batches of unequal prompts
    zs = [clean_z(llama, llama.to_tokens(text)) for text in CLEAN]
    longest = max(z[0].shape[1] for z in zs)
    assert means.shape == (2, llama.cfg.n_heads, longest, llama.cfg.d_head)
    for layer in range(2):
        for j in range(longest):  # j tokens before each prompt's last token
            rows = [z[layer][0, -1 - j] for z in zs if z[layer].shape[1] > j]
            torch.testing.assert_close(means[layer, :, -1 - j], torch.stack(rows).mean(0))


def test_aligned_mean_ablation_writes_the_means_from_the_last_token_back(llama):
    means = rk.last_token_means(llama, CLEAN[2:])  # the shortest prompt: 8 positions
    m = means.shape[2]
    tokens = llama.to_tokens(CLEAN[0])
    n = tokens.shape[1]
    assert n > m
    seen = {}

    def record(z, hook):
        seen["z"] = z.detach().clone()

    hooks = rk.ablation_hooks([(1, 2)], means=means) + [(Z.format(1), record)]
    with torch.no_grad(), llama.hooks(fwd_hooks=hooks):
        llama(tokens)
    z = seen["z"][0, :, 2]  # [pos d_head]
    torch.testing.assert_close(z[n - m :], means[1, 2])
    # further back than the means reach: their mean over positions
    torch.testing.assert_close(z[: n - m], means[1, 2].mean(0).expand(n - m, -1))
    # a padded batch with its lengths gives every prompt what it gets alone
    batch = capture.to_batch(llama, CLEAN)
    padded = rk.ablation_hooks([(1, 2), (0, 1)], means=means, lengths=batch.lengths)
    with torch.no_grad(), llama.hooks(fwd_hooks=padded):
        together = llama(batch.tokens)
    alone_hooks = rk.ablation_hooks([(1, 2), (0, 1)], means=means)
    for i, text in enumerate(CLEAN):
        with torch.no_grad(), llama.hooks(fwd_hooks=alone_hooks):
            alone = llama(llama.to_tokens(text))
        last = int(batch.lengths[i]) - 1
        torch.testing.assert_close(together[i, last], alone[0, -1], rtol=1e-4, atol=1e-5)
    # 3-D means (patching.mean_head_outputs) keep the old behaviour: one vector everywhere
    flat = mean_head_outputs(llama, CLEAN)
    assert rk.ablation_hooks([(1, 2)], means=flat)[0][0] == Z.format(1)
    with pytest.raises(ValueError, match="do not fit"):
        rk.causal_mediation(llama, CLEAN, TARGETS, means=means[:1])


@pytest.mark.parametrize(
    "heads, message",
    [([(1, 4)], r"head \(1, 4\) does not exist"), ([(0, -1)], r"head \(0, -1\) does not exist")],
)
def test_ablation_evaluation_checks_heads_against_the_model(llama, heads, message):
    test = task_prompts(llama, TOY, shots=1)[1]
    with pytest.raises(ValueError, match=message):
        rk.evaluate_ablated(llama, test, heads)
