"""`circuits.curve`: a faithfulness curve holds finite numbers, so save, load and to_html never
see a NaN."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens.circuits import EdgeScores, FaithfulnessCurve, Graph, faithfulness_curve
from ra_lens.toy_models import tiny_model


@pytest.mark.parametrize("where", ["signed_values", "abs_values", "sizes"])
def test_a_curve_with_nan_is_refused_on_construction(where: str) -> None:
    values = {"sizes": [0.1, 1.0], "signed_values": [0.5, 1.0], "abs_values": [0.4, 1.0]}
    values[where] = [values[where][0], math.nan]
    with pytest.raises(ValueError, match=rf"{where}\[1\] is nan: .*finite.*custom evaluate"):
        FaithfulnessCurve(values["sizes"], 10, values["signed_values"], [1, 10], values["abs_values"], [1, 10])  # fmt: skip


def test_a_custom_evaluate_returning_nan_is_named() -> None:
    model = tiny_model(arch_or_hooked("llama"))
    g = Graph.from_model(model)
    scores = EdgeScores(g, torch.ones(g.real.shape, dtype=torch.float64) * g.real, "eap", "denoise")
    calls = []

    def broken(model, circuit, clean, corrupted, metric, *, ablation):  # noqa: ANN001, ANN202
        calls.append(circuit)
        return math.nan

    with pytest.raises(ValueError, match=r"evaluate \(.*broken.*\) returned nan for the circuit"):
        faithfulness_curve(model, scores, "a b", "a c", len, sizes=[0.5, 1.0], evaluate=broken)
    assert len(calls) == 1


def test_a_curve_of_per_copy_circuits_measures_each_copy() -> None:
    from helpers import has_bridge, hooked_toy

    from ra_lens.circuits import FaithfulnessEvaluator, attribute, faithfulness_curve
    from ra_lens.metrics import logit_diff
    from ra_lens.toy_models import tiny_model

    if has_bridge():
        model = tiny_model("llama", dtype=torch.float64, spread=True)
    else:
        model = hooked_toy(
            positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS"
        )
    clean, corrupted = ["When Mary and John went to the"], ["When John and Mary went to the"]
    metric = logit_diff([50], [60])
    scores = attribute(model, clean, corrupted, metric, method="eap")
    sizes = [0.05, 0.2, 0.5]
    curve = faithfulness_curve(
        model, scores, clean, corrupted, metric, sizes=sizes, own_copies=True
    )
    assert curve.own_copies and "each key/value copy on its own" in curve.table()
    evaluate = FaithfulnessEvaluator(model, clean, corrupted, metric)
    total = scores.graph.count()
    circuits = [scores.top(int(k * total), absolute=False, own_copies=True) for k in sizes]
    assert any(c.per_copy for c in circuits)
    assert curve.signed_values == pytest.approx([evaluate(c).value for c in circuits], abs=1e-12)
    assert curve.signed_n_edges == [c.n_edges_ungrouped for c in circuits]
    with pytest.raises(ValueError, match="pass units='ungrouped'"):
        faithfulness_curve(
            model, scores, clean, corrupted, metric, units="grouped", own_copies=True
        )
