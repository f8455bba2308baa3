"""`circuits.bootstrap_jaccard`: the stability of a method's circuits over resamples of the pairs,
checked against circuits chosen one by one and compared as Python sets, and against attribute
calls on the resampled pairs themselves; `circuits.refit_jaccard`, which runs the method again
on each resample (a learned mask), checked against both."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import has_bridge

from ra_lens.circuits import (
    EdgeScores,
    attribute,
    bootstrap_jaccard,
    learn_mask,
    pair_scores,
    refit_jaccard,
)
from ra_lens.circuits.graph import Graph
from ra_lens.metrics import logit_diff
from ra_lens.ranking.statistics import bootstrap_indices
from ra_lens.toy_models import tiny_model

CLEAN = ["The capital of France is", "When Mary and John went to the store", "I like b and"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store", "I like c and"]
GOOD, BAD = [294, 50, 7], [52, 60, 9]
GRAPH = Graph(n_layers=2, n_heads=2, n_kv_heads=1, d_model=8)


def random_scores(n_pairs: int, seed: int = 0) -> EdgeScores:
    gen = torch.Generator().manual_seed(seed)
    per_pair = torch.randn(n_pairs, *GRAPH.real.shape, generator=gen, dtype=torch.float64)
    per_pair = per_pair * GRAPH.real
    return EdgeScores(GRAPH, per_pair.mean(0), "eap", "noise", per_pair=per_pair)


def jaccard_of_sets(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else math.nan  # two empty circuits: no evidence


@pytest.mark.parametrize("absolute", [False, True])
def test_equals_circuits_chosen_one_by_one_and_compared_as_sets(absolute):
    scores = random_scores(6)
    fractions = [0.1, 0.3, 0.6]
    stab = bootstrap_jaccard(scores, fractions, n_boot=7, seed=3, absolute=absolute)
    index = bootstrap_indices(6, 7, seed=3)
    total = GRAPH.count("ungrouped")
    for s, fraction in enumerate(fractions):
        n = round(fraction * total)

        def names(per_pair: torch.Tensor, n: int = n) -> set[str]:
            mean = EdgeScores(GRAPH, per_pair.mean(0), "eap", "noise")
            return set(mean.top(n, absolute=absolute).edge_names)

        full = names(scores.per_pair)
        boots = [names(scores.per_pair[index[b]]) for b in range(7)]
        pairs = [jaccard_of_sets(a, b) for a, b in itertools.combinations(boots, 2)]
        seen = [j for j in pairs if not math.isnan(j)]
        assert stab.pairwise[s].item() == pytest.approx(sum(seen) / len(seen), abs=1e-12)
        expected = torch.tensor([jaccard_of_sets(b, full) for b in boots], dtype=torch.float64)
        torch.testing.assert_close(stab.to_full[s], expected, rtol=0, atol=1e-12, equal_nan=True)
        assert stab.n_edges[s] == n
    assert 0 < float(stab.pairwise[-1]) < 1  # random scores: neither identical nor disjoint


def test_a_resample_mean_is_the_attribute_call_on_the_resampled_pairs():
    """For eap the cheap resample (a mean of per-pair scores) is what attributing the resampled
    pairs themselves gives, so the circuits compared are the ones a rerun would choose."""
    model = tiny_model("llama" if has_bridge() else "hooked", dtype=torch.float64)
    metric = logit_diff(GOOD, BAD)
    per = pair_scores(model, CLEAN, CORRUPTED, metric, method="eap")
    for rows in bootstrap_indices(3, 2, seed=1).tolist():
        again = attribute(
            model, [CLEAN[i] for i in rows], [CORRUPTED[i] for i in rows],
            logit_diff([GOOD[i] for i in rows], [BAD[i] for i in rows]), method="eap",
        )  # fmt: skip
        scale = float(again.scores.abs().max())
        torch.testing.assert_close(
            per.per_pair[rows].mean(0), again.scores.double(), rtol=0, atol=1e-12 * scale
        )
    stab = bootstrap_jaccard(per, [0.05, 0.5], n_boot=4)
    assert stab.pairwise.shape == (2,) and stab.to_full.shape == (2, 4)


def test_identical_pairs_are_perfectly_stable():
    same = GRAPH.real.double()[None].repeat(4, 1, 1) * torch.arange(1.0, 1 + GRAPH.real.numel()).view_as(GRAPH.real)  # fmt: skip
    scores = EdgeScores(GRAPH, same.mean(0), "eap", "denoise", per_pair=same)
    stab = bootstrap_jaccard(scores, [0.01, 1.0], n_boot=5)
    # the smallest size prunes to nothing: no evidence either way, not "perfectly stable"
    assert math.isnan(stab.pairwise[0]) and stab.pairwise[1].item() == 1.0
    assert bool((stab.to_full[1] == 1).all()) and stab.stable() == [False, True]


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="pair_scores"):
        bootstrap_jaccard(EdgeScores(GRAPH, GRAPH.real.double(), "eap", "denoise"))
    with pytest.raises(ValueError, match="at least 2 pairs"):
        bootstrap_jaccard(random_scores(1))
    with pytest.raises(ValueError, match="at least 2 resamples"):
        bootstrap_jaccard(random_scores(3), n_boot=1)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_jaccard(random_scores(3), n_boot=0)
    nan = random_scores(3)
    nan.per_pair[1][GRAPH.real.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_jaccard(nan)
    with pytest.raises(ValueError, match="fractions"):
        bootstrap_jaccard(random_scores(3), [5.0])
    with pytest.raises(TypeError, match="pair_scores"):
        bootstrap_jaccard(GRAPH.real)


@pytest.mark.parametrize("absolute", [False, True])
def test_refit_of_a_linear_method_is_the_cheap_bootstrap(absolute):
    """Refitting a mean of per-pair scores on each resample chooses the circuits the cheap
    bootstrap chooses from the same resamples: the same numbers, to the bit."""
    scores = random_scores(6, seed=2)
    calls: list[list[int]] = []

    def fit(rows: list[int]) -> EdgeScores:
        calls.append(rows)
        return EdgeScores(GRAPH, scores.per_pair[rows].mean(0), "eap", "noise")

    fractions = [0.1, 0.3, 0.6]
    refit = refit_jaccard(fit, 6, fractions, n_boot=5, seed=4, absolute=absolute)
    cheap = bootstrap_jaccard(scores, fractions, n_boot=5, seed=4, absolute=absolute)
    assert calls[0] == list(range(6)) and len(calls) == 6
    assert calls[1:] == bootstrap_indices(6, 5, seed=4).tolist()
    assert torch.equal(refit.pairwise, cheap.pairwise)
    torch.testing.assert_close(refit.to_full, cheap.to_full, rtol=0, atol=0, equal_nan=True)
    assert (refit.n_edges, refit.n_pairs, refit.method) == (cheap.n_edges, 6, "eap")


def test_refit_of_a_learned_mask_compares_the_masks_own_circuits():
    """Each resample trains its own mask; its circuits are the ones `top` chooses from that
    run's scores (checked as sets for one resample)."""
    model = tiny_model("llama" if has_bridge() else "hooked", dtype=torch.float64)
    runs: list[EdgeScores] = []

    def fit(rows: list[int]) -> EdgeScores:
        pairs_of = ([CLEAN[i] for i in rows], [CORRUPTED[i] for i in rows])
        metric = logit_diff([GOOD[i] for i in rows], [BAD[i] for i in rows])
        runs.append(learn_mask(model, *pairs_of, metric, steps=2, rule="scaled").scores)
        return runs[-1]

    stab = refit_jaccard(fit, 3, [0.3, 1.0], n_boot=2, seed=1)
    n = stab.n_edges[0]
    first, second = (set(r.top(n, absolute=False).edge_names) for r in runs[1:])
    assert stab.pairwise[0].item() == pytest.approx(jaccard_of_sets(first, second), abs=1e-12)
    full = set(runs[0].top(n, absolute=False).edge_names)
    assert stab.to_full[0, 0].item() == pytest.approx(jaccard_of_sets(first, full), abs=1e-12)
    assert 0 < stab.pairwise[0].item() < 1  # the resamples train different masks
    assert stab.pairwise[1].item() == 1.0 and stab.method == "mask"


def test_refit_refusals_name_the_fix():
    good = lambda rows: random_scores(3)  # noqa: E731
    with pytest.raises(ValueError, match="at least 2 pairs"):
        refit_jaccard(good, 1)
    with pytest.raises(ValueError, match="at least 2 resamples"):
        refit_jaccard(good, 3, n_boot=1)
    with pytest.raises(TypeError, match="must return EdgeScores"):
        refit_jaccard(lambda rows: GRAPH.real, 3, n_boot=2)
    nan = random_scores(3)
    nan.scores[GRAPH.real.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        refit_jaccard(lambda rows: nan, 3, n_boot=2)
    other = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    fits = iter([random_scores(3), EdgeScores(other, other.real.double(), "eap", "denoise")])
    with pytest.raises(ValueError, match="fit one model"):
        refit_jaccard(lambda rows: next(fits), 3, n_boot=2)
