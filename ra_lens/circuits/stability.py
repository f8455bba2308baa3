"""Bootstrap-stable edge scores: keep the size of an edge's score where its sign holds across
resamples of the pairs, shrink it where it does not.

`pair_scores` scores each pair on its own (`attribute` on one pair at a time: the same passes
as one call over all pairs, so the same numbers, only in batches of one) and keeps them as
`EdgeScores.per_pair`. `stable` resamples the pairs with replacement (`ranking.bootstrap_indices`,
the one resampler) and, per edge, from the bootstrap means b_1 .. b_B of its per-pair scores in
MIB's sign (`EdgeScores.helps`) and the mean m over all pairs:

    statistic="agreement": m * (2 p - 1), p the share of b_j with the sign of m (1 when every
        resample agrees, 0 for a coin flip);
    statistic="shrink": m * t^2 / (1 + t^2), t = m / std(b) (the bootstrap t; edges whose mean is
        small against its spread shrink towards 0, like a James-Stein estimate).

Both are m itself when every pair has the same scores (every resample is then the mean).
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import pairs
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.circuits.mib import mib_sign
from ra_lens.circuits.scores import EdgeScores
from ra_lens.ranking.statistics import bootstrap_indices
from ra_lens.timing import cpu_time, timed
from ra_lens.types import MetricFn, Tokens

Statistic = Literal["agreement", "shrink"]
STATISTICS: tuple[str, ...] = ("agreement", "shrink")
#: Resamples per matrix product (bounds memory: chunk x edges float64).
_BOOT_CHUNK = 50


def pair_scores(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    method: str = "eap",
    direction: str = "denoise",
    steps: int = 5,
    progress: bool = False,
) -> EdgeScores:
    """`circuits.attribute` on each pair alone: EdgeScores whose `per_pair`
    [pair writer reader] holds each pair's scores and `scores` their mean (what one `attribute`
    call over all pairs returns); `seconds` the process CPU time spent. Arguments as
    `attribute`'s (level "edge"); metric must be an `ra_lens.metrics` metric with per-pair
    targets (it is cut pair by pair). On a grouped-query model `ungrouped_scores` [writer
    ureader] is the mean of each pair's, as `attribute` over all pairs returns it."""
    from ra_lens.circuits.attribute import attribute

    spent: dict[str, float] = {}
    with timed(spent, "seconds", clock=cpu_time):
        clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
        n = clean_b.tokens.shape[0]
        parts, copies = [], []
        for i in range(n):
            rows = slice(i, i + 1)
            one = attribute(
                model,
                # one pair at the batch's full padded width: a metric holding per-position
                # tensors still lines up (attribute masks the padding)
                clean_b.rows(rows),
                corrupted_b.rows(rows),
                pairs.metric_rows(metric, rows, n),
                method=method,  # type: ignore[arg-type]  # checked by attribute
                direction=direction,  # type: ignore[arg-type]
                steps=steps,
                batch_size=1,
                progress=progress,
            )
            parts.append(one.scores.detach().to("cpu", torch.float64))
            if one.ungrouped_scores is not None:  # grouped-query: each query head's own copy
                copies.append(one.ungrouped_scores.detach().to("cpu", torch.float64))
        per_pair = torch.stack(parts)
    graph = one.graph
    return EdgeScores(
        graph,
        per_pair.mean(0),
        method,
        direction,
        per_pair=per_pair,
        seconds=spent["seconds"],
        # the mean of each pair's copies, as one attribute call over all pairs gives them
        ungrouped_scores=torch.stack(copies).mean(0) if copies else None,
    )


def stable(
    scores: Validated[EdgeScores],
    *,
    n_boot: int = 200,
    seed: int = 0,
    statistic: Validated[Statistic] = "agreement",
) -> EdgeScores:
    """Edge scores weighted by how well their sign holds across bootstrap resamples of the pairs
    (module docstring).

    Args:
        scores: EdgeScores with `per_pair` (from `pair_scores`).
        n_boot: resamples (each: n pairs drawn with replacement).
        seed: the resampler's seed (`ranking.bootstrap_indices`).
        statistic: "agreement" or "shrink".

    Returns:
        EdgeScores in MIB's sign (direction "denoise"), method "stable-<statistic>(<method>:
        <direction>)", `scores` Float[Tensor, "writer reader"] float64, 0 off the graph,
        `per_pair` the inputs' in MIB's sign, `seconds` the input's; `ungrouped_scores` (where
        the input has them, grouped-query models) each query head's copy in MIB's sign times its
        edge's weight, so the copies add up to the edge's stable score.

    Raises:
        ValueError: scores without per_pair, n_boot < 1, an unknown statistic.
    """
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores is a {type(scores).__name__}: pass EdgeScores from pair_scores")
    if scores.per_pair is None:
        raise ValueError(
            "these scores have no per_pair scores to resample: score with "
            "circuits.pair_scores(model, clean, corrupted, metric, method=...)"
        )
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}: choose one of {STATISTICS}")
    check_count(n_boot, "n_boot", why="a number of resamples")
    g = scores.graph
    sign = mib_sign(scores.direction)
    per_pair = sign * scores.per_pair.detach().to("cpu", torch.float64)
    flat = per_pair[:, g.real]  # [pair, edge]
    mean = flat.mean(0)
    agree, total, total_sq = _bootstrap_moments(flat, mean, n_boot, seed)
    if statistic == "agreement":
        weight = 2.0 * agree / n_boot - 1.0
    else:
        var = (total_sq / n_boot - (total / n_boot) ** 2).clamp_min(0.0)
        t_sq = mean**2 / var
        # std 0 (every resample gives m): the sign never moves, keep m whole
        weight = torch.where(var > 0, t_sq / (1.0 + t_sq), torch.ones_like(mean))
    out = torch.zeros(g.real.shape, dtype=torch.float64)
    out[g.real] = mean * weight
    copies = None
    if scores.ungrouped_scores is not None:
        # each copy keeps its part of the edge's mean, weighted like the edge (the statistic
        # is the grouped edge's: its sign is what the resamples agree on)
        weights = torch.zeros(g.real.shape, dtype=torch.float64)
        weights[g.real] = weight
        copies = sign * scores.ungrouped_scores.detach().to("cpu", torch.float64)
        copies = copies * weights[:, g.ungrouped_target]
    return EdgeScores(
        g,
        out,
        f"stable-{statistic}({scores.method}:{scores.direction})",
        "denoise",
        per_pair=per_pair,
        seconds=scores.seconds,
        ungrouped_scores=copies,
    )


def _bootstrap_moments(
    flat: Float[Tensor, "pair edge"], mean: Float[Tensor, " edge"], n_boot: int, seed: int
) -> tuple[Float[Tensor, " edge"], Float[Tensor, " edge"], Float[Tensor, " edge"]]:
    """Over n_boot resamples of the pairs: how many bootstrap means share the sign of `mean`
    (a zero mean agrees with nothing), their sum and their sum of squares, per edge."""
    n = flat.shape[0]
    index = bootstrap_indices(n, n_boot, seed)
    counts = torch.zeros(n_boot, n, dtype=torch.float64)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float64))
    sign = torch.sign(mean)
    agree = torch.zeros_like(mean)
    total = torch.zeros_like(mean)
    total_sq = torch.zeros_like(mean)
    for start in range(0, n_boot, _BOOT_CHUNK):
        boot = counts[start : start + _BOOT_CHUNK] @ flat / n  # [chunk, edge]
        agree += ((torch.sign(boot) == sign) & (sign != 0)).sum(0)
        total += boot.sum(0)
        total_sq += boot.pow(2).sum(0)
    return agree, total, total_sq
