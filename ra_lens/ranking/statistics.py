"""Statistics of rankings and curves: rank correlations (one `spearman`, one `pearson`), top-k
agreement, the trapezoid AUC, and percentile bootstrap intervals over prompts.

Every function here is pure (tensors in, numbers out), seeded where it resamples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.checks import check_count
from ra_lens.ranking.engine import PerPrompt, head_order
from ra_lens.types import Scores


def _average_ranks(values: Tensor) -> Tensor:
    """Ranks 1..n with ties sharing their average rank (as scipy.stats.rankdata)."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    sorted_values = values[order]
    ranks = torch.empty_like(values)
    i, n = 0, values.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(a: Float[Tensor, "..."], b: Validated[Float[Tensor, "..."]]) -> float:
    """Pearson correlation of two tensors' entries, in float64; NaN when either is constant.

    >>> pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.5]))  # doctest: +ELLIPSIS
    0.99...
    """
    if a.shape != b.shape:
        raise ValueError(f"tensors of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    x, y = a.detach().double().cpu().flatten(), b.detach().double().cpu().flatten()
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def spearman(a: Float[Tensor, "..."], b: Validated[Float[Tensor, "..."]]) -> float:
    """Spearman rank correlation of two rankings (any shape, e.g. [layer head]): the Pearson
    correlation of their ranks, ties sharing their average rank (as scipy.stats.spearmanr).

    NaN when either ranking is constant.

    >>> a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> spearman(a, a ** 3), spearman(a, -a)
    (1.0, -1.0)
    """
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return pearson(_average_ranks(a.flatten().cpu()), _average_ranks(b.flatten().cpu()))


def top_recall(estimate: Float[Tensor, "..."], truth: Float[Tensor, "..."], k: int = 20) -> float:
    """Share of the truth's k largest |values| among the estimate's k largest |values| (k capped
    at the number of entries).

    >>> top_recall(torch.tensor([3.0, -2.0, 0.1]), torch.tensor([-5.0, 0.2, 4.0]), k=2)
    0.5
    """
    if estimate.shape != truth.shape:
        raise ValueError(
            f"tensors of different shapes {tuple(estimate.shape)} and {tuple(truth.shape)}"
        )
    check_count(k, "k")
    k = min(k, truth.numel())
    top_truth = set(truth.flatten().abs().argsort(descending=True)[:k].tolist())
    top_est = set(estimate.flatten().abs().argsort(descending=True)[:k].tolist())
    return len(top_truth & top_est) / k


def top_k_overlap(a: Scores, b: Validated[Scores], k: int = 10) -> float:
    """Fraction of the k top heads of `a` that are also among the k top heads of `b` (ties broken
    as in `head_order`).

    >>> a, b = torch.tensor([[4.0, 3.0], [2.0, 1.0]]), torch.tensor([[4.0, 1.0], [2.0, 3.0]])
    >>> top_k_overlap(a, b, k=2)  # top 2 of a: (0, 0), (0, 1); of b: (0, 0), (1, 1)
    0.5
    """
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if not 1 <= k <= a.numel():
        raise ValueError(f"k must be between 1 and the number of heads ({a.numel()}), got {k}")
    top_a, top_b = set(head_order(a)[:k]), set(head_order(b)[:k])
    return len(top_a & top_b) / k


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile bootstrap interval.

    Attributes:
        estimate: the statistic on the data as observed.
        low, high: the (1 - level) / 2 and (1 + level) / 2 quantiles of the bootstrap statistics.
        level: coverage (0.95); n: prompts resampled; n_boot: resamples; seed: their seed.
    """

    estimate: float
    low: float
    high: float
    level: float
    n: int
    n_boot: int
    seed: int

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self) -> dict[str, float | int | None]:
        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "estimate": clean(self.estimate),
            "low": clean(self.low),
            "high": clean(self.high),
            "level": self.level,
            "n": self.n,
            "n_boot": self.n_boot,
            "seed": self.seed,
        }


def bootstrap_indices(n: int, n_boot: int = 2000, seed: int = 0) -> Int[Tensor, "n_boot n"]:
    """Resampled prompt indices (with replacement) from `torch.Generator().manual_seed(seed)`:
    the same seed gives the same resamples whatever the global RNG state.

    >>> bootstrap_indices(5, n_boot=3, seed=0).shape, bool((bootstrap_indices(5, 3) < 5).all())
    (torch.Size([3, 5]), True)
    >>> torch.equal(bootstrap_indices(5, 3, seed=7), bootstrap_indices(5, 3, seed=7))
    True
    """
    if n < 1 or n_boot < 1:
        raise ValueError(f"need n >= 1 prompts and n_boot >= 1 resamples, got {n} and {n_boot}")
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, n, (n_boot, n), generator=generator)


def percentile_interval(
    estimate: float, stats: Tensor, level: float, n: int, n_boot: int, seed: int
) -> Interval:
    """`estimate` with the percentile interval of bootstrap statistics (nan resamples dropped).

    >>> print(percentile_interval(0.5, torch.tensor([0.0, 1.0, float("nan")]), 0.95, 2, 3, 0))
    0.500 [0.025, 0.975]
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    stats = stats.double()
    stats = stats[~stats.isnan()]
    if stats.numel() == 0:
        return Interval(estimate, float("nan"), float("nan"), level, n, n_boot, seed)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(stats, q).tolist()
    return Interval(estimate, low, high, level, n, n_boot, seed)


def bootstrap_mean(
    values: Float[Tensor, "n"], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Mean of per-prompt values with a percentile bootstrap interval over prompts.

    >>> print(bootstrap_mean(torch.tensor([0.0, 1.0, 0.0, 1.0]), n_boot=500))
    0.500 [0.000, 1.000]
    """
    values = values.detach().double().cpu().reshape(-1)
    index = bootstrap_indices(values.numel(), n_boot, seed)
    return percentile_interval(
        float(values.mean()), values[index].mean(1), level, values.numel(), n_boot, seed
    )


def _fast_ranks(values: Tensor) -> Tensor:
    """Average ranks; argsort of argsort when there are no ties (the usual case for scores)."""
    if torch.unique(values).numel() < values.numel():
        return _average_ranks(values)
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks[torch.argsort(values)] = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return ranks


def _spearman_flat(a: Tensor, b: Tensor) -> float:
    return pearson(_fast_ranks(a), _fast_ranks(b))


def spearman_interval(
    a: Scores | PerPrompt,
    b: Scores | PerPrompt,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Spearman correlation of two rankings with a bootstrap interval over the ranking prompts.

    A per-prompt ranking, Float[Tensor, "batch layer head"], is resampled over its prompts and
    averaged; a fixed one, Float[Tensor, "layer head"] (random, layer index), stays as it is. Two
    per-prompt rankings on the same number of prompts are resampled together (paired: the same
    prompts); otherwise each gets its own resamples (streams seeded `seed` and `seed + 1`).
    The estimate is the Spearman of the two means. NaN resamples (a constant ranking) are dropped.

    >>> torch.manual_seed(0) and None
    >>> a = torch.rand(20, 2, 4)  # per prompt: [batch layer head]
    >>> interval = spearman_interval(a, a + 0.01 * torch.rand(20, 2, 4), n_boot=200)
    >>> interval.estimate > 0.9, interval.n
    (True, 20)
    """
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    mean_a = a.mean(0) if a.ndim == 3 else a
    mean_b = b.mean(0) if b.ndim == 3 else b
    if mean_a.shape != mean_b.shape:
        raise ValueError(
            f"rankings of different shapes {tuple(mean_a.shape)} and {tuple(mean_b.shape)}"
        )
    estimate = spearman(mean_a.float(), mean_b.float())
    index_a = bootstrap_indices(a.shape[0], n_boot, seed) if a.ndim == 3 else None
    index_b: Tensor | None
    if b.ndim == 3 and index_a is not None and b.shape[0] == a.shape[0]:
        index_b = index_a
    else:
        index_b = bootstrap_indices(b.shape[0], n_boot, seed + 1) if b.ndim == 3 else None
    stats = torch.empty(n_boot, dtype=torch.float64)
    for i in range(n_boot):
        sa = a[index_a[i]].mean(0) if index_a is not None else mean_a
        sb = b[index_b[i]].mean(0) if index_b is not None else mean_b
        stats[i] = _spearman_flat(sa.flatten(), sb.flatten())
    n = max(a.shape[0] if a.ndim == 3 else 0, b.shape[0] if b.ndim == 3 else 0)
    return percentile_interval(estimate, stats, level, n, n_boot, seed)
