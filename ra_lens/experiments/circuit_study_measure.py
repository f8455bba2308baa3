"""The circuit study's measurements: each chosen circuit's metric per pair by edge patching on
the held-out pairs (`Measured`: one `circuits.FaithfulnessEvaluator` per ablation, each circuit run
once however many methods choose it, the empty circuit's run giving the reference metrics), and
one method's circuits at every size, from both rankings, measured (`measure_method`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ra_lens import circuits, timing
from ra_lens.tasks import ioi
from ra_lens.tasks.ioi import PromptPair
from ra_lens.types import HookedModel

if TYPE_CHECKING:
    from ra_lens.circuits.faithfulness import Ablation


class Measured:
    """Edge patching on the held-out pairs, each circuit once per ablation (a circuit two methods
    share runs once); the empty circuit's run also records the reference metrics per pair."""

    def __init__(self, model: HookedModel, pairs: Sequence[PromptPair], batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        self.clean, self.corrupted, self.metric = ioi.paired_batch(model, list(pairs))
        self.measured: dict[tuple[bytes, str], list[float]] = {}
        self.evaluators: dict[str, circuits.FaithfulnessEvaluator] = {}
        #: per ablation, "clean", "corrupted" and "empty": the metric per pair.
        self.reference: dict[str, dict[str, list[float]]] = {}

    def __call__(self, circuit: circuits.Circuit, ablation: str) -> list[float]:
        """The circuit's metric per pair under the ablation."""
        key = (circuit.copies.numpy().tobytes(), ablation)  # per copy where it is
        if key not in self.measured:
            if ablation not in self.evaluators:
                self.evaluators[ablation] = circuits.FaithfulnessEvaluator(
                    self.model, self.clean, self.corrupted, self.metric,
                    batch_size=self.batch_size,
                    ablation=cast("Ablation", ablation),  # the evaluator checks it
                )  # fmt: skip
            result = self.evaluators[ablation](circuit)
            self.measured[key] = result.circuit_per_pair.tolist()
            if circuit.n_edges == 0:
                self.reference[ablation] = {
                    "clean": result.clean_per_pair.tolist(),
                    "corrupted": result.corrupted_per_pair.tolist(),
                    "empty": self.measured[key],
                }
        return self.measured[key]


def measure_method(
    scores: circuits.EdgeScores,
    measure: Measured,
    sizes: list[int],
    ablations: Sequence[str],
    selection: str,
    spent: dict[str, float],
    own_copies: bool = False,
) -> dict[str, Any]:
    """One method's circuits at every size, from the |score| ranking and the signed one, and
    their metrics per ablation, size and pair; the seconds measuring took go to spent["eval"].
    own_copies: each query head's key/value copy chosen (and patched) on its own."""
    pick = scores.top if selection == "top" else scores.greedy
    by_abs = [pick(n, absolute=True, units="ungrouped", own_copies=own_copies) for n in sizes]
    signed = [pick(n, absolute=False, units="ungrouped", own_copies=own_copies) for n in sizes]
    with timing.timed(spent, "eval"):
        result = {
            "seconds": spent["attribute"],
            "cpu_seconds": spent["attribute_cpu"],
            "n_edges": [c.n_edges_ungrouped for c in by_abs],
            "circuit": {a: [measure(c, a) for c in by_abs] for a in ablations},
            "signed_n_edges": [c.n_edges_ungrouped for c in signed],
            "signed_circuit": {a: [measure(c, a) for c in signed] for a in ablations},
        }
    result["eval_seconds"] = spent["eval"]
    return result
