"""The smallest circuit reaching a faithfulness: measured again independently it reaches the
target, one edge fewer (the bisection's lower bracket) does not, and a target no size reaches is
reported as not reached, with the most faithful circuit of the curve."""

from __future__ import annotations

import pytest
from helpers import one_layer_model

from ra_lens import circuits
from ra_lens.tasks.ioi import PromptPair, paired_batch

PAIRS = [
    PromptPair("I like Italy", "I like Paris", " and", " the"),
    PromptPair("I like Paris", "I like Italy", " the", " and"),
    PromptPair("The capital of Italy is", "The capital of Paris is", " the", " and"),
]


@pytest.fixture(scope="module")
def setup():
    # grouped-query (2 key/value heads for 4 query heads): ungrouped and grouped counts differ
    model = one_layer_model(n_layers=2, n_key_value_heads=2)
    clean, corrupted, metric = paired_batch(model, PAIRS)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    curve = circuits.faithfulness_curve(
        model, scores, clean, corrupted, metric, sizes=[0.05, 0.5, 1.0]
    )
    return model, scores, curve, (clean, corrupted, metric)


@pytest.mark.parametrize("ranking", ["abs", "signed"])
def test_smallest_circuit_reaches_the_target_and_one_edge_fewer_does_not(setup, ranking):
    model, scores, curve, data = setup
    values = curve.abs_values if ranking == "abs" else curve.signed_values
    # a target between two points of the curve, first reached at the later one (or, where the
    # curve never rises, the first point's value: bracketed by the empty circuit, faithfulness 0)
    rises = [i for i in range(1, len(values)) if values[i] > max(values[:i]) + 1e-3]
    target = (max(values[: rises[0]]) + values[rises[0]]) / 2 if rises else values[0]
    assert target > 0
    found = circuits.smallest_circuit(model, scores, *data, curve, target, ranking=ranking)
    again = circuits.faithfulness(model, found.circuit, *data)
    assert found.reached and found.faithfulness == pytest.approx(again.value, abs=1e-9)
    assert again.value >= target and found.units == "ungrouped"
    assert found.n_edges == found.circuit.n_edges_ungrouped
    # the bisection ends on neighbours: the size asked one below is measured, below the target
    asked = {n: v for n, v in found.measured}
    high = min(n for n, v in asked.items() if v >= target)
    assert (
        found.circuit.edge_names
        == scores.top(high, absolute=ranking == "abs", units="ungrouped").edge_names
    )
    below = [n for n in asked if n < high]
    if high > 1:  # (one edge fewer than 1 is the empty circuit: faithfulness 0 by definition)
        assert below and max(below) == high - 1 and asked[high - 1] < target
        fewer = scores.top(high - 1, absolute=ranking == "abs", units="ungrouped")
        assert circuits.faithfulness(model, fewer, *data).value < target
    assert curve.smallest(target, ranking) == min(
        int(k * curve.n_total) for k, v in zip(curve.sizes, values) if v >= target
    )


def test_an_unreachable_target_is_said_so(setup):
    model, scores, curve, data = setup
    found = circuits.smallest_circuit(model, scores, *data, curve, 1e6)
    assert not found.reached and found.faithfulness == max(curve.abs_values)
    assert "no circuit measured reaches faithfulness 1e+06" in found.summary()
    assert curve.smallest(1e6) is None
