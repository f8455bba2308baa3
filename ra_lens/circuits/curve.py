"""Faithfulness of circuits of increasing size, with MIB's CPR and CMD, computed as MIB does.

MIB's circuit track (arXiv 2504.13151; hannamw/MIB-circuit-track: `replicate.sh` runs
`run_evaluation.py` twice per task, with and without `--absolute`; `evaluate_area_under_curve` in
`MIB_circuit_track/evaluation.py`; `print_results.py` reports CPR from the run without
`--absolute` and CMD from the run with it). `faithfulness_curve` does both runs:

- sizes: for each fraction k (default 0.001 .. 1), a circuit of int(k * N) edges (rounded down,
  before pruning), N the edges of EAP-IG's UNGROUPED graph (MIB's `len(graph.edges)`: a grouped
  key/value edge counts once per query head of its group; `units="grouped"` counts this graph's
  edges instead). See `EdgeScores.top` for how a grouped key/value edge enters an ungrouped
  ranking (each query head's copy at an equal share of its score; kept when all copies fit).
- two rankings: the SIGNED ranking (the largest scores: edges that help the metric, with
  absolute=False) gives the curve whose area is CPR; the |score| ranking gives the curve whose
  area from 1 is CMD.
- faithfulness f = (m(circuit) - m(empty)) / (m(clean) - m(empty)), the empty circuit under the
  same ablation (`circuits.faithfulness`).
- areas: trapezoids over k itself (not log k, no renormalisation):

    CPR = sum_i (k[i+1] - k[i]) * (f_signed[i] + f_signed[i+1]) / 2              (higher: better)
    CMD = sum_i (k[i+1] - k[i]) * (|1 - f_abs[i]| + |1 - f_abs[i+1]|) / 2        (lower: better)

With the default fractions a perfect curve (f = 1 everywhere) has CPR 0.999, CMD 0; CPR can
exceed 1 (a signed circuit keeps the edges that help and patches those that hurt).

    >>> curve = FaithfulnessCurve(sizes=[0.1, 0.5, 1.0], n_total=82,
    ...                           signed_values=[0.5, 1.5, 1.0], signed_n_edges=[8, 41, 82],
    ...                           abs_values=[0.2, 0.6, 1.0], abs_n_edges=[8, 41, 82])
    >>> round(curve.cpr, 6), round(curve.cmd, 6)  # 0.4*1.0 + 0.5*1.25; 0.4*0.6 + 0.5*0.2
    (1.025, 0.34)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from ra_lens._typing import Validated
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.faithfulness import BASELINE
from ra_lens.circuits.graph import UNITS, Graph, Units
from ra_lens.circuits.mib import MIB_FRACTIONS, ChosenCircuits, check_fractions, chosen_for
from ra_lens.circuits.mib import mib_circuits as mib_circuits
from ra_lens.circuits.scores import EdgeScores
from ra_lens.math import trapezoid_auc
from ra_lens.progress import tqdm
from ra_lens.types import HookedModel, MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ra_lens.circuits.faithfulness import Ablation


@dataclass(frozen=True)
class FaithfulnessCurve:
    """Faithfulness of circuits of increasing size, from both rankings (module docstring).

    Attributes:
        sizes: fractions k of the graph's edges asked for, increasing.
        n_total: edges in the graph, in `units` (MIB's N).
        signed_values: faithfulness of the circuit of int(k * n_total) edges with the largest
            score (signed ranking), per size: the curve of CPR.
        signed_n_edges: edges in those circuits after pruning, in `units`.
        abs_values: faithfulness of the circuits by |score|, per size: the curve of CMD.
        abs_n_edges: edges in those circuits after pruning, in `units`.
        units: "ungrouped" (MIB's count) or "grouped" (this graph's edges).
        method, selection, ablation: how the circuits were chosen and measured.
        own_copies: per-copy circuits (each query head's copy of a key/value edge chosen and
            patched on its own, `EdgeScores.top(own_copies=True)`) instead of grouped ones.
        baseline: what faithfulness is normalised by (the empty circuit under `ablation`).
        seconds: time spent measuring each size (both rankings).
    """

    sizes: list[float]
    n_total: int
    signed_values: list[float]
    signed_n_edges: list[int]
    abs_values: list[float]
    abs_n_edges: list[int]
    units: Validated[Units] = "ungrouped"  # checked in __post_init__
    method: str = ""
    selection: str = "top"
    ablation: str = "patching"
    baseline: str = BASELINE
    seconds: list[float] = field(default_factory=list)
    own_copies: bool = False

    def __post_init__(self) -> None:
        lengths = {
            len(x)
            for x in (
                self.sizes,
                self.signed_values,
                self.signed_n_edges,
                self.abs_values,
                self.abs_n_edges,
            )
        }
        if len(lengths) != 1:
            raise ValueError(
                f"{len(self.sizes)} sizes, {len(self.signed_values)}/{len(self.abs_values)} "
                f"values and {len(self.signed_n_edges)}/{len(self.abs_n_edges)} edge counts "
                "(signed/abs): one of each per circuit"
            )
        if self.units not in UNITS:
            raise ValueError(f"units={self.units!r}: expected one of {UNITS}")
        # a NaN would be saved as bare NaN (which load refuses) and break the page's script
        for name in ("sizes", "signed_values", "abs_values"):
            for i, v in enumerate(getattr(self, name)):
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(
                        f"{name}[{i}] is {v!r}: a faithfulness curve holds finite numbers (a "
                        "NaN usually comes from a custom evaluate or a metric that overflowed)"
                    )

    @property
    def cpr(self) -> float:
        """MIB's CPR: the trapezoid area under the signed ranking's faithfulness over k."""
        return trapezoid_auc(self.sizes, self.signed_values)

    @property
    def cmd(self) -> float:
        """MIB's CMD: the trapezoid area of |1 - f| over k, f from the |score| ranking."""
        return trapezoid_auc(self.sizes, [abs(1.0 - v) for v in self.abs_values])

    def smallest(
        self, faithfulness: float, ranking: Literal["abs", "signed"] = "abs"
    ) -> int | None:
        """The fewest edges (asked, int(k * n_total), in `units`) among this curve's points whose
        faithfulness reaches `faithfulness`, by the |score| ("abs") or signed ranking; None when
        no point reaches it. `circuits.smallest_circuit` narrows it between the points.

        >>> FaithfulnessCurve(sizes=[0.1, 0.5, 1.0], n_total=82, signed_values=[0.5, 1.5, 1.0],
        ...     signed_n_edges=[8, 41, 82], abs_values=[0.2, 0.6, 1.0],
        ...     abs_n_edges=[8, 41, 82]).smallest(0.8)
        82
        """
        values = self.abs_values if ranking == "abs" else self.signed_values
        for k, value in zip(self.sizes, values):
            if value >= faithfulness:
                return int(k * self.n_total)
        return None

    def to_dict(self) -> dict[str, Any]:
        """The curves and their areas as plain JSON-ready values."""
        return {**asdict(self), "cpr": self.cpr, "cmd": self.cmd}

    def table(self) -> str:
        """A Markdown table: one row per size, both rankings, then CPR and CMD."""
        rows = [
            "| % of edges | edges kept, signed | f, signed | edges kept, abs | f, abs |",
            "|---:|---:|---:|---:|---:|",
        ]
        for k, ns, vs, na, va in zip(
            self.sizes, self.signed_n_edges, self.signed_values, self.abs_n_edges, self.abs_values
        ):
            rows.append(f"| {100 * k:g} | {ns} | {vs:.4f} | {na} | {va:.4f} |")
        rows.append(
            f"\n{self.units} edges, {self.n_total} in all"
            f"{' (each key/value copy on its own)' if self.own_copies else ''}; "
            f"ablation {self.ablation}; "
            f"faithfulness normalised by the {self.baseline}\nCPR {self.cpr:.4f} (signed "
            f"ranking, higher is better), CMD {self.cmd:.4f} (|score| ranking, lower is better)"
        )
        return "\n".join(rows)

    def plot(
        self,
        save: str | Path | None = None,
        *,
        ax: Axes | None = None,
        label: str | None = None,
    ) -> Figure:
        """Faithfulness against the share of edges kept (log x), the signed ranking (solid, CPR)
        and the |score| ranking (dashed, CMD), on a new figure or, to compare methods, on `ax`
        (two lines per call); `save` also writes the figure (png, pdf, svg). Returns the figure."""
        if ax is None:
            from matplotlib.figure import Figure

            ax = Figure(figsize=(5, 3.5), layout="constrained").add_subplot()
        text = label if label is not None else (self.method or "circuit")
        x = [100 * k for k in self.sizes]
        (line,) = ax.plot(x, self.signed_values, marker="o", label=f"{text}, signed (CPR {self.cpr:.3f})")  # fmt: skip
        ax.plot(
            x,
            self.abs_values,
            marker="s",
            ls="--",
            color=line.get_color(),
            label=f"{text}, |score| (CMD {self.cmd:.3f})",
        )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"edges kept (% of {self.n_total} {self.units})")
        ax.set_ylabel("faithfulness")
        ax.legend(fontsize=8)
        from ra_lens.viz import save_figure

        return save_figure(cast("Figure", ax.figure), save)  # a Figure's axes (not a SubFigure's)

    def save(self, path: str | Path) -> None:
        """Write `to_dict()` as JSON with `ra_lens.files.write_file` (atomic, through symlinks).

        >>> import tempfile
        >>> curve = FaithfulnessCurve([0.5, 1.0], 10, [0.2, 1.0], [5, 10], [0.4, 1.0], [5, 10])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     curve.save(f"{folder}/curve.json")
        ...     back = FaithfulnessCurve.load(f"{folder}/curve.json")
        >>> back == curve, round(back.cpr, 6)
        (True, 0.3)
        """
        from ra_lens.files import write_file

        write_file(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FaithfulnessCurve:
        """Read a file written by `save`; other and damaged files (missing fields, CPR or CMD
        that do not follow from the curves) are refused with one ValueError naming the file."""
        from ra_lens.files import load_json

        what = "a faithfulness curve (FaithfulnessCurve.save)"
        data = load_json(path, what)
        try:
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            stored = {key: data.pop(key) for key in ("cpr", "cmd")}
            curve = cls(**data)
            for key, value in stored.items():
                if not math.isclose(getattr(curve, key), value, rel_tol=1e-9, abs_tol=1e-12):
                    raise ValueError(f"{key} {value} but the curves give {getattr(curve, key)}")
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path} is not {what}: {error}") from None
        return curve


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
    units: Validated[Units] = "ungrouped",
    batch_size: int = 32,
    progress: bool = False,
    evaluate: Callable[..., Any] | None = None,
    chosen: ChosenCircuits | None = None,
    own_copies: bool = False,
) -> FaithfulnessCurve:
    """Faithfulness of the circuits `scores` picks at each size, by both rankings, as MIB
    measures them (module docstring).

    Args:
        model: the TransformerLens model the scores are for.
        scores: `EdgeScores` over `Graph.from_model(model)`.
        clean, corrupted, metric: the pairs and the metric (see `circuits.faithfulness`).
        sizes: fractions of the graph's edges, increasing, in (0, 1]; default MIB's 0.1 % ..
            100 % (`MIB_FRACTIONS`).
        ablation: "patching", "mean" or "zero" (what a patched edge's writer output becomes).
        selection: "top" (EAP-IG's apply_topn) or "greedy" (apply_greedy).
        units: "ungrouped" (default, MIB's count on grouped-query models) or "grouped".
        batch_size: pairs per forward pass of every faithfulness pass.
        evaluate: instead of the default `circuits.FaithfulnessEvaluator` (which takes the
            clean, corrupted and empty-circuit runs once), `evaluate(model, circuit, clean,
            corrupted, metric, ablation=ablation)` returning a result with `.value` or a float.
        chosen: circuits already chosen from these scores by `selection` (`mib.ChosenCircuits`):
            the curve takes them and keeps those it chooses, for the page and the export.
        own_copies: in ungrouped units, choose each query head's copy of a key/value edge by
            its own score and keep it on its own (`EdgeScores.top(own_copies=True)`): per-copy
            circuits, patched copy by copy as EAP-IG's evaluator patches them.

    Returns:
        FaithfulnessCurve with `.cpr` (signed ranking) and `.cmd` (|score| ranking). A circuit
        that two sizes or both rankings share is measured once.
    """
    graph = Graph.from_model(model)
    if graph != scores.graph:
        raise ValueError(f"the scores are for {scores.graph}, the model has {graph}")
    if selection not in ("top", "greedy"):
        raise ValueError(f"selection={selection!r}: expected 'top' or 'greedy'")
    if units not in UNITS:
        raise ValueError(f"units={units!r}: expected one of {UNITS}")
    if own_copies and units != "ungrouped":
        raise ValueError("own_copies=True chooses key/value copies, which only ungrouped units count: pass units='ungrouped'")  # fmt: skip
    from ra_lens.timing import timed

    fractions = check_fractions(MIB_FRACTIONS if sizes is None else sizes)
    if evaluate is None:  # one evaluator: the clean, corrupted and empty runs are taken once
        from ra_lens.circuits.faithfulness import FaithfulnessEvaluator

        evaluator = FaithfulnessEvaluator(
            model, clean, corrupted, metric, batch_size=batch_size,
            ablation=cast("Ablation", ablation),  # the evaluator checks it
        )  # fmt: skip

        def evaluate(model: HookedModel, circuit: Circuit, *args: Any, **kwargs: Any) -> Any:
            return evaluator(circuit)

    chosen = chosen_for(scores, chosen, selection, own_copies)
    signed = chosen.at(fractions, absolute=False, units=units)
    by_abs = chosen.at(fractions, absolute=True, units=units)
    done: dict[bytes, float] = {}
    seconds = []
    for pair in tqdm(list(zip(signed, by_abs)), desc="faithfulness curve", disable=not progress):
        span: dict[str, float] = {}
        with timed(span, "size"):
            for circuit in pair:
                key = _key(circuit)
                if key not in done:
                    result = evaluate(model, circuit, clean, corrupted, metric, ablation=ablation)
                    done[key] = float(getattr(result, "value", result))
                    if not math.isfinite(done[key]):
                        raise ValueError(
                            f"evaluate ({evaluate!r}) returned {done[key]} for the circuit "
                            f"of {circuit.count(units)} {units} edges: faithfulness must be a "
                            "finite number; check the evaluator or the metric"
                        )
        seconds.append(span["size"])

    def value(circuit: Circuit) -> float:
        return done[_key(circuit)]

    return FaithfulnessCurve(
        sizes=fractions,
        n_total=graph.count(units),
        signed_values=[value(c) for c in signed],
        signed_n_edges=[c.count(units) for c in signed],
        abs_values=[value(c) for c in by_abs],
        abs_n_edges=[c.count(units) for c in by_abs],
        units=units,
        method=scores.method,
        selection=selection,
        ablation=ablation,
        seconds=seconds,
        own_copies=chosen.own_copies,
    )


def _key(circuit: Circuit) -> bytes:
    """What tells two circuits apart: their edges, and each key/value copy of a per-copy one."""
    copies = circuit.ungrouped_edges
    return circuit.edges.numpy().tobytes() + (b"" if copies is None else copies.numpy().tobytes())
