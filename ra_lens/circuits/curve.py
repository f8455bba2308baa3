"""Faithfulness of circuits of increasing size, with MIB's CPR and CMD.

`faithfulness_curve` picks circuits of increasing size from edge scores (`EdgeScores.top` or
`.greedy`, each pruned), measures each with `circuits.faithfulness`, and reports the curve. As in
MIB's circuit track (arXiv 2504.13151; `evaluate_area_under_curve` in hannamw/MIB-circuit-track),
a size is a fraction k of the graph's edges (the circuit asks for int(k * n_edges) edges before
pruning), and the areas are trapezoids over k itself (not log k, no renormalisation):

    CPR = sum_i (k[i+1] - k[i]) * (f[i] + f[i+1]) / 2                 (higher is better)
    CMD = sum_i (k[i+1] - k[i]) * (|1 - f[i]| + |1 - f[i+1]|) / 2     (lower is better)

With the default fractions 0.001 .. 1 a perfect curve (f = 1 everywhere) has CPR 0.999, CMD 0.

    >>> curve = FaithfulnessCurve(sizes=[0.1, 0.5, 1.0], n_edges=[8, 41, 82],
    ...                           values=[0.2, 0.6, 1.0], n_total=82)
    >>> round(curve.cpr, 6), round(curve.cmd, 6)  # 0.4*0.4 + 0.5*0.8; 0.4*0.6 + 0.5*0.2
    (0.56, 0.34)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm.auto import tqdm

from ra_lens._typing import Validated
from ra_lens.circuits.circuit import Circuit, EdgeScores
from ra_lens.circuits.graph import Graph
from ra_lens.ranking import trapezoid_auc
from ra_lens.types import HookedModel, MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: MIB's circuit sizes: 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50 and 100 % of the graph's edges.
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class FaithfulnessCurve:
    """Faithfulness of circuits of increasing size.

    Attributes:
        sizes: fractions k of the graph's edges asked for, increasing.
        n_edges: edges in each circuit after pruning (at most int(k * n_total)).
        values: faithfulness of each circuit, (m(circuit) - m(corrupted)) / (m(clean) -
            m(corrupted)).
        n_total: edges in the graph.
        method, selection, ablation: how the circuits were chosen and measured.
    """

    sizes: list[float]
    n_edges: list[int]
    values: list[float]
    n_total: int
    method: str = ""
    selection: str = "top"
    ablation: str = "patching"
    seconds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.sizes) == len(self.n_edges) == len(self.values):
            raise ValueError(
                f"{len(self.sizes)} sizes, {len(self.n_edges)} edge counts and "
                f"{len(self.values)} values: one of each per circuit"
            )

    @property
    def cpr(self) -> float:
        """Area under the faithfulness curve over the fraction of edges (MIB's CPR)."""
        return trapezoid_auc(self.sizes, self.values)

    @property
    def cmd(self) -> float:
        """Area between the curve and 1, |1 - f| by trapezoids over the fraction of edges (MIB's
        CMD)."""
        return trapezoid_auc(self.sizes, [abs(1.0 - v) for v in self.values])

    def to_dict(self) -> dict[str, Any]:
        """The curve and its areas as plain JSON-ready values."""
        return {**asdict(self), "cpr": self.cpr, "cmd": self.cmd}

    def table(self) -> str:
        """A Markdown table: one row per circuit, then CPR and CMD."""
        rows = ["| % of edges | edges kept | faithfulness |", "|---:|---:|---:|"]
        for k, n, v in zip(self.sizes, self.n_edges, self.values):
            rows.append(f"| {100 * k:g} | {n} | {v:.4f} |")
        rows.append(
            f"\nCPR {self.cpr:.4f} (higher is better), CMD {self.cmd:.4f} (lower is better)"
        )
        return "\n".join(rows)

    def plot(
        self,
        save: str | Path | None = None,
        *,
        ax: Axes | None = None,
        label: str | None = None,
    ) -> Figure:
        """Faithfulness against the share of edges kept (log x), on a new figure or, to compare
        methods, on `ax` (one line per call); `save` also writes the figure (png, pdf, svg).
        Returns the figure."""
        if ax is None:
            from matplotlib.figure import Figure

            ax = Figure(figsize=(5, 3.5), layout="constrained").add_subplot()
        text = label if label is not None else (self.method or "circuit")
        ax.plot(
            [100 * k for k in self.sizes],
            self.values,
            marker="o",
            label=f"{text} (CPR {self.cpr:.3f}, CMD {self.cmd:.3f})",
        )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"edges kept (% of {self.n_total})")
        ax.set_ylabel("faithfulness")
        ax.legend(fontsize=8)
        from ra_lens.viz import save_figure

        return save_figure(ax.figure, save)


def faithfulness_curve(
    model: HookedModel,
    scores: EdgeScores,
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    sizes: Validated[Sequence[float]] | None = None,
    ablation: str = "patching",
    selection: Literal["top", "greedy"] = "top",
    progress: bool = False,
    evaluate: Callable[..., Any] | None = None,
) -> FaithfulnessCurve:
    """Faithfulness of the circuits `scores` picks at each size (fractions of the graph's edges,
    increasing; default MIB's 0.1 % .. 100 %), by `EdgeScores.top` or `.greedy`.

    Each circuit is measured by `evaluate(model, circuit, clean, corrupted, metric,
    ablation=ablation)` (default: one `circuits.FaithfulnessEvaluator`, which takes the clean and
    corrupted runs once), whose result has a `.value`; sizes that give the same circuit are measured once.
    """
    graph = Graph.from_model(model)
    if graph != scores.graph:
        raise ValueError(f"the scores are for {scores.graph}, the model has {graph}")
    if selection not in ("top", "greedy"):
        raise ValueError(f"selection={selection!r}: expected 'top' or 'greedy'")
    fractions = _check_sizes(MIB_FRACTIONS if sizes is None else sizes)
    if evaluate is None:  # one evaluator: the clean and corrupted runs are taken once
        from ra_lens.circuits.faithfulness import FaithfulnessEvaluator

        evaluator = FaithfulnessEvaluator(model, clean, corrupted, metric, ablation=ablation)

        def evaluate(model: HookedModel, circuit: Circuit, *args: Any, **kwargs: Any) -> Any:
            return evaluator(circuit)

    n_edges, values, seconds = [], [], []
    done: dict[bytes, float] = {}
    for k in tqdm(fractions, desc="faithfulness curve", disable=not progress):
        n = int(k * graph.n_edges)  # as MIB: the fraction of edges, rounded down
        circuit = scores.top(n) if selection == "top" else scores.greedy(n)
        key = circuit.edges.numpy().tobytes()
        start = time.perf_counter()
        if key not in done:
            result = evaluate(model, circuit, clean, corrupted, metric, ablation=ablation)
            done[key] = float(getattr(result, "value", result))
        n_edges.append(circuit.n_edges)
        values.append(done[key])
        seconds.append(time.perf_counter() - start)
    return FaithfulnessCurve(
        sizes=fractions,
        n_edges=n_edges,
        values=values,
        n_total=graph.n_edges,
        method=scores.method,
        selection=selection,
        ablation=ablation,
        seconds=seconds,
    )


def _check_sizes(sizes: Sequence[float]) -> list[float]:
    try:
        fractions = [float(k) for k in sizes]
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"sizes must be fractions of the edges, e.g. [0.01, 0.1, 1]: {err}"
        ) from err
    if not fractions or any(not 0 < k <= 1 for k in fractions):
        raise ValueError(
            f"sizes={list(sizes)!r}: pass fractions of the graph's edges in (0, 1], e.g. "
            "[0.01, 0.1, 1] (not percentages, not edge counts)"
        )
    if any(b <= a for a, b in zip(fractions, fractions[1:])):
        raise ValueError(f"sizes={fractions}: list them in increasing order, without repeats")
    return fractions
