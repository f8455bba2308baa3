"""How far down the |score| ranking a method's harmful edges go, chosen by measurement.

MIB's CMD takes circuits by |score|: an edge that hurts the metric (a negative score in MIB's
sign) enters them as early as an edge that helps as much. A learned mask's log-odds overstate the
edges that hurt (patching them raises the metric, so training pushes them further down than their
effect warrants), and its |score| circuits then keep too many of them. `scale_negatives`
multiplies every negative score (each query head's copy on its own, where the scores have copies)
by one factor c in (0, 1]: the signed ranking, hence CPR, is unchanged where each score stands
alone (a model without grouped keys, or per-copy circuits, `own_copies=True`, as MIB's evaluator
patches); only where the negatives enter the |score| ranking moves. (A grouped key/value edge is
the sum of its copies, so where its copies differ in sign its grouped score moves too.)

`calibrate_negatives` chooses c among a few candidates by the CMD of the |score| circuits on the
pairs it is given: one faithfulness pass per distinct circuit, a circuit the candidates share
measured once. A mask behaves differently on the pairs it was trained on, so give it pairs the
scores were not fitted to where there are some. `cross_calibrate` does the same over several
folds (each fit's scores on pairs that fit did not see: `circuits.discover`'s two halves, each
mask on the other half's pairs) and chooses by the folds' mean CMD, for scores built from the
fits (their mean); it can stop at the first candidate whose mean CMD is worse than the one
before (the CMD of every calibration measured so far falls then rises along the factors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from ra_lens import timing
from ra_lens._typing import Validated
from ra_lens.circuits.faithfulness import Ablation, FaithfulnessEvaluator
from ra_lens.circuits.graph import UNITS, Units
from ra_lens.circuits.mib import MIB_FRACTIONS, ChosenCircuits, check_fractions, mib_sign
from ra_lens.circuits.scores import EdgeScores
from ra_lens.math import trapezoid_auc
from ra_lens.progress import tqdm
from ra_lens.record import Recorded
from ra_lens.types import HookedModel, MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The factors `calibrate_negatives` tries by default (1: the scores as they are).
CANDIDATES: tuple[float, ...] = (1.0, 0.5, 0.25)


def _check_scale(scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and 0 < scale <= 1):
        raise ValueError(f"scale={scale!r}: give a number in (0, 1] (1 leaves the scores as they are)")  # fmt: skip


def scale_negatives(scores: EdgeScores, scale: float) -> EdgeScores:
    """`scores` with every score that hurts the metric (negative in MIB's sign) times `scale`.

    Where the scores have per-copy scores (`ungrouped_scores`), each copy is scaled by its own
    sign and the grouped scores are rebuilt as the sums of their copies, as EAP-IG's are.

    Args:
        scores: EdgeScores of any method.
        scale: in (0, 1]; 1 returns `scores` itself.

    Returns:
        EdgeScores of the same graph, method and direction (`seconds` kept).
    """
    _check_scale(scale)
    if scale == 1:  # as they are: rebuilt sums of copies would differ from them by rounding
        return scores
    sign = mib_sign(scores.direction)

    def scaled(values: torch.Tensor) -> torch.Tensor:
        values = values.detach().to("cpu", torch.float64)
        return torch.where(sign * values < 0, values * scale, values)

    ungrouped = scores.ungrouped_scores
    if ungrouped is None:
        return dataclasses.replace(scores, scores=scaled(scores.scores))
    copies = scaled(ungrouped)
    graph = scores.graph
    grouped = torch.zeros(graph.real.shape, dtype=torch.float64).index_add_(1, graph.ungrouped_target, copies)  # fmt: skip
    return dataclasses.replace(scores, scores=grouped * graph.real, ungrouped_scores=copies)


@dataclass(frozen=True)
class NegativeScale(Recorded):
    """The factor `calibrate_negatives` chose and what it saw.

    Attributes:
        scale: the chosen factor (the smallest CMD; the first candidate on a tie).
        candidates: the factors tried, in order of preference on a tie (`cross_calibrate`
            with stop_when_worse: up to the first that was worse than the one before).
        cmds: CMD of each candidate's |score| circuits on the calibration pairs (the folds'
            mean, where there are several).
        scores: the scores the factor is for, their negatives times `scale`.
        seconds: CPU seconds of the calibration (the faithfulness passes).
        fold_cmds: each fold's CMDs, one list per fold in the candidates' order.
    """

    scale: float
    candidates: list[float]
    cmds: list[float]
    scores: EdgeScores = field(repr=False)
    seconds: float = 0.0
    fold_cmds: list[list[float]] = field(default_factory=list)

    @property
    def cmd(self) -> dict[float, float]:
        """candidate -> CMD of its |score| circuits on the calibration pairs."""
        return dict(zip(self.candidates, self.cmds, strict=True))

    def to_dict(self) -> dict[str, Any]:
        folds = [dict(zip(map(str, self.candidates), f, strict=True)) for f in self.fold_cmds]
        return {"scale": self.scale, "cmd": {str(c): v for c, v in self.cmd.items()}, "fold_cmd": folds, "seconds": self.seconds}  # fmt: skip

    def table(self) -> str:
        rows = [f"| {c:g} | {v:.4f} | {'yes' if c == self.scale else ''} |" for c, v in self.cmd.items()]  # fmt: skip
        return "\n".join(["| negative scale | CMD | chosen |", "|---|---|---|", *rows])

    def plot(self, save: str | Path | None = None) -> Figure:
        """CMD of each candidate factor, the chosen one coloured; `save` also writes it."""
        from ra_lens.viz.curves import named_bars

        return named_bars(
            [f"negatives x {c:g}" for c in self.candidates], self.cmds,
            title=f"{self.scores.method}: CMD by negative scale", xlabel="CMD (lower is better)",
            kept=[c == self.scale for c in self.candidates], save=save,
        )  # fmt: skip


def check_candidates(candidates: Sequence[float]) -> None:
    """Refuse an empty list of factors, or one outside (0, 1] (`scale_negatives`'s check)."""
    if not candidates:
        raise ValueError("candidates is empty: give at least one factor in (0, 1], e.g. (1.0, 0.5, 0.25)")  # fmt: skip
    for c in candidates:
        _check_scale(c)


class Fold(NamedTuple):
    """Scores and pairs they were not fitted to (`cross_calibrate`)."""

    scores: EdgeScores
    clean: Tokens
    corrupted: Tokens
    metric: MetricFn


def calibrate_negatives(
    model: HookedModel,
    scores: EdgeScores,
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    candidates: Sequence[float] = CANDIDATES,
    sizes: Sequence[float] | None = None,
    ablation: str = "patching",
    units: Validated[Units] = "ungrouped",
    own_copies: bool = False,
    batch_size: int = 8,
    progress: bool = False,
) -> NegativeScale:
    """Choose the factor on the negative scores that gives the lowest CMD on these pairs.

    Args:
        model: the model the scores are for.
        scores: EdgeScores of any method (best: not fitted to these pairs; module docstring).
        clean, corrupted, metric: the calibration pairs and the metric (`circuits.faithfulness`).
        candidates: factors in (0, 1] to try, in order of preference on a tie.
        sizes: fractions of the edges (default MIB's, `MIB_FRACTIONS`).
        ablation, units, own_copies: as `faithfulness_curve` takes them.
        batch_size: pairs per forward pass.
        progress: show a progress bar.

    Returns:
        NegativeScale: the chosen factor, the CMD of every candidate, the scaled scores.
    """
    return cross_calibrate(
        model, [Fold(scores, clean, corrupted, metric)], scores, candidates=candidates,
        sizes=sizes, ablation=ablation, units=units, own_copies=own_copies,
        batch_size=batch_size, progress=progress,
    )  # fmt: skip


def cross_calibrate(
    model: HookedModel,
    folds: Sequence[Fold],
    scores: EdgeScores,
    *,
    candidates: Sequence[float] = CANDIDATES,
    sizes: Sequence[float] | None = None,
    ablation: str = "patching",
    units: Validated[Units] = "ungrouped",
    own_copies: bool = False,
    stop_when_worse: bool = False,
    batch_size: int = 8,
    progress: bool = False,
) -> NegativeScale:
    """Choose the factor on the negative scores of `scores` by the mean CMD over the folds.

    Args:
        model: the model the scores are for.
        folds: each a fit's scores and pairs it was not fitted to (`Fold`).
        scores: the scores the factor is for (e.g. the mean of the folds' fits).
        candidates: factors in (0, 1] to try in this order, the earlier preferred on a tie.
        sizes: fractions of the edges (default MIB's, `MIB_FRACTIONS`).
        ablation, units, own_copies: as `faithfulness_curve` takes them.
        stop_when_worse: stop at the first candidate whose mean CMD exceeds the previous
            one's (those after it are not measured).
        batch_size: pairs per forward pass.
        progress: show a progress bar.

    Returns:
        NegativeScale: the chosen factor, the mean and per-fold CMD of each candidate tried,
        `scores` with its negatives times the factor.
    """
    check_candidates(candidates)
    if not folds:
        raise ValueError("folds is empty: give at least one Fold(scores, clean, corrupted, metric)")  # fmt: skip
    if units not in UNITS:
        raise ValueError(f"units={units!r}: expected one of {UNITS}")
    fractions = check_fractions(MIB_FRACTIONS if sizes is None else sizes)
    start = timing.cpu_time()
    # per fold: its evaluator (the fold's corrupted run, taken once) and the circuits measured
    evaluators = [
        FaithfulnessEvaluator(
            model, fold.clean, fold.corrupted, fold.metric, batch_size=batch_size,
            ablation=cast("Ablation", ablation),
        )
        for fold in folds
    ]  # fmt: skip
    measured: list[dict[bytes, float]] = [{} for _ in folds]

    def fold_cmd(i: int, candidate: float) -> float:
        chosen = ChosenCircuits(scale_negatives(folds[i].scores, candidate), "top", own_copies and units == "ungrouped")  # fmt: skip
        values = []
        for circuit in chosen.at(fractions, absolute=True, units=units):
            key = circuit.copies.numpy().tobytes()
            if key not in measured[i]:
                measured[i][key] = float(evaluators[i](circuit).value)
            values.append(measured[i][key])
        return trapezoid_auc(fractions, [abs(1.0 - v) for v in values])

    tried: list[float] = []
    per_fold: list[list[float]] = [[] for _ in folds]
    cmds: list[float] = []
    for c in tqdm([float(c) for c in candidates], desc="negative scale", disable=not progress):
        for i in range(len(folds)):
            per_fold[i].append(fold_cmd(i, c))
        tried.append(c)
        cmds.append(sum(f[-1] for f in per_fold) / len(folds))
        if stop_when_worse and len(cmds) > 1 and cmds[-1] > cmds[-2]:
            break
    best = tried[cmds.index(min(cmds))]  # the first of equal minima
    seconds = timing.cpu_time() - start
    return NegativeScale(best, tried, cmds, scale_negatives(scores, best), seconds=seconds, fold_cmds=per_fold)  # fmt: skip
