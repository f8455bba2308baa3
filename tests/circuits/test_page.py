"""The circuit page's two rankings (ra_lens/circuits/page.py): both of MIB's curves, each with its
own area, the circuits of each ranking for the size control to walk, and what the "smallest
circuit reaching a faithfulness" box reads. (tests/viz/test_circuit_page_browser.py checks
what the browser draws from them.)"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import page_setup

from ra_lens import circuits
from ra_lens.circuits.page import TARGET, circuit_page, scores_page
from tests.viz.test_circuit_page import payload


@pytest.fixture(scope="module")
def setup() -> Any:
    return page_setup()


@pytest.fixture(scope="module")
def data(setup: Any) -> dict[str, Any]:
    s = setup
    page = s.scores.to_html(curve=s.curve, circuit=s.circuit, faithfulness=s.faithfulness)
    return payload(page.html)


def test_both_curves_carry_their_own_points_and_area(setup: Any, data: dict[str, Any]) -> None:
    curve = setup.curve
    rankings = data["curve"]["rankings"]
    signed, by_abs = rankings["signed"], rankings["abs"]
    assert (signed["label"], signed["area_name"]) == ("signed score", "CPR")
    assert (by_abs["label"], by_abs["area_name"]) == ("|score|", "CMD")
    assert signed["area"] == pytest.approx(curve.cpr, rel=1e-3)
    assert by_abs["area"] == pytest.approx(curve.cmd, rel=1e-3)
    assert signed["values"] == pytest.approx(curve.signed_values, rel=1e-3, abs=1e-6)
    assert by_abs["values"] == pytest.approx(curve.abs_values, rel=1e-3, abs=1e-6)
    assert signed["n_edges"] == curve.signed_n_edges and by_abs["n_edges"] == curve.abs_n_edges
    # the two curves differ on this model, so a page showing one under the other's name is wrong
    assert curve.signed_values != curve.abs_values


def test_each_ranking_walks_its_own_circuits(setup: Any, data: dict[str, Any]) -> None:
    scores, graph, curve = setup.scores, setup.scores.graph, setup.curve
    stops, chosen = data["stops"], data["start"]
    for ranking, counts in (("signed", curve.signed_n_edges), ("abs", curve.abs_n_edges)):
        walk = data["walks"][ranking]
        own = [i for i in walk if i != chosen]
        assert [stops[i]["ranking"] for i in own] == [ranking] * len(curve.sizes)
        assert [stops[i]["n_units"] for i in own] == counts  # the curve's own circuits
        expected = [
            scores.top(int(k * graph.n_edges_ungrouped), absolute=ranking == "abs",
                       units="ungrouped").n_edges
            for k in curve.sizes
        ]  # fmt: skip
        assert [stops[i]["n_edges"] for i in own] == expected
        assert chosen in walk
    assert stops[chosen]["ranking"] == "given"
    assert stops[chosen]["n_units"] == setup.circuit.count("ungrouped")


def smallest(data: dict[str, Any], target: float) -> int | None:
    """The stop the page's box names: the fewest edges (curve's units) among the measured stops
    whose faithfulness reaches `target`, the more faithful first on a tie; None if none does."""
    measured = [
        (s["n_units"], -s["faithfulness"], i)
        for i, s in enumerate(data["stops"])
        if s["faithfulness"] is not None and s["faithfulness"] >= target
    ]
    return min(measured)[2] if measured else None


def test_smallest_circuit_reaching_a_faithfulness(setup: Any, data: dict[str, Any]) -> None:
    assert data["target"] == TARGET == 0.8
    curve = setup.curve
    # the same answer from the curve object itself, both rankings and the chosen circuit
    points = list(zip(curve.signed_n_edges, curve.signed_values))
    points += list(zip(curve.abs_n_edges, curve.abs_values))
    points.append((setup.circuit.count("ungrouped"), setup.faithfulness))
    for target in (0.5, 0.8, 1.0, max(v for _, v in points)):
        fewest = min(n for n, v in points if v >= target)
        found = smallest(data, target)
        assert found is not None and data["stops"][found]["n_units"] == fewest
    assert smallest(data, max(v for _, v in points) + 0.01) is None
    assert payload(setup.scores.to_html().html)["target"] == 0.8
    page = scores_page(setup.scores, curve=curve, target=0.95)
    assert payload(page.html)["target"] == 0.95
    with pytest.raises(ValueError, match="finite faithfulness"):
        scores_page(setup.scores, target=math.nan)


def test_a_page_of_one_circuit_has_one_walk(setup: Any) -> None:
    data = payload(circuit_page(setup.circuit, faithfulness=0.5).html)
    assert data["walks"] == {"given": [0]} and data["curve"] is None
    assert data["stops"][0]["ranking"] == "given"


def test_grouped_graph_is_described_by_key_value_head() -> None:
    g = circuits.Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    scores = circuits.EdgeScores(g, torch.linspace(-1, 1, g.real.numel()).view_as(g.real) * g.real,
                                 method="eap", direction="denoise")  # fmt: skip
    data = payload(scores_page(scores).html)
    assert data["graph"]["n_kv_heads"] == 2 and "a1.h1<v>" in data["graph"]["readers"]
    assert "a1.h3<v>" not in data["graph"]["readers"]  # readers per key/value head
