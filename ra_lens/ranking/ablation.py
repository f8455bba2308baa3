"""Ablation curves: keep the top (or bottom) fraction of heads under a ranking, ablate every other
head's output at hook_z (zero, or mean: `patching.last_token_means`), and record the task's top-k
accuracy; the curve's area (AUC) with bootstrap intervals over the test prompts.

    >>> curve = ablation_curve(model, test_prompts, scores)                # doctest: +SKIP
    >>> curve.auc, auc_interval(curve)                                     # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.math import trapezoid_auc
from ra_lens.patching import HeadMeans, ablation_hooks, head_ablation_hooks
from ra_lens.ranking.engine import check_scores, head_order
from ra_lens.ranking.statistics import Interval, bootstrap_mean
from ra_lens.record import Recorded
from ra_lens.types import Scores

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ra_lens.tasks import Accuracy

#: p = 0, 10, ..., 100% of heads kept.
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(i / 10 for i in range(11))
#: Dense where the curves move (most models break when over half their heads are removed).
DENSE_FRACTIONS: tuple[float, ...] = (
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class AblationCurve(Recorded):
    """Task accuracy when only the top (or, with reverse, bottom) fraction of heads is kept.

    Attributes:
        fractions: fractions p of heads kept, in the order given.
        n_kept: number of heads kept at each p, round(p * n_heads_total).
        accuracies: `tasks.Accuracy` at each p (every other head zeroed at hook_z).
        reverse: False: the highest-scored heads are kept; True: the lowest-scored.

    >>> from ra_lens.tasks import Accuracy
    >>> accs = [Accuracy.from_ranks(torch.tensor(r)) for r in ([5, 5], [0, 5], [0, 0])]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accs)
    >>> curve.top1, curve.auc, curve.auc_top3
    ([0.0, 0.5, 1.0], 0.5, 0.5)
    """

    fractions: list[float]
    n_kept: list[int]
    accuracies: list[Any]
    reverse: bool = False

    def curve(self, k: int = 1) -> list[float]:
        """Top-k accuracy at each fraction."""
        return [a.top(k) for a in self.accuracies]

    @property
    def top1(self) -> list[float]:
        return self.curve(1)

    @property
    def top3(self) -> list[float]:
        return self.curve(3)

    def auc_at(self, k: int = 1) -> float:
        """Area under the top-k curve over the fractions (trapezoid rule, `trapezoid_auc`).

        Over p in [0, 1] when the fractions span it, so 1.0 = perfect accuracy everywhere."""
        return trapezoid_auc(self.fractions, self.curve(k))

    @property
    def auc(self) -> float:
        """Area under the top-1 curve."""
        return self.auc_at(1)

    @property
    def auc_top3(self) -> float:
        return self.auc_at(3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fractions": list(self.fractions),
            "n_kept": list(self.n_kept),
            "reverse": self.reverse,
            "top1": self.top1,
            "top3": self.top3,
            "auc": self.auc,
            "auc_top3": self.auc_top3,
        }

    def table(self) -> str:
        """A Markdown table: one row per fraction (heads kept, top-1 and top-3), then the AUCs."""
        kept = "bottom" if self.reverse else "top"
        rows = [f"| % of heads kept ({kept}) | heads | top-1 | top-3 |", "|---:|---:|---:|---:|"]
        for p, n, a1, a3 in zip(self.fractions, self.n_kept, self.top1, self.top3):
            rows.append(f"| {100 * p:g} | {n} | {a1:.4f} | {a3:.4f} |")
        rows.append(f"\nAUC {self.auc:.4f} (top-1), {self.auc_top3:.4f} (top-3)")
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Top-1 accuracy against the fraction of heads kept (`viz.ablation_curves`)."""
        from ra_lens.viz import ablation_curves

        name = "bottom heads kept" if self.reverse else "top heads kept"
        return ablation_curves(self.fractions, {name: self.top1}, save=save)


def check_fractions(fractions: Sequence[float]) -> list[float]:
    """Fractions as floats, each in [0, 1], at least one; or a ValueError.

    >>> check_fractions([0, 0.5, 1])
    [0.0, 0.5, 1.0]
    >>> check_fractions([1.5])
    Traceback (most recent call last):
    ValueError: fractions of heads kept must lie in [0, 1], got [1.5]
    """
    out = [float(p) for p in fractions]
    if not out:
        raise ValueError("no fractions given: pass e.g. (0, 0.1, ..., 1)")
    bad = [p for p in out if not 0.0 <= p <= 1.0]
    if bad:
        raise ValueError(f"fractions of heads kept must lie in [0, 1], got {bad}")
    return out


def kept_heads(scores: Scores, fraction: float, *, reverse: bool = False) -> list[tuple[int, int]]:
    """The round(fraction x n_heads) heads kept at `fraction`: the top ones, or the bottom ones.

    >>> scores = torch.tensor([[0.1, 0.9], [0.5, 0.3]])
    >>> kept_heads(scores, 0.5), kept_heads(scores, 0.5, reverse=True)
    ([(0, 1), (1, 0)], [(0, 0), (1, 1)])
    """
    (fraction,) = check_fractions([fraction])
    order = head_order(scores, reverse=reverse)
    return order[: math.floor(fraction * len(order) + 0.5)]


def ablation_curve(
    model: HookedModel,
    prompts: Sequence[Any],
    scores: Validated[Scores],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    reverse: bool = False,
    mode: Validated[Literal["zero", "mean"]] = "zero",
    means: HeadMeans | None = None,
    batch_size: int = 16,
    evaluate: Callable[[list[tuple[int, int]]], Any] | None = None,
) -> AblationCurve:
    """Keep the top p of heads under `scores` (reverse: the bottom p), zero all the others' outputs
    at hook_z (or, with mode="mean", replace them by `means`), and measure the task's top-k
    accuracy, for each p in `fractions`.

    Args:
        model: a TransformerLens model.
        prompts: `tasks.Prompt`s (any lengths: `tasks.evaluate` reads each prompt's last token).
        scores: Float[Tensor, "layer head"] of the model's shape; larger = more important.
        fractions: fractions of heads kept, each in [0, 1].
        reverse: keep the lowest-scored heads instead.
        mode, means: as in `ablation_hooks` ("mean" needs `means =
            last_token_means(model, held_out_tokens)` or `mean_head_outputs(...)`).
        evaluate: optional `ablated heads -> Accuracy` replacing `evaluate_ablated`, e.g. one
            `AblationEvaluator` shared by several curves (each head set runs once).

    Returns:
        AblationCurve with one `Accuracy` per fraction; `.auc` is the top-1 area.

    >>> from ra_lens import tasks
    >>> from ra_lens.ranking import random_ranking
    >>> prompts = tasks.build_prompts([("b", "of"), ("c", "is"), ("d", "to")], shots=1, seed=0)
    >>> curve = ablation_curve(model, prompts, random_ranking(2, 4), fractions=[0, 0.5, 1])
    >>> curve.n_kept
    [0, 4, 8]
    >>> unablated = tasks.evaluate(model, prompts)
    >>> torch.equal(curve.accuracies[-1].ranks, unablated.ranks)  # p = 1: no head ablated
    True
    """

    shape = capture.model_shape(model)
    scores = check_scores(scores, shape.n_layers, shape.n_heads)
    fractions = check_fractions(fractions)
    if not prompts:
        raise ValueError("no prompts to evaluate the ablations on")

    def default(ablated: list[tuple[int, int]]) -> Any:
        chosen = means if mode == "mean" else None
        return evaluate_ablated(model, prompts, ablated, means=chosen, batch_size=batch_size)

    if evaluate is None:
        head_ablation_hooks([], mode=mode, means=means, model=model)  # checks mode and means
    run = evaluate or default
    order = head_order(scores, reverse=reverse)
    n_kept, accuracies = [], []
    for p in fractions:
        k = math.floor(p * len(order) + 0.5)
        n_kept.append(k)
        accuracies.append(run(sorted(order[k:])))
    return AblationCurve(fractions, n_kept, accuracies, reverse)


def evaluate_ablated(
    model: HookedModel,
    prompts: Sequence[Any],
    ablated: Sequence[tuple[int, int]],
    *,
    means: HeadMeans | None = None,
    batch_size: int = 16,
) -> Accuracy:
    """`tasks.evaluate` with `ablated` heads zeroed or mean-ablated.

    With position-aligned means (`last_token_means`) the prompts run one token length at a time
    (`by_length=True`), so every row of a batch is unpadded and lines up with the means at its
    last token. Returns `tasks.Accuracy`.

    >>> from ra_lens import tasks
    >>> prompts = tasks.build_prompts([("b", "of"), ("c", "is"), ("d", "to")], shots=1, seed=0)
    >>> ablated = evaluate_ablated(model, prompts, [(0, 1), (1, 2)])
    >>> hooks = ablation_hooks([(0, 1), (1, 2)])
    >>> torch.equal(ablated.ranks, tasks.evaluate(model, prompts, fwd_hooks=hooks).ranks)
    True
    """
    from ra_lens import tasks

    hooks = ablation_hooks(ablated, means=means, model=model) if ablated else []
    aligned = means is not None and means.ndim == 4 and bool(ablated)
    return tasks.evaluate(
        model, list(prompts), fwd_hooks=hooks, batch_size=batch_size, by_length=aligned or None
    )


class AblationEvaluator:
    """`ablated heads -> tasks.Accuracy` on fixed prompts (`evaluate_ablated`), each set of heads
    run once: curves of several rankings share their endpoints and many middle points, so pass one
    evaluator as `ablation_curve(..., evaluate=evaluator)` to all of them.

    Attributes:
        runs: how many head sets were actually evaluated (the rest came from the cache).

    >>> from ra_lens import tasks
    >>> from ra_lens.ranking import random_ranking
    >>> prompts = tasks.build_prompts([("b", "of"), ("c", "is"), ("d", "to")], shots=1, seed=0)
    >>> evaluate = AblationEvaluator(model, prompts)
    >>> curves = [
    ...     ablation_curve(model, prompts, random_ranking(2, 4, seed=s), [0, 1], evaluate=evaluate)
    ...     for s in range(3)
    ... ]
    >>> evaluate.runs  # all heads ablated, none ablated: once each for the three curves
    2
    >>> torch.equal(evaluate([(1, 2), (0, 1)]).ranks, evaluate_ablated(model, prompts, [(0, 1), (1, 2)]).ranks)
    True
    """

    def __init__(
        self,
        model: HookedModel,
        prompts: Sequence[Any],
        *,
        means: HeadMeans | None = None,
        batch_size: int = 16,
    ):
        self.model, self.prompts = model, list(prompts)
        self.means, self.batch_size = means, batch_size
        self._seen: dict[tuple[tuple[int, int], ...], Any] = {}

    @property
    def runs(self) -> int:
        return len(self._seen)

    def __call__(self, ablated: Sequence[tuple[int, int]]) -> Any:
        key = tuple(sorted((int(layer), int(head)) for layer, head in ablated))
        if key not in self._seen:
            self._seen[key] = evaluate_ablated(
                self.model, self.prompts, list(key), means=self.means, batch_size=self.batch_size
            )
        return self._seen[key]


def per_prompt_auc(curve: AblationCurve, k: int = 1) -> Float[Tensor, "n"]:
    """Each test prompt's own area under its 0/1 top-k curve (trapezoid rule over the fractions,
    sorted). Their mean is `curve.auc_at(k)`, which is why a bootstrap over prompts is exact
    resampling of the AUC.

    >>> from ra_lens.tasks import Accuracy
    >>> ranks = [[9, 9], [0, 9], [0, 0]]  # 2 prompts; prompt 0 right from p = 0.5 on, prompt 1 at 1
    >>> accuracies = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accuracies)
    >>> per_prompt_auc(curve), curve.auc
    (tensor([0.7500, 0.2500], dtype=torch.float64), 0.5)
    """
    order = sorted(range(len(curve.fractions)), key=lambda j: curve.fractions[j])
    xs = torch.tensor([curve.fractions[j] for j in order], dtype=torch.float64)
    hits = torch.stack([(curve.accuracies[j].ranks < k).double() for j in order])  # [step n]
    if len(order) < 2:
        return torch.zeros(hits.shape[1], dtype=torch.float64)
    widths = (xs[1:] - xs[:-1])[:, None]
    return (widths * (hits[1:] + hits[:-1]) / 2).sum(0)


def auc_interval(
    curve: AblationCurve,
    k: int = 1,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Top-k ablation AUC with a percentile bootstrap interval over the test prompts.

    >>> from ra_lens.tasks import Accuracy
    >>> ranks = [[9, 9, 9, 9], [0, 0, 9, 9], [0, 0, 0, 9]]
    >>> accuracies = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accuracies)
    >>> interval = auc_interval(curve, n_boot=500)
    >>> interval.estimate == curve.auc, interval.low <= curve.auc <= interval.high
    (True, True)
    """
    interval = bootstrap_mean(per_prompt_auc(curve, k), n_boot=n_boot, seed=seed, level=level)
    return replace(interval, estimate=curve.auc_at(k))


def paired_auc_difference(
    a: AblationCurve,
    b: AblationCurve,
    k: int = 1,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """AUC(a) - AUC(b) with a paired bootstrap: both curves resampled on the same test prompts.

    Raises:
        ValueError: the curves were not measured on the same number of prompts.

    >>> from ra_lens.tasks import Accuracy
    >>> def curve(*ranks):
    ...     accs = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    ...     return AblationCurve([0.0, 1.0], [0, 2], accs)
    >>> good, bad = curve([0, 0, 9], [0, 0, 0]), curve([9, 9, 9], [0, 0, 0])
    >>> print(paired_auc_difference(good, bad, n_boot=500))
    0.333 [0.000, 0.500]
    """
    pa, pb = per_prompt_auc(a, k), per_prompt_auc(b, k)
    if pa.shape != pb.shape:
        raise ValueError(
            f"curves on {pa.numel()} and {pb.numel()} prompts: a paired bootstrap needs both "
            "measured on the same test prompts"
        )
    interval = bootstrap_mean(pa - pb, n_boot=n_boot, seed=seed, level=level)
    return replace(interval, estimate=a.auc_at(k) - b.auc_at(k))
