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
