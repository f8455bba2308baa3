"""ra_lens metrics inside TransformerLens's own APIs: one example of a batch (`metric[i]`), and
the scalar those APIs differentiate or `.item()` (`metric.mean()`)."""

from __future__ import annotations

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens.metrics import completion, logit_diff, target_nll
from ra_lens.tasks.ioi import PromptPair, paired_batch
from ra_lens.toy_models import tiny_model

#: Two answers the tiny tokenizer has as one token each; prompts of equal token length.
PAIRS = [
    PromptPair("I like Italy", "I like Paris", " and", " the"),
    PromptPair("I like Paris", "I like Italy", " the", " and"),
    PromptPair("The capital of Italy is", "The capital of Paris is", " the", " and"),
]


def test_indexing_cuts_every_per_prompt_field_and_keeps_values() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4])
    metric = logit_diff([1, 2, 3], [4, 5, 6], position=torch.tensor([-1, 1, -2]))
    full = metric(logits, lengths)
    for i in range(3):
        one = metric[i](logits[i : i + 1], lengths[i : i + 1])
        assert one.shape == (1,) and float(one) == float(full[i])
    torch.testing.assert_close(metric[1:](logits[1:], lengths[1:]), full[1:])
    # One target for all prompts stays one target.
    shared = target_nll(7)
    assert shared[2].targets.tolist() == [7]
    assert float(shared.mean()(logits)) == pytest.approx(float(shared(logits).mean()))
    with pytest.raises(IndexError, match="prompt 3 of a metric built for 3 prompts"):
        metric[3]
    with pytest.raises(TypeError, match="an int or a slice"):
        metric[[0, 1]]


def test_completion_metric_of_one_example_matches_the_batch() -> None:
    model = tiny_model(arch_or_hooked("gpt2"))
    batch, metric = completion(model, ["I like", "The capital of Italy is"], [" Paris", " the"])
    with torch.no_grad():
        logits = model(batch.tokens)
    full = metric(logits, batch.lengths)
    n = int(batch.lengths[1])
    one = metric[1](logits[1:2, :n], batch.lengths[1:2])
    torch.testing.assert_close(one, full[1:2])


def test_mean_is_what_transformer_lens_patching_needs() -> None:
    """TL's activation patching calls `patching_metric(logits).item()` on the whole batch."""
    from transformer_lens import patching

    model = tiny_model(arch_or_hooked("gpt2"))
    clean, corrupted, metric = paired_batch(model, PAIRS[:2])
    _, cache = model.run_with_cache(clean.tokens)
    got = patching.get_act_patch_resid_pre(model, corrupted.tokens, cache, metric.mean())
    correct, incorrect = metric.correct, metric.incorrect

    def by_hand(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(2)
        return (logits[rows, -1, correct] - logits[rows, -1, incorrect]).mean()

    expected = patching.get_act_patch_resid_pre(model, corrupted.tokens, cache, by_hand)
    torch.testing.assert_close(got, expected)
    assert got.abs().max() > 0


@pytest.mark.tl4  # attribution_patch is TransformerLens 4's (tools.analysis)
def test_attribution_patch_per_example_matches_hand_written_metrics() -> None:
    """TL 4's attribution_patch calls its metric on each pair alone and needs a scalar: with the
    batch metric it fails ("3 targets for a batch of 1 prompts"); metric[i].mean() per pair gives
    what a hand-written metric of that pair gives."""
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    model = tiny_model("gpt2")
    clean, corrupted, metric = paired_batch(model, PAIRS)
    with pytest.raises(ValueError, match="3 targets for a batch of 1 prompts.*metric\\[i\\]"):
        attribution_patch(model, clean.tokens, corrupted.tokens, metric)
    for i in (0, 2):
        n = int(clean.lengths[i])  # right padding off: TL reads the last position
        tokens = clean.tokens[i : i + 1, :n], corrupted.tokens[i : i + 1, :n]
        got = attribution_patch(model, *tokens, metric[i].mean()).node_scores
        a, w = int(metric.correct[i]), int(metric.incorrect[i])
        want = attribution_patch(
            model, *tokens, lambda logits, a=a, w=w: logits[0, -1, a] - logits[0, -1, w]
        ).node_scores
        assert got.keys() == want.keys()
        for node, score in want.items():
            assert got[node] == pytest.approx(score, rel=1e-6, abs=1e-9)
        assert max(abs(s) for s in want.values()) > 0
