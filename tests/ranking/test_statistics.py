"""ranking/statistics.py: Spearman against scipy, top-k overlap, AUC of known curves, the
bootstrap and paired intervals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ra_lens import ranking as rk
from ra_lens.tasks import Accuracy


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(5, 4, generator=gen)
    b = (torch.rand(5, 4, generator=gen) * 3).round()  # many ties
    expected = stats.spearmanr(a.flatten().numpy(), b.flatten().numpy()).statistic
    assert rk.spearman(a, b) == pytest.approx(expected, abs=1e-9)
    assert rk.spearman(a, a) == pytest.approx(1.0)
    assert rk.spearman(a, -a) == pytest.approx(-1.0)
    assert math.isnan(rk.spearman(a, torch.zeros_like(a)))


def test_top_k_overlap():
    a = torch.arange(12.0).reshape(3, 4)
    assert rk.top_k_overlap(a, a, k=3) == 1.0
    assert rk.top_k_overlap(a, -a, k=3) == 0.0
    b = a.clone()
    b[2, 3] = -1.0  # a's best head drops to the bottom of b
    assert rk.top_k_overlap(a, b, k=4) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="k must be"):
        rk.top_k_overlap(a, b, k=13)
    with pytest.raises(ValueError, match="different shapes"):
        rk.spearman(a, a[:2])


def test_auc_of_known_curves():
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]

    def curve(values):
        # n = 4 prompts; a top-1 accuracy of v means round(4 v) prompts ranked 0.
        accs = [
            Accuracy.from_ranks(torch.tensor([0] * round(4 * v) + [5] * (4 - round(4 * v))))
            for v in values
        ]
        return rk.AblationCurve(fractions, [0] * 5, accs)

    assert curve([0, 0.25, 0.5, 0.75, 1.0]).auc == pytest.approx(0.5)
    assert curve([1.0] * 5).auc == pytest.approx(1.0)
    assert curve([0, 1, 1, 1, 1]).auc == pytest.approx(0.875)
    assert curve([0, 1, 1, 1, 1]).auc_top3 == pytest.approx(0.875)
    assert curve([0] * 5).to_dict()["auc"] == 0.0


def _curve(hits_by_fraction, fractions):
    accs = [
        Accuracy.from_ranks(torch.tensor([0 if h else 9 for h in hits]))
        for hits in hits_by_fraction
    ]
    return rk.AblationCurve(list(fractions), [0] * len(fractions), accs)


def test_per_prompt_auc_averages_to_the_auc_and_the_bootstrap_is_seeded():
    gen = torch.Generator().manual_seed(0)
    fractions = rk.DENSE_FRACTIONS
    hits = (
        torch.rand(len(fractions), 40, generator=gen)
        < torch.linspace(0, 1, len(fractions))[:, None]
    )
    curve = _curve(hits.tolist(), fractions)
    assert float(rk.per_prompt_auc(curve).mean()) == pytest.approx(curve.auc)
    a = rk.auc_interval(curve, n_boot=500, seed=3)
    torch.manual_seed(99)  # the global RNG plays no part
    b = rk.auc_interval(curve, n_boot=500, seed=3)
    assert a == b and a.n == 40 and a.n_boot == 500 and a.level == 0.95
    assert a.estimate == pytest.approx(curve.auc) and a.low <= a.estimate <= a.high
    assert 0 < a.high - a.low < 0.5
    assert rk.auc_interval(curve, n_boot=500, seed=4) != a
    # by hand: percentiles of resampled means
    per_prompt = rk.per_prompt_auc(curve)
    stats = per_prompt[rk.bootstrap_indices(40, 500, 3)].mean(1)
    low, high = torch.quantile(stats, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert (a.low, a.high) == pytest.approx((low, high))
    assert str(a).startswith(f"{a.estimate:.3f} [")
    json.dumps(a.to_dict(), allow_nan=False)


def test_paired_auc_difference():
    gen = torch.Generator().manual_seed(1)
    fractions = (0.0, 0.5, 1.0)
    base = torch.rand(3, 30, generator=gen) < 0.5
    better = base | (torch.rand(3, 30, generator=gen) < 0.5)
    a, b = _curve(better.tolist(), fractions), _curve(base.tolist(), fractions)
    diff = rk.paired_auc_difference(a, b, n_boot=400, seed=0)
    assert diff.estimate == pytest.approx(a.auc - b.auc) and diff.estimate > 0
    assert diff.low <= diff.estimate <= diff.high
    same = rk.paired_auc_difference(a, a, n_boot=100)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same test prompts"):
        rk.paired_auc_difference(a, _curve(base[:, :10].tolist(), fractions))


def test_spearman_interval_resamples_prompts():
    gen = torch.Generator().manual_seed(2)
    truth = torch.rand(3, 4, generator=gen)
    a = truth + 0.3 * torch.rand(12, 3, 4, generator=gen)  # 12 prompts
    b = truth + 0.3 * torch.rand(12, 3, 4, generator=gen)
    rho = rk.spearman_interval(a, b, n_boot=300, seed=0)
    assert rho.estimate == pytest.approx(rk.spearman(a.mean(0), b.mean(0)))
    assert rho.low <= rho.estimate <= rho.high and rho.n == 12
    assert rk.spearman_interval(a, b, n_boot=300, seed=0) == rho
    same = rk.spearman_interval(a, a, n_boot=50)
    assert (same.low, same.high) == (1.0, 1.0)
    fixed = rk.layer_ranking(3, 4)  # not resampled
    mixed = rk.spearman_interval(a, fixed, n_boot=100, seed=0)
    assert mixed.estimate == pytest.approx(rk.spearman(a.mean(0), fixed))
    assert mixed.low <= mixed.estimate <= mixed.high
