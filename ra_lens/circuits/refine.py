"""Refinement: spend a fixed number of faithfulness evaluations (on training pairs) correcting the
scores of the nodes that matter most.

The edge scores rank the edges; a circuit of n edges is the top n, pruned (`EdgeScores.top`).
`refine` keeps one multiplier per writer node (head, MLP; 1 to start) and scores every edge by
its score times the multipliers of the writers it touches: its own writer, and the writer that
owns its reader (an edge into `a3.h2<q>` touches `a3.h2`). A multiplier of 0 takes the node out
of every circuit ("prune": its outgoing edges and the edges into its readers drop to the bottom
of the |score| ranking, so the edge budget goes to other edges instead of edges that pruning would
cut); `boost` > 1 moves its edges up ("add").

Greedy search over the `candidates` writers with the largest node score (sum of |score| of their
outgoing edges): for each in turn, try 0, then `boost`; keep the first that raises the objective
on the evaluator's pairs, measured at `fractions` of the ungrouped edges:

    absolute=False (the signed ranking, CPR's):  objective = mean over fractions of f
    absolute=True  (the |score| ranking, CMD's):  objective = -mean over fractions of |1 - f|

It stops when `budget` evaluations (one circuit's faithfulness each; one per fraction per trial)
are spent, or the optional CPU-time budget `budget_s`. The objective never decreases (a change is
kept only when it raises it). The evaluator's pairs must be training pairs: judge the refined
scores on others (`faithfulness_curve` on held-out pairs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.checks import check_count
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.scores import EdgeScores
from ra_lens.record import Recorded
from ra_lens.timing import cpu_time, now

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: An evaluator: a circuit -> its faithfulness (a result with `.value`, or a float).
Evaluate = Callable[[Circuit], Any]


@dataclass
class Step:
    """One trial: writer `node` given `multiplier`; `objective` measured; `kept` or undone."""

    node: str
    multiplier: float
    objective: float
    kept: bool


@dataclass
class Refinement(Recorded):
    """The result of `refine`.

    Attributes:
        scores: the refined EdgeScores (MIB's sign, direction "denoise"; method
            "refined(<method>)"), for `faithfulness_curve` on held-out pairs.
        multipliers: Float[Tensor, "writer"], one per writer (1: untouched, 0: pruned).
        start_objective, objective: the objective before and after (on the evaluator's pairs).
        evaluations: faithfulness evaluations spent (<= budget).
        steps: every trial, in order.
        seconds: process CPU time spent.
    """

    scores: EdgeScores
    multipliers: Float[Tensor, " writer"]
    start_objective: float
    objective: float
    evaluations: int
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the objectives, the budget spent, every trial and the nodes moved (the
        refined scores themselves go to `save`, or `scores.save`)."""
        g = self.scores.graph
        moved = {g.writers[i]: float(m) for i, m in enumerate(self.multipliers.tolist()) if m != 1}
        return {
            "method": self.scores.method,
            "start_objective": self.start_objective,
            "objective": self.objective,
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "multipliers": moved,
            "steps": [dataclasses.asdict(step) for step in self.steps],
        }

    def table(self) -> str:
        """A Markdown table: one row per trial (node, multiplier, objective, kept)."""
        rows = [
            f"refine: objective {self.start_objective:.4f} -> {self.objective:.4f} in "
            f"{self.evaluations} evaluations",
            "",
            "| trial | node | multiplier | objective | kept |",
            "|---:|---|---:|---:|---|",
        ]
        for i, s in enumerate(self.steps, 1):
            rows.append(f"| {i} | {s.node} | {s.multiplier:g} | {s.objective:.4f} | {s.kept} |")
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Each trial's objective as a bar (kept trials coloured); `save` also writes it."""
        from ra_lens.viz import named_bars

        return named_bars(
            [f"{s.node} x{s.multiplier:g}" for s in self.steps], [s.objective for s in self.steps],
            kept=[s.kept for s in self.steps], xlabel="objective",
            title=f"refine: {self.start_objective:.3f} -> {self.objective:.3f}", save=save,
        )  # fmt: skip


def refine(
    scores: Validated[EdgeScores],
    evaluate: Evaluate,
    *,
    fractions: Validated[Sequence[float]] = (0.1,),
    absolute: bool = False,
    candidates: int = 16,
    boost: float = 4.0,
    budget: int = 32,
    budget_s: float | None = None,
    clock: Callable[[], float] = cpu_time,
) -> Refinement:
    """Greedy node refinement of edge scores within a budget of evaluations (module docstring).

    Args:
        scores: EdgeScores to refine (either direction; the result is in MIB's sign).
        evaluate: a `FaithfulnessEvaluator` on TRAINING pairs, or any circuit -> result with
            `.value` (or a float).
        fractions: sizes the objective is measured at, fractions of the ungrouped edges in
            (0, 1].
        absolute: optimise the |score| ranking (CMD's) instead of the signed one (CPR's).
        candidates: writers tried, by node score, largest first.
        boost: the "add" multiplier (> 1).
        budget: the most evaluations to spend (one per fraction per trial, the start included).
        budget_s: also stop before a trial once this much `clock` time is spent (None: no limit).
        clock: the clock budget_s is read on (process CPU time, `timing.cpu_time`), through
            `timing.now` (queued CUDA work finished first).

    Returns:
        Refinement (`.scores`, `.objective`, `.evaluations`, `.steps`).

    Raises:
        ValueError: fractions outside (0, 1] or so small that int(k * N) is 0 edges,
            candidates < 0, boost <= 1, a budget too small for the starting point (fewer
            evaluations than fractions), an evaluator returning a non-finite value (at once).
    """
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores is a {type(scores).__name__}: pass EdgeScores")
    sizes = [float(k) for k in fractions]
    if not sizes or any(not 0 < k <= 1 for k in sizes):
        raise ValueError(f"fractions={list(fractions)!r}: pass fractions of the edges in (0, 1]")
    check_count(candidates, "candidates", minimum=0)
    if not math.isfinite(boost) or boost <= 1:
        raise ValueError(f"boost={boost!r}: pass a number > 1 (the 'add' multiplier)")
    check_count(budget, "budget", len(sizes), why="the starting point takes one per fraction")
    start_time = now(clock)
    g = scores.graph
    objective = _Objective(scores, evaluate, _edge_counts(g, sizes, fractions), absolute)
    multipliers = torch.ones(len(g.writers), dtype=torch.float64)
    best = objective(multipliers)
    start = best
    node_score = objective.helps.abs().sum(1)
    node_score[g.writer_index["input"]] = -1.0  # input is every circuit's source: never moved
    order = torch.argsort(node_score, descending=True, stable=True)[: min(candidates, len(g.writers) - 1)]  # fmt: skip
    steps: list[Step] = []

    def can_try() -> bool:
        out_of_time = budget_s is not None and now(clock) - start_time >= budget_s
        return objective.spent + len(objective.counts) <= budget and not out_of_time

    trials = [(w, factor) for w in order.tolist() for factor in (0.0, boost)]
    settled: set[int] = set()  # writers whose multiplier changed: their other trial is skipped
    for w, factor in trials:
        if w in settled:
            continue
        if not can_try():
            break
        trial = multipliers.clone()
        trial[w] = factor
        value = objective(trial)
        kept = value > best
        steps.append(Step(g.writers[w], factor, value, kept))
        if kept:
            multipliers, best = trial, value
            settled.add(w)
    return Refinement(
        scores=objective.rescored(multipliers),
        multipliers=multipliers,
        start_objective=start,
        objective=best,
        evaluations=objective.spent,
        steps=steps,
        seconds=now(clock) - start_time,
    )


def _edge_counts(g: Graph, sizes: list[float], fractions: Sequence[float]) -> list[int]:
    """int(k * N) ungrouped edges for each fraction k; a ValueError where that is 0 edges."""
    counts = [int(k * g.n_edges_ungrouped) for k in sizes]
    if 0 in counts:
        k = sizes[counts.index(0)]
        raise ValueError(
            f"fractions={list(fractions)!r}: {k:g} of this graph's {g.n_edges_ungrouped} "
            "(ungrouped) edges is int(k * N) = 0 edges, an empty circuit whatever the scores; "
            f"pass fractions >= {1 / g.n_edges_ungrouped:.3g}"
        )
    return counts


class _Objective:
    """The refinement's objective for a set of writer multipliers, counting the evaluations spent:
    the mean faithfulness over the edge counts (signed ranking) or minus the mean |1 - f|
    (absolute=True, the |score| ranking)."""

    def __init__(
        self, scores: EdgeScores, evaluate: Evaluate, counts: list[int], absolute: bool
    ) -> None:
        self.scores, self.evaluate, self.counts, self.absolute = scores, evaluate, counts, absolute
        self.helps = scores.helps * scores.graph.real
        self.owner = scores.graph.reader_owners.to(torch.float64)  # [reader, writer]
        self.spent = 0

    def rescored(self, multipliers: Float[Tensor, " writer"]) -> EdgeScores:
        """Every edge's score (MIB's sign) times its writer's multiplier and its reader's."""
        # a reader's factor: the mean multiplier of the writers owning it (the query heads
        # sharing a key/value head; none for logits: 1)
        n_owners = self.owner.sum(1)
        reader_factor = torch.where(
            n_owners > 0,
            (self.owner @ multipliers) / n_owners.clamp_min(1),
            torch.ones_like(n_owners),
        )
        values = self.helps * multipliers[:, None] * reader_factor[None, :]
        return EdgeScores(self.scores.graph, values, f"refined({self.scores.method})", "denoise")

    def __call__(self, multipliers: Float[Tensor, " writer"]) -> float:
        current = self.rescored(multipliers)
        values = []
        for n in self.counts:
            result = self.evaluate(current.top(n, absolute=self.absolute, units="ungrouped"))
            self.spent += 1
            # typeshed's getattr overloads take an Any default for None (so: Any | None)
            value = float(getattr(result, "value", result))  # type: ignore[arg-type]
            if not math.isfinite(value):
                # one NaN would make every later comparison False and the budget be spent
                raise ValueError(
                    f"evaluate ({self.evaluate!r}) returned {value} for the circuit of {n} edges: "
                    "refine needs a finite faithfulness; check the evaluator (a custom metric "
                    "or an overflow in float16 gives NaN)"
                )
            values.append(value)
        if self.absolute:
            return -sum(abs(1.0 - v) for v in values) / len(values)
        return sum(values) / len(values)
