"""The smallest circuit reaching a faithfulness: the first size of a faithfulness curve at or
above the target brackets it with the size before; a bisection between the two (a few more
faithfulness passes) narrows it to one edge, in MIB's ungrouped count by default.

Faithfulness need not grow with size, so this is the smallest size at or above the target found
by the curve's points and the bisection between the first bracketing pair, not a guarantee that
no smaller circuit elsewhere reaches it. A target no point of the curve reaches is reported as
such (`reached` False) with the most faithful circuit measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.curve import FaithfulnessCurve
from ra_lens.circuits.mib import ChosenCircuits, chosen_for
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import HookedModel, MetricFn, Tokens


@dataclass(frozen=True)
class SmallestCircuit:
    """The result of `smallest_circuit`.

    Attributes:
        circuit: the circuit found (pruned), or with `reached` False the most faithful measured.
        faithfulness: its measured faithfulness.
        n_edges: its edges in `units` after pruning (`circuit.count(units)`).
        target: the faithfulness asked for.
        reached: whether `faithfulness >= target`.
        units, ranking: how edges were counted and ranked ("abs": |score|, "signed": MIB's sign).
        measured: every (edges asked, faithfulness) this search used, curve points included.
    """

    circuit: Circuit
    faithfulness: float
    n_edges: int
    target: float
    reached: bool
    units: str
    ranking: str
    measured: list[tuple[int, float]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the size, the faithfulness and whether the target was reached."""
        if self.reached:
            return (
                f"smallest circuit reaching faithfulness {self.target:g} ({self.ranking} "
                f"ranking): {self.n_edges} {self.units} edges, faithfulness {self.faithfulness:.4f}"
            )
        return (
            f"no circuit measured reaches faithfulness {self.target:g} ({self.ranking} ranking); "
            f"the most faithful: {self.n_edges} {self.units} edges, faithfulness "
            f"{self.faithfulness:.4f}"
        )


def smallest_circuit(
    model: HookedModel,
    scores: EdgeScores,
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    curve: FaithfulnessCurve,
    faithfulness: float = 0.8,
    *,
    ranking: Literal["abs", "signed"] = "abs",
    batch_size: int = 32,
    max_evaluations: int = 12,
    chosen: ChosenCircuits | None = None,
) -> SmallestCircuit:
    """The smallest circuit of `scores`'s ranking whose faithfulness reaches `faithfulness`.

    Args:
        model, scores, clean, corrupted, metric: as for `circuits.faithfulness_curve`.
        curve: that curve, for these scores; its units, selection and ablation are used.
        faithfulness: the target, e.g. 0.8.
        ranking: "abs" (the |score| ranking, CMD's curve) or "signed" (CPR's).
        batch_size: pairs per forward pass.
        max_evaluations: faithfulness passes the bisection may add (each a pass over the pairs).
        chosen: the circuits the curve chose (`mib.ChosenCircuits`), taken instead of choosing
            them again.

    Returns:
        SmallestCircuit (module docstring: `reached` False when no point of the curve reaches
        the target; then the most faithful circuit of the curve).
    """
    from ra_lens.circuits.faithfulness import Ablation, FaithfulnessEvaluator

    if ranking not in ("abs", "signed"):
        raise ValueError(f"ranking={ranking!r}: expected 'abs' or 'signed'")
    if not 0 < faithfulness < float("inf"):
        raise ValueError(f"faithfulness={faithfulness!r}: expected a positive number such as 0.8")
    kept = chosen_for(scores, chosen, curve.selection)  # the curve's circuits, not chosen again
    units: Any = curve.units

    def circuit(n: int) -> Circuit:
        return kept.pick(n, absolute=ranking == "abs", units=units)

    values = curve.abs_values if ranking == "abs" else curve.signed_values
    asked = [int(k * curve.n_total) for k in curve.sizes]
    measured = list(zip(asked, values))
    first = next((i for i, v in enumerate(values) if v >= faithfulness), None)
    if first is None:
        best = max(range(len(values)), key=lambda i: values[i])
        found = circuit(asked[best])
        return SmallestCircuit(
            found, values[best], found.count(units), faithfulness, False, units, ranking, measured
        )
    evaluate = FaithfulnessEvaluator(
        model,
        clean,
        corrupted,
        metric,
        ablation=cast(Ablation, curve.ablation),
        batch_size=batch_size,
    )
    low = asked[first - 1] if first > 0 else 0  # below the target (or nothing)
    high, value = asked[first], values[first]  # at or above it
    for _ in range(max_evaluations):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        reached = evaluate(circuit(middle)).value
        measured.append((middle, reached))
        if reached >= faithfulness:
            high, value = middle, reached
        else:
            low = middle
    found = circuit(high)
    return SmallestCircuit(
        found, value, found.count(units), faithfulness, True, units, ranking, measured
    )
