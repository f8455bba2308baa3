"""How stable a method's circuits are: bootstrap Jaccard of the chosen edges at MIB's sizes.

A circuit found on one sample of pairs may not be the circuit found on another. `bootstrap_jaccard`
resamples the pairs with replacement (`ranking.bootstrap_indices`, the one resampler), takes each
resample's mean of the per-pair edge scores (`EdgeScores.per_pair`, from `pair_scores`), chooses
the circuit of every size from it exactly as the curves do (`EdgeScores.top`: MIB's sizes in
EAP-IG's ungrouped edges, pruned), and compares the resamples' circuits with the Jaccard index of
their edge sets, |A and B| / |A or B|:

- `pairwise[s]`: the mean over all pairs of distinct resamples (the stability of the method on
  data like this; Méloux et al. 2025 call a circuit stable at >= 0.8);
- `to_full[s, b]`: resample b's circuit against the circuit of all the pairs.

A mean of per-pair scores is what one `attribute` call over the resample would return for the
linear methods ("eap", "eap-ig": the metric's gradient is taken pair by pair), so each resample
costs a matrix product, not an attribution.

    >>> from ra_lens.circuits.graph import Graph
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    >>> same = g.real.double()[None].repeat(3, 1, 1)  # three pairs, identical scores
    >>> scores = EdgeScores(g, same.mean(0), "eap", "denoise", per_pair=same)
    >>> stab = bootstrap_jaccard(scores, fractions=[0.01, 1.0], n_boot=5)
    >>> stab.pairwise.tolist()  # 1 %: pruned to nothing (no evidence); 100 %: the same circuits
    [nan, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.checks import check_count
from ra_lens.circuits.graph import Units
from ra_lens.circuits.mib import MIB_SUBMISSION_FRACTIONS, check_fractions
from ra_lens.circuits.scores import EdgeScores
from ra_lens.progress import tqdm
from ra_lens.ranking.statistics import bootstrap_indices
from ra_lens.record import Recorded, json_ready

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The bar Méloux et al. (2025) propose for calling a circuit stable.
STABLE_JACCARD = 0.8


@dataclass
class CircuitStability(Recorded):
    """The result of `bootstrap_jaccard`.

    Attributes:
        method: the scores' method label.
        absolute: True for the |score| ranking (CMD's), False for the signed one (CPR's).
        units: what `n_edges` counts ("ungrouped": EAP-IG's edges, as MIB).
        fractions: the sizes, as fractions of the graph's edges.
        n_edges: the edge budget of each size.
        pairwise: Float[Tensor, "size"]: mean Jaccard over pairs of distinct resamples.
        to_full: Float[Tensor, "size boot"]: each resample's circuit against all pairs' circuit
            (NaN where both circuits compared are empty, pruned to nothing; `pairwise` leaves
            such pairs out).
        n_pairs: the pairs resampled; seed: the resampler's seed.
    """

    method: str
    absolute: bool
    units: str
    fractions: list[float]
    n_edges: list[int]
    pairwise: Float[Tensor, " size"]
    to_full: Float[Tensor, "size boot"]
    n_pairs: int
    seed: int

    def __repr__(self) -> str:
        seen = self.pairwise[~self.pairwise.isnan()]
        low = float(seen.min()) if seen.numel() else float("nan")
        return (
            f"CircuitStability({self.method}, {'|score|' if self.absolute else 'signed'} ranking, "
            f"{self.to_full.shape[1]} resamples of {self.n_pairs} pairs, "
            f"lowest pairwise Jaccard {low:.3f})"
        )

    def stable(self, bar: float = STABLE_JACCARD) -> list[bool]:
        """Per size: is the mean pairwise Jaccard at least `bar`? (False where it is NaN: every
        circuit of that size pruned to nothing.)"""
        return [float(j) >= bar for j in self.pairwise]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the sizes, the pairwise means, the to-full means and 95 % ranges."""
        low, high = self._to_full_range()
        report: dict[str, Any] = json_ready(
            {
                "method": self.method,
                "ranking": "abs" if self.absolute else "signed",
                "units": self.units,
                "n_pairs": self.n_pairs,
                "n_boot": int(self.to_full.shape[1]),
                "seed": self.seed,
                "fractions": list(self.fractions),
                "n_edges": list(self.n_edges),
                "pairwise": self.pairwise.tolist(),
                "to_full_mean": self.to_full.nanmean(1).tolist(),
                "to_full_low": low.tolist(),
                "to_full_high": high.tolist(),
                "stable_bar": STABLE_JACCARD,
            }
        )
        return report

    def _to_full_range(self) -> tuple[Tensor, Tensor]:
        return (
            torch.nanquantile(self.to_full, 0.025, dim=1),
            torch.nanquantile(self.to_full, 0.975, dim=1),
        )

    def table(self) -> str:
        """A Markdown table: one row per size."""
        low, high = self._to_full_range()
        rows = [
            repr(self),
            "",
            "| fraction | edges | pairwise Jaccard | vs all pairs (95 % range) |",
            "|---:|---:|---:|---|",
        ]
        for i, fraction in enumerate(self.fractions):
            rows.append(
                f"| {fraction:g} | {self.n_edges[i]} | {float(self.pairwise[i]):.3f} | "
                f"{float(self.to_full[i].nanmean()):.3f} [{float(low[i]):.3f}, "
                f"{float(high[i]):.3f}] |"
            )
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Jaccard against the circuit's size (log axis), with the 0.8 bar; `save` also
        writes it."""
        from ra_lens.viz.curves import stability_curve

        low, high = self._to_full_range()
        return stability_curve(
            self.fractions, self.pairwise, self.to_full.nanmean(1), low, high,
            bar=STABLE_JACCARD,
            title=f"{self.method}: circuit stability "
            f"({'|score|' if self.absolute else 'signed'} ranking, {self.n_pairs} pairs)",
            save=save,
        )  # fmt: skip


def bootstrap_jaccard(
    scores: Validated[EdgeScores],
    fractions: Validated[Sequence[float]] = MIB_SUBMISSION_FRACTIONS,
    *,
    n_boot: int = 100,
    seed: int = 0,
    absolute: bool = False,
    units: Validated[Units] = "ungrouped",
    progress: bool = False,
) -> CircuitStability:
    """Bootstrap Jaccard of the circuits chosen from `scores` at each size (module docstring).

    Args:
        scores: EdgeScores with `per_pair` [pair writer reader] of at least 2 pairs
            (`circuits.pair_scores`).
        fractions: sizes as fractions of the graph's edges (default MIB's nine submission
            sizes, 0.1 % .. 50 %; at 100 % every circuit is the whole graph).
        n_boot: resamples (at least 2).
        seed: the resampler's seed.
        absolute: rank by |score| (CMD's circuits) instead of the signed score (CPR's).
        units: "ungrouped" (EAP-IG's edges, as MIB counts) or "grouped".
        progress: a progress bar over the resamples.

    Returns:
        CircuitStability (pairwise [size], to_full [size boot]).

    Raises:
        TypeError: scores that are not EdgeScores.
        ValueError: no per_pair scores or fewer than 2 pairs, non-finite scores, n_boot < 2,
            fractions outside (0, 1].
    """
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores is a {type(scores).__name__}: pass EdgeScores from pair_scores")
    if scores.per_pair is None or scores.per_pair.shape[0] < 2:
        have = 0 if scores.per_pair is None else scores.per_pair.shape[0]
        raise ValueError(
            f"bootstrap_jaccard resamples pairs and these scores hold {have} pairs' own scores: "
            "score at least 2 pairs with circuits.pair_scores(model, clean, corrupted, metric, "
            "method=...)"
        )
    _check_resamples(n_boot)
    per_pair = scores.per_pair.detach().to("cpu", torch.float64)
    if not bool(per_pair[:, scores.graph.real].isfinite().all()):
        raise ValueError(
            "these scores hold NaN or inf per-pair scores: rerun the attribution (a metric "
            "that is NaN on some pair?) before measuring stability"
        )
    fractions = list(check_fractions(fractions))
    sizes = _sizes(scores, fractions, units)
    index = bootstrap_indices(per_pair.shape[0], n_boot, seed)

    def chosen(rows: Tensor | None) -> list[Tensor]:
        mean = per_pair.mean(0) if rows is None else per_pair[rows].mean(0)
        resampled = EdgeScores(scores.graph, mean, scores.method, scores.direction)
        return [_edge_set(resampled, n, absolute, units) for n in sizes]

    boots = [chosen(index[b]) for b in tqdm(range(n_boot), desc="bootstrap circuits", disable=not progress)]  # fmt: skip
    n_pairs = int(per_pair.shape[0])
    return _stability(scores, chosen(None), boots, fractions, sizes, absolute, units, seed, n_pairs)


def refit_jaccard(
    fit: Callable[[list[int]], EdgeScores],
    n_pairs: int,
    fractions: Validated[Sequence[float]] = MIB_SUBMISSION_FRACTIONS,
    *,
    n_boot: int = 10,
    seed: int = 0,
    absolute: bool = False,
    units: Validated[Units] = "ungrouped",
    progress: bool = False,
) -> CircuitStability:
    """Bootstrap Jaccard of a method that is not a mean of per-pair scores (a learned mask,
    `learn_mask`): the method is run again on each resample of the pairs, not averaged.

    `fit(rows)` must return the method's EdgeScores on the pairs `rows` (indices into the
    n_pairs pairs, with repeats: a resample); it is called n_boot + 1 times (all the pairs,
    then each resample, drawn as `bootstrap_jaccard` draws them with the same seed), so this
    costs n_boot + 1 runs of the method. Circuits are chosen as `bootstrap_jaccard` chooses
    them (`EdgeScores.top`, MIB's sizes, pruned).

    >>> from ra_lens.circuits.graph import Graph
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    >>> per_pair = torch.rand((4, *g.real.shape), generator=torch.Generator().manual_seed(0))
    >>> fit = lambda rows: EdgeScores(g, per_pair[rows].mean(0) * g.real, "eap", "denoise")
    >>> refit = refit_jaccard(fit, 4, [0.5, 1.0], n_boot=3)
    >>> mean = EdgeScores(g, per_pair.mean(0), "eap", "denoise", per_pair=per_pair)
    >>> linear = bootstrap_jaccard(mean, [0.5, 1.0], n_boot=3)
    >>> torch.equal(refit.pairwise, linear.pairwise)  # a linear method: the same resamples, the same circuits
    True

    Raises:
        ValueError: n_pairs < 2, n_boot < 2, fractions outside (0, 1], or a fit that returns
            scores of another graph or with non-finite values.
    """
    check_count(n_pairs, "n_pairs", why="the number of pairs to resample")
    if n_pairs < 2:
        raise ValueError(f"n_pairs={n_pairs}: resampling needs at least 2 pairs")
    _check_resamples(n_boot)
    fractions = list(check_fractions(fractions))
    index = bootstrap_indices(n_pairs, n_boot, seed)
    full = _fitted(fit, list(range(n_pairs)), None)
    sizes = _sizes(full, fractions, units)

    def chosen(rows: list[int]) -> list[Tensor]:
        scores = _fitted(fit, rows, full)
        return [_edge_set(scores, n, absolute, units) for n in sizes]

    boots = [chosen(index[b].tolist()) for b in tqdm(range(n_boot), desc="refit circuits", disable=not progress)]  # fmt: skip
    first = [_edge_set(full, n, absolute, units) for n in sizes]
    return _stability(full, first, boots, fractions, sizes, absolute, units, seed, n_pairs)


def _check_resamples(n_boot: int) -> None:
    check_count(n_boot, "n_boot", why="a number of resamples")
    if n_boot < 2:
        raise ValueError(f"n_boot={n_boot}: pairwise Jaccard needs at least 2 resamples")


def _fitted(fit: Callable[[list[int]], EdgeScores], rows: list[int], like: EdgeScores | None) -> EdgeScores:  # fmt: skip
    scores = fit(rows)
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"fit returned a {type(scores).__name__}: it must return EdgeScores")
    if like is not None and scores.graph != like.graph:
        raise ValueError(f"fit returned scores over {scores.graph}, its first run's were over {like.graph}: fit one model")  # fmt: skip
    if not bool(scores.scores.detach()[scores.graph.real].isfinite().all()):
        raise ValueError("fit returned NaN or inf scores on the graph's edges: check the method on these pairs before measuring stability")  # fmt: skip
    return scores


def _sizes(scores: EdgeScores, fractions: list[float], units: Units) -> list[int]:
    total = scores.graph.count(units)
    return [round(f * total) for f in fractions]


def _stability(
    scores: EdgeScores,
    full: list[Tensor],
    boots: list[list[Tensor]],
    fractions: list[float],
    sizes: list[int],
    absolute: bool,
    units: Units,
    seed: int,
    n_pairs: int,
) -> CircuitStability:
    """CircuitStability from each size's circuit on all pairs (`full`) and on every resample
    (`boots[b][size]`), Bool over the graph's real edges."""
    pairwise = torch.zeros(len(sizes), dtype=torch.float64)
    to_full = torch.zeros(len(sizes), len(boots), dtype=torch.float64)
    for s in range(len(sizes)):
        sets = torch.stack([boot[s] for boot in boots])
        pairwise[s] = _mean_pairwise(sets)
        to_full[s] = _jaccard(sets, full[s][None])[:, 0]
    return CircuitStability(
        scores.method, absolute, units, fractions, sizes, pairwise, to_full, n_pairs, seed
    )


def _edge_set(scores: EdgeScores, n: int, absolute: bool, units: Units) -> Bool[Tensor, " edge"]:
    """The circuit `top` chooses from these scores, as a Bool over the graph's real edges
    (grouped-query copies by equal shares, `top`'s default)."""
    return scores.top(n, absolute=absolute, units=units).edges[scores.graph.real]


def _jaccard(a: Tensor, b: Tensor) -> Float[Tensor, "a b"]:
    """Jaccard index of each row of a against each row of b (Bool [n edge]); NaN where both are
    empty (a size so small that pruning leaves no path says nothing about stability)."""
    a64, b64 = a.double(), b.double()
    inter = a64 @ b64.T
    union = a64.sum(1)[:, None] + b64.sum(1)[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(inter, math.nan))


def _mean_pairwise(sets: Tensor) -> float:
    """Mean Jaccard over the pairs of distinct rows (NaN pairs, both empty, left out)."""
    j = _jaccard(sets, sets)
    off = ~torch.eye(sets.shape[0], dtype=torch.bool)
    return float(j[off].nanmean())
