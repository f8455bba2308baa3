"""Circuits as data: choosing edges from scores, pruning, set operations, EAP-IG JSON files,
pictures and faithfulness curves (ra_lens/circuits/{circuit,files,draw,curve}.py).

Most tests build a `Graph` directly (no model); the curve tests use a tiny model for its graph.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens.circuits import (
    MIB_FRACTIONS,
    MIB_SUBMISSION_FRACTIONS,
    Circuit,
    EdgeScores,
    FaithfulnessCurve,
    Graph,
    export_mib,
    faithfulness_curve,
    mib_circuits,
)
from ra_lens.circuits.files import ungrouped_readers
from ra_lens.toy_models import tiny_model


def scores_of(graph: Graph, values: dict[str, float]) -> EdgeScores:
    s = torch.zeros(len(graph.writers), len(graph.readers), dtype=torch.float64)
    for name, value in values.items():
        s[graph.edge_index(name)] = value
    return EdgeScores(graph, s, method="test", direction="denoise")


def on_paths(circuit: Circuit) -> torch.Tensor:
    """The edges of `circuit` on a path input -> ... -> logits, by explicit recursion over the
    circuit's own edges (an independent check of Circuit.prune)."""
    g, edges = circuit.graph, torch.nonzero(circuit.edges).tolist()
    owner = g.reader_owners

    @lru_cache(None)
    def reader_leads(r: int) -> bool:
        if g.readers[r] == "logits":
            return True
        return any(writer_leads(w) for w in torch.nonzero(owner[r]).flatten().tolist())

    @lru_cache(None)
    def writer_leads(w: int) -> bool:
        return any(reader_leads(r) for ww, r in edges if ww == w)

    @lru_cache(None)
    def reached(w: int) -> bool:
        mine = set(torch.nonzero(owner[:, w]).flatten().tolist())
        return g.writers[w] == "input" or any(reached(ww) for ww, r in edges if r in mine)

    keep = torch.zeros_like(circuit.edges)
    for w, r in edges:
        keep[w, r] = reached(w) and reader_leads(r)
    return keep


# ---------------------------------------------------------------- choosing and pruning


def test_top_threshold_pick_by_magnitude_and_prune() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    scores = scores_of(
        g,
        {
            "a0.h0->logits": 5.0,
            "input->a0.h1<q>": -4.0,  # a0.h1 has no edge out among the top 3: pruned
            "input->logits": 1.0,
            "input->a0.h0<q>": 0.5,
        },
    )
    assert scores.top(3).edge_names == ["input->logits"]
    assert scores.top(4).edge_names == ["input->a0.h0<q>", "input->logits", "a0.h0->logits"]
    assert scores.top(4).nodes == ["input", "a0.h0", "logits"]
    assert scores.threshold(1.0).edge_names == ["input->logits"]
    assert scores.threshold(0.5).edge_names == scores.top(4).edge_names
    # signed: the negative edge ranks below the zeros (ties in graph order: input->a0.h0<k>)
    assert scores.top(4, absolute=False).edge_names == [
        "input->a0.h0<q>",
        "input->a0.h0<k>",
        "input->logits",
        "a0.h0->logits",
    ]
    assert scores.threshold(-5.0, absolute=False).n_edges == g.n_edges  # every edge, all on paths
    assert scores.top(0).n_edges == 0 and scores.top(g.n_edges) == Circuit.full(g)
    with pytest.raises(ValueError, match="the graph has 13 edges"):
        scores.top(14)
    with pytest.raises(TypeError, match="whole number"):
        scores.top(2.5)


def test_non_finite_scores_and_thresholds_are_refused() -> None:
    """A NaN score would take a place in top(n) (NaN sorts above every number) and fail every
    threshold; threshold(nan) would give an empty circuit; threshold(-inf) keeps every edge."""
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    for bad in (float("nan"), float("inf")):
        s = torch.zeros(len(g.writers), len(g.readers), dtype=torch.float64)
        s[g.edge_index("a0.h1->logits")] = bad
        message = (
            f"scores has 1 non-finite entries, e.g. {bad} at a0.h1->logits: edge scores must be "
            "finite numbers (a metric or model that overflowed, e.g. in float16, gives NaN)"
        )
        with pytest.raises(ValueError) as error:
            EdgeScores(g, s, method="test", direction="denoise")
        assert str(error.value) == message
        with pytest.raises(ValueError) as error:
            Circuit(g, torch.zeros_like(g.real), scores=s)
        assert str(error.value) == message
    scores = scores_of(g, {"input->logits": 1.0, "input->a0.h0<q>": -2.0})
    with pytest.raises(ValueError) as error:
        scores.threshold(float("nan"))
    assert str(error.value) == (
        "t=nan: no score compares with NaN; pass a number (t=-inf keeps every edge with "
        "absolute=False)"
    )
    with pytest.raises(TypeError, match=r"^t='0.5': pass the threshold as a number"):
        scores.threshold("0.5")  # type: ignore[arg-type]
    assert scores.threshold(float("-inf"), absolute=False) == Circuit.full(g)
    assert scores.threshold(float("-inf")) == Circuit.full(g)
    assert scores.threshold(float("inf")).n_edges == 0


def test_top_ties_go_to_graph_order() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    ones = EdgeScores(g, g.real.double(), method="test", direction="noise")
    # the first 6 edges: input's into a0.h0<q>, a0.h1<q>, <k>, <v>, m0 and logits; the heads and
    # m0 have no edge out among them
    assert ones.top(6, units="grouped").edge_names == ["input->logits"]
    # then a0.h0->m0 (m0 writes nothing: pruned) and a0.h0->logits, which brings in a0.h0's
    # inputs, the key/value ones shared with a0.h1
    assert ones.top(8, units="grouped").edge_names == [
        "input->a0.h0<q>",
        "input->a0.h0<k>",
        "input->a0.h0<v>",
        "input->logits",
        "a0.h0->logits",
    ]


def test_prune_keeps_exactly_the_edges_on_input_to_logits_paths() -> None:
    torch.manual_seed(0)
    for trial in range(40):
        g = Graph(2 + trial % 2, 4, (1, 2, 4)[trial % 3], 8, parallel_attn_mlp=trial % 5 == 0)
        circuit = Circuit(g, (torch.rand(g.real.shape) < 0.15) & g.real)
        pruned = circuit.prune()
        assert torch.equal(pruned.edges, on_paths(circuit)), trial
        assert pruned.prune() == pruned


def test_prune_drops_an_edge_whose_writer_is_unreachable() -> None:
    g = Graph(n_layers=2, n_heads=2, n_kv_heads=1, d_model=8)
    c = Circuit.from_edges(g, ["a0.h1->a1.h0<q>", "a1.h0->logits", "input->m0"])
    # a0.h1 reads nothing from input, so a1.h0 is not reached either; m0 writes nothing
    assert c.prune().n_edges == 0
    # a0.h1 shares its key/value head with a0.h0: feeding that head's value input reaches it
    c2 = Circuit.from_edges(g, ["input->a0.h0<v>", "a0.h1->a1.h0<q>", "a1.h0->logits"])
    assert c2.prune() == c2
    assert c2.nodes == ["input", "a0.h1", "a1.h0", "logits"]


def test_greedy_grows_from_the_logits() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    scores = scores_of(
        g,
        {
            "a0.h0->logits": 5.0,
            "input->a0.h1<q>": 4.0,  # never a candidate: a0.h1 never joins
            "input->logits": 1.0,
            "input->a0.h0<q>": 0.5,
        },
    )
    # picks a0.h0->logits, input->logits; a0.h0 has no input yet, so pruning leaves one edge
    assert scores.greedy(2).edge_names == ["input->logits"]
    assert scores.greedy(3).edge_names == ["input->a0.h0<q>", "input->logits", "a0.h0->logits"]
    assert scores.top(3).edge_names == ["input->logits"]  # top takes the unreachable 4.0 edge
    # signed: a large negative edge into the logits loses to every non-negative one
    signed = scores_of(g, {"a0.h0->logits": -9.0, "input->logits": 0.1, "m0->logits": 0.2})
    assert signed.greedy(2, absolute=False).edge_names == ["input->logits"]  # m0 has no input
    assert signed.greedy(1).edge_names == []  # the first pick, a0.h0->logits, is pruned
    assert scores.greedy(g.n_edges) == Circuit.full(g)


def test_greedy_counts_each_shared_key_value_edge_once() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    scores = scores_of(
        g, {"a0.h0->logits": 5.0, "a0.h1->logits": 4.0, "input->a0.h0<k>": 3.0, "input->m0": 2.0}
    )
    # both heads join; their shared key input becomes a candidate once (not once per head), so
    # the 4th pick is the first 0-score candidate in graph order; input->m0 is never a candidate
    assert scores.greedy(4, units="grouped").edge_names == [
        "input->a0.h0<q>",
        "input->a0.h0<k>",
        "a0.h0->logits",
        "a0.h1->logits",
    ]


# ---------------------------------------------------------------- circuits as sets


def test_set_operations_nodes_and_names() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    a = Circuit.from_edges(g, ["input->a0.h1<q>", "a0.h1->logits"])
    b = Circuit.from_edges(g, ["input->logits", "a0.h1->logits"])
    assert (a | b).edge_names == ["input->a0.h1<q>", "input->logits", "a0.h1->logits"]
    assert (a & b).edge_names == ["a0.h1->logits"]
    assert (a - b).edge_names == ["input->a0.h1<q>"]
    assert (a | b).n_edges == 3 and (a | b).nodes == ["input", "a0.h1", "logits"]
    assert a == Circuit.from_edges(g, ["a0.h1->logits", "input->a0.h1<q>"]) and a != b
    assert Circuit.full(g).n_edges == g.n_edges and Circuit.empty(g).n_edges == 0
    assert Circuit.full(g) - Circuit.full(g) == Circuit.empty(g)
    assert repr(a) == "Circuit(2 of 11 edges, 3 nodes; 1 layers x 2 heads, 1 kv heads)"
    other = Circuit.empty(Graph(n_layers=2, n_heads=2, n_kv_heads=1, d_model=8))
    with pytest.raises(ValueError, match="different graphs"):
        a | other
    # scores survive an operation only when both sides carry the same
    s = scores_of(g, {"a0.h1->logits": 1.0, "input->a0.h1<q>": 1.0, "input->logits": 2.0})
    assert torch.equal((s.top(2) | s.top(3)).scores, s.scores)
    assert (s.top(2) | b).scores is None


def test_circuit_refuses_what_is_not_an_edge() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    with pytest.raises(KeyError, match="comes after"):
        Circuit.from_edges(g, ["m0->a0.h0<q>"])
    bad = torch.zeros_like(g.real)
    bad[g.writer_index["m0"], g.reader_index["m0"]] = True
    with pytest.raises(ValueError, match="not edges of the graph, e.g. m0->m0"):
        Circuit(g, bad)
    with pytest.raises(ValueError, match="bool tensor of shape"):
        Circuit(g, torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="wrap it in"):
        Circuit.from_edges(g, "input->logits")
    with pytest.raises(ValueError, match="direction"):
        EdgeScores(g, torch.zeros(g.real.shape), method="eap", direction="both")


# ---------------------------------------------------------------- files


def test_json_round_trip_in_eap_ig_layout(tmp_path: Path) -> None:
    g = Graph(n_layers=2, n_heads=2, n_kv_heads=2, d_model=8)
    torch.manual_seed(0)
    s = torch.randn(len(g.writers), len(g.readers), dtype=torch.float64) * g.real
    scores = EdgeScores(g, s, method="eap", direction="denoise", node_scores=torch.arange(7.0))
    circuit = scores.top(12)
    path = tmp_path / "c.json"
    circuit.to_json(path)
    data = json.loads(path.read_text())
    assert data["cfg"] == {"n_layers": 2, "n_heads": 2, "parallel_attn_mlp": False, "d_model": 8}
    assert len(data["edges"]) == g.n_edges  # ungrouped already: one entry per edge
    assert list(data["nodes"]) == g.writers + ["logits"]
    assert [n for n, v in data["nodes"].items() if v["in_graph"]] == circuit.nodes
    assert data["nodes"]["a0.h1"]["score"] == 2.0
    chosen = [n for n, e in data["edges"].items() if e["in_graph"]]
    assert sorted(chosen) == sorted(circuit.edge_names)
    assert data["edges"]["input->a1.h0<k>"]["score"] == float(s[g.edge_index("input->a1.h0<k>")])
    back = Circuit.from_json(path, g)
    assert back == circuit
    assert torch.equal(back.scores, s) and torch.equal(back.node_scores, torch.arange(7.0).double())
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_json_gqa_repeats_key_value_edges_on_each_query_head(tmp_path: Path) -> None:
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    torch.manual_seed(1)
    s = torch.randn(len(g.writers), len(g.readers), dtype=torch.float64) * g.real
    circuit = EdgeScores(g, s, method="eap", direction="denoise").top(60)
    assert any("<k>" in n for n in circuit.edge_names)
    path = tmp_path / "gqa.json"
    circuit.to_json(path)
    data = json.loads(path.read_text())
    ungrouped = Graph(n_layers=2, n_heads=4, n_kv_heads=4, d_model=8)
    assert len(data["edges"]) == ungrouped.n_edges  # EAP-IG's ungrouped edge set
    e = data["edges"]
    for h in (2, 3):  # key/value head 1 is read by query heads 2 and 3, each with half its score
        assert e[f"a0.h0->a1.h{h}<v>"] == {
            "score": float(s[g.edge_index("a0.h0->a1.h1<v>")]) / 2,
            "in_graph": "a0.h0->a1.h1<v>" in circuit.edge_names,
        }
    assert e["a0.h0->a1.h2<q>"]["score"] == float(s[g.edge_index("a0.h0->a1.h2<q>")])
    back = Circuit.from_json(path, g)
    assert back == circuit and torch.equal(back.scores, s)  # the copies' shares sum back
    # read as the ungrouped model EAP-IG sees: each key/value edge on every head of its group
    flat = Circuit.from_json(path, ungrouped)
    expected = set()
    for name in circuit.edge_names:
        writer, reader = name.split("->")
        kind = reader[-3:]
        if kind in ("<k>", "<v>"):
            layer, head = reader[:-3].split(".h")
            expected |= {f"{writer}->{layer}.h{2 * int(head) + i}{kind}" for i in range(2)}
        else:
            expected.add(name)
    assert set(flat.edge_names) == expected


def test_json_refuses_a_group_that_disagrees(tmp_path: Path) -> None:
    g = Graph(n_layers=1, n_heads=4, n_kv_heads=2, d_model=8)
    path = tmp_path / "mixed.json"
    Circuit.from_edges(g, ["input->a0.h1<k>", "a0.h2->logits"]).to_json(path)
    data = json.loads(path.read_text())
    data["edges"]["input->a0.h3<k>"] = {"score": 2.0, "in_graph": False}  # h2 still True
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"mixed.json: edge input->a0.h1<k> .*h2..h3.*kv='any'"):
        Circuit.from_json(path, g, kv="strict")
    # by default each copy as the file says: query head 2's copy in, head 3's out
    copies = Circuit.from_json(path, g)
    assert copies.per_copy and copies.n_edges_ungrouped == 2
    assert copies.to_dict()["ungrouped_edges"] == ["input->a0.h2<k>", "a0.h2->logits"]
    assert "input->a0.h1<k>" in Circuit.from_json(path, g, kv="any").edge_names
    assert "input->a0.h1<k>" not in Circuit.from_json(path, g, kv="all").edge_names
    # copies that differ: their sum (the shared input's score is the sum of its copies')
    assert Circuit.from_json(path, g, kv="any").scores[g.edge_index("input->a0.h1<k>")] == 2.0


def test_json_errors_name_the_file(tmp_path: Path) -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    path = tmp_path / "c.json"
    Circuit.full(g).to_json(path)
    good = json.loads(path.read_text())
    with pytest.raises(ValueError, match="c.json: written for another model"):
        Circuit.from_json(path, Graph(n_layers=2, n_heads=2, n_kv_heads=1, d_model=8))
    cases = [
        ("{not json", "c.json is not valid JSON"),
        (json.dumps({"cfg": good["cfg"], "nodes": {}}), r"c.json: not an EAP-IG graph.*'edges'"),
        (
            json.dumps({**good, "edges": {"input->a5.h0<q>": {"score": 1, "in_graph": True}}}),
            "c.json: 'input->a5.h0<q>' is not an edge",
        ),
        (
            json.dumps({**good, "edges": {"input->logits": {"score": 1, "in_graph": "yes"}}}),
            "c.json: edge 'input->logits' needs a boolean 'in_graph'",
        ),
        (
            json.dumps({**good, "edges": {"m0->a0.h0<q>": {"score": 1, "in_graph": True}}}),
            "c.json: 'm0->a0.h0<q>': m0 comes after",
        ),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            Circuit.from_json(path, g)
    # edges left out of a file are out of the circuit
    path.write_text(
        json.dumps({**good, "edges": {"input->logits": good["edges"]["input->logits"]}})
    )
    assert Circuit.from_json(path, g).edge_names == ["input->logits"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ('"score": NaN', "edge 'input->logits' has score nan, expected a finite number"),
        ('"score": -Infinity', "edge 'input->logits' has score -inf, expected a finite number"),
        ('"score": 1' + "0" * 400, "edge 'input->logits' has score 1" + "0" * 400),
        ('"score": "0.5"', "edge 'input->logits' has score '0.5', expected a finite number"),
        ("node NaN", "node 'a0.h0' has score nan, expected a finite number or null"),
        ("node text", "node 'a0.h0' has score 'high', expected a finite number or null"),
        ("node true", "node 'a0.h0' has score True, expected a finite number or null"),
        ("latin-1", "not UTF-8 text (byte 2), so not an EAP-IG graph JSON file"),
    ],
)  # fmt: skip
def test_json_damage_to_scores_and_text_names_the_file(
    tmp_path: Path, damage: str, message: str
) -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    path = tmp_path / "c.json"
    Circuit.full(g).to_json(path)
    good = json.loads(path.read_text())
    edge = '{"input->logits": {"in_graph": true, %s}}'
    node = '{"a0.h0": {"in_graph": true, "score": %s}}'
    nodes = {"node NaN": "NaN", "node text": '"high"', "node true": "true"}
    cfg = json.dumps(good["cfg"])
    if damage in nodes:
        text = f'{{"cfg": {cfg}, "nodes": {node % nodes[damage]}, "edges": {{}}}}'
    elif damage == "latin-1":
        text = '{"\xe9": 1}'
    else:
        text = f'{{"cfg": {cfg}, "nodes": {{}}, "edges": {edge % damage}}}'
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as error:
        Circuit.from_json(path, g)
    assert str(error.value).startswith(f"{path}: {message}")


def test_json_node_without_a_score_round_trips_as_strict_json(tmp_path: Path) -> None:
    """NaN marks a node without a score: it is left out of the file (JSON has no NaN)."""
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    node_scores = torch.tensor([float("nan"), 0.5, -1.0, 2.0], dtype=torch.float64)
    Circuit(g, g.real.clone(), node_scores=node_scores).to_json(tmp_path / "c.json")

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the file")

    nodes = json.loads((tmp_path / "c.json").read_text(), parse_constant=refuse)["nodes"]
    assert [nodes[name].get("score") for name in g.writers] == [None, 0.5, -1.0, 2.0]
    read = Circuit.from_json(tmp_path / "c.json", g).node_scores
    assert read is not None and torch.equal(read.isnan(), node_scores.isnan())
    assert read[1:].tolist() == [0.5, -1.0, 2.0]


def test_ungrouped_readers_map_each_query_head_to_its_key_value_head() -> None:
    g = Graph(n_layers=1, n_heads=4, n_kv_heads=2, d_model=8)
    mapping = {name: g.readers[r] for name, r in ungrouped_readers(g)}
    assert mapping["a0.h3<k>"] == "a0.h1<k>" and mapping["a0.h2<v>"] == "a0.h1<v>"
    assert mapping["a0.h3<q>"] == "a0.h3<q>" and len(mapping) == 3 * 4 + 2


# ---------------------------------------------------------------- pictures


def test_draw_writes_png_and_svg_with_one_arrow_per_drawn_edge(tmp_path: Path) -> None:
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    circuit = Circuit.from_edges(
        g,
        [
            "input->a0.h1<q>",
            "a0.h1->a1.h1<k>",  # key/value head 1: query heads 2 and 3, both in the circuit
            "a1.h2->logits",
            "a1.h3->logits",
            "a0.h1->m1",
            "m1->logits",
        ],
    )
    fig = circuit.draw(tmp_path / "c.png")
    circuit.draw(tmp_path / "c.svg")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    patches = fig.axes[0].patches
    assert sum(isinstance(p, FancyBboxPatch) for p in patches) == 6  # input a0.h1 a1.h2/3 m1 logits
    assert sum(isinstance(p, FancyArrowPatch) for p in patches) == 7  # the key edge drawn twice


# ---------------------------------------------------------------- curves


def test_curve_areas_are_mibs_evaluate_area_under_curve_by_hand(tmp_path) -> None:
    """MIB's evaluate_area_under_curve: percentages (.001 .. 1), area_under = sum of (x2 - x1) *
    (f1 + f2) / 2 and area_from_1 = sum of (x2 - x1) * (|1 - f1| + |1 - f2|) / 2 over consecutive
    sizes, x the fraction itself; print_results.py reports CPR = area_under of the run without
    --absolute and CMD = area_from_1 of the run with it. The expected numbers are worked out by
    hand below."""
    signed = [0.2, 0.3, 0.5, 0.8, 1.1, 1.4, 1.6, 1.5, 1.2, 1.0]
    by_abs = [0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0, 1.0, 1.0]
    curve = FaithfulnessCurve(
        sizes=list(MIB_FRACTIONS),
        n_total=1000,
        signed_values=signed,
        signed_n_edges=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
        abs_values=by_abs,
        abs_n_edges=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
    )
    # widths .001 .003 .005 .01 .03 .05 .1 .3 .5; signed means .25 .4 .65 .95 1.25 1.5 1.55 1.35 1.1
    cpr = 0.00025 + 0.0012 + 0.00325 + 0.0095 + 0.0375 + 0.075 + 0.155 + 0.405 + 0.55
    # |1 - f| means .85 .7 .5 .3 .15 .075 .025 0 0
    cmd = 0.00085 + 0.0021 + 0.0025 + 0.003 + 0.0045 + 0.00375 + 0.0025
    assert cpr == pytest.approx(1.2367, abs=1e-12) and cmd == pytest.approx(0.0192, abs=1e-12)
    assert curve.cpr == pytest.approx(cpr, abs=1e-12)
    assert curve.cmd == pytest.approx(cmd, abs=1e-12)
    perfect = FaithfulnessCurve(
        list(MIB_FRACTIONS), 100, [1.0] * 10, [0] * 10, [1.0] * 10, [0] * 10
    )
    assert perfect.cpr == pytest.approx(0.999) and perfect.cmd == 0.0
    d = curve.to_dict()
    assert d["cpr"] == curve.cpr and d["cmd"] == curve.cmd and d["signed_values"] == signed
    assert d["units"] == "ungrouped" and d["baseline"].startswith("empty circuit")
    assert "| 50 | 500 | 1.2000 | 500 | 1.0000 |" in curve.table()
    fig = curve.plot(tmp_path / "curve.svg")
    (ax,) = fig.axes
    assert (tmp_path / "curve.svg").read_text().startswith("<?xml")
    assert ax.get_xscale() == "log" and len(ax.lines) == 4  # two curves and the lines at 0 and 1
    assert list(ax.lines[0].get_ydata()) == signed and list(ax.lines[1].get_ydata()) == by_abs
    with pytest.raises(ValueError, match="one of each per circuit"):
        FaithfulnessCurve([0.1], 10, [0.5], [1], [0.5, 0.6], [1])


def random_scores(graph: Graph, seed: int) -> EdgeScores:
    torch.manual_seed(seed)
    s = torch.randn(len(graph.writers), len(graph.readers), dtype=torch.float64) * graph.real
    return EdgeScores(graph, s, method="eap", direction="denoise")


@pytest.mark.parametrize("absolute", [False, True])
def test_every_mib_size_keeps_its_budget_in_ungrouped_edges(tmp_path: Path, absolute: bool) -> None:
    """For each of MIB's sizes, the circuit of int(k * N) ungrouped edges (N = EAP-IG's edge count)
    keeps at most that many ungrouped edges, and keeps exactly the grouped edges whose every
    query-head copy is among MIB's top int(k * N) of the scores file (ranked here independently,
    from the file's names and scores), then pruned."""
    g = Graph(n_layers=3, n_heads=6, n_kv_heads=2, d_model=8)  # groups of 3 query heads
    flat = Graph(n_layers=3, n_heads=6, n_kv_heads=6, d_model=8)
    assert g.n_edges_ungrouped == flat.n_edges > g.n_edges
    scores = random_scores(g, 4)
    (path,) = export_mib(scores, tmp_path, circuits=False)
    file_edges = json.loads(path.read_text())["edges"]
    assert len(file_edges) == g.n_edges_ungrouped
    ranked = sorted(file_edges, key=lambda n: -(abs if absolute else float)(file_edges[n]["score"]))
    for k in MIB_FRACTIONS:
        n = int(k * g.n_edges_ungrouped)
        circuit = scores.top(n, absolute=absolute, units="ungrouped")
        assert circuit.n_edges_ungrouped <= n
        mib_top = set(ranked[:n])
        chosen = torch.zeros_like(g.real)
        for w, writer in enumerate(g.writers):
            for r, reader in enumerate(g.readers):
                if g.real[w, r]:
                    copies = ungrouped_names(g, writer, reader)
                    chosen[w, r] = all(c in mib_top for c in copies)
        assert circuit == Circuit(g, chosen).prune(), k
    full = scores.top(g.n_edges_ungrouped, units="ungrouped")
    assert full.n_edges_ungrouped == g.n_edges_ungrouped and full.n_edges == g.n_edges
    with pytest.raises(ValueError, match=r"edges \(ungrouped\)"):
        scores.top(g.n_edges_ungrouped + 1, units="ungrouped")
    greedy = scores.greedy(40, absolute=absolute, units="ungrouped")
    assert 0 < greedy.n_edges_ungrouped <= 40  # pruning may keep fewer, never more


def ungrouped_names(g: Graph, writer: str, reader: str) -> list[str]:
    """The names EAP-IG's ungrouped graph gives the edge writer -> reader of `g`."""
    if reader.endswith(("<k>", "<v>")):
        layer, head = reader[:-3].split(".h")
        kind = reader[-3:]
        return [f"{writer}->{layer}.h{g.group * int(head) + i}{kind}" for i in range(g.group)]
    return [f"{writer}->{reader}"]


def test_export_mib_reads_back(tmp_path: Path) -> None:
    """The MIB folder: importances.json holds every edge's score in EAP-IG's ungrouped layout
    (read back: the same scores), and the nine circuits are the signed ranking's at 0.1 .. 50 %,
    each within its budget counted in the file itself, as MIB counts (in_graph edges)."""
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    scores = random_scores(g, 5)
    paths = export_mib(scores, tmp_path / "ioi_smollm2", circuits=True)
    assert [p.relative_to(tmp_path / "ioi_smollm2").as_posix() for p in paths] == [
        "importances.json"
    ] + [f"circuits/circuit_{k:g}.json" for k in MIB_SUBMISSION_FRACTIONS]
    assert MIB_SUBMISSION_FRACTIONS == MIB_FRACTIONS[:-1]
    data = json.loads(paths[0].read_text())
    assert data["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 8}
    assert len(data["edges"]) == g.n_edges_ungrouped
    assert all(e["in_graph"] for e in data["edges"].values())
    kv = float(scores.scores[g.edge_index("a0.h1->a1.h0<k>")])
    assert data["edges"]["a0.h1->a1.h0<k>"]["score"] == data["edges"]["a0.h1->a1.h1<k>"]["score"]
    assert data["edges"]["a0.h1->a1.h1<k>"]["score"] == kv / 2
    back = Circuit.from_json(paths[0], g)
    assert back == Circuit.full(g) and torch.equal(back.scores, scores.scores)
    expected = mib_circuits(scores, MIB_SUBMISSION_FRACTIONS, absolute=False)
    for k, path, circuit in zip(MIB_SUBMISSION_FRACTIONS, paths[1:], expected, strict=True):
        in_file = [n for n, e in json.loads(path.read_text())["edges"].items() if e["in_graph"]]
        assert len(in_file) == circuit.n_edges_ungrouped <= int(k * g.n_edges_ungrouped)
        assert Circuit.from_json(path, g) == circuit
    assert expected[-1].n_edges > 0 and expected[-1] == scores.top(55, absolute=False, units="ungrouped")  # fmt: skip
    with pytest.raises(TypeError, match="EdgeScores"):
        export_mib(scores.scores, tmp_path / "x")  # type: ignore[arg-type]


def test_signed_rankings_and_mib_files_put_helpful_edges_first_in_both_directions(
    tmp_path: Path,
) -> None:
    """MIB's signed ranking wants the edges that help the metric: a denoise score is positive for
    one, a noise score negative (m(clean with the edge corrupted) - m(clean)). Noise scores that
    are the exact negatives of denoise scores give the same signed circuits and the same file."""
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    denoise = random_scores(g, 6)
    noise = EdgeScores(g, -denoise.scores, method="eap", direction="noise")
    assert torch.equal(noise.helps, denoise.helps) and torch.equal(denoise.helps, denoise.scores)
    for n in (5, 20, 60):
        assert noise.top(n, absolute=False) == denoise.top(n, absolute=False)
        assert noise.top(n, absolute=False, units="ungrouped") == denoise.top(
            n, absolute=False, units="ungrouped"
        )
        assert noise.greedy(n, absolute=False) == denoise.greedy(n, absolute=False)
        assert noise.top(n) == denoise.top(n)  # |score| does not care
    assert noise.threshold(0.5, absolute=False) == denoise.threshold(0.5, absolute=False)
    a = json.loads(export_mib(denoise, tmp_path / "d", circuits=False)[0].read_text())
    b = json.loads(export_mib(noise, tmp_path / "n", circuits=False)[0].read_text())
    assert a == b and a["edges"]["a0.h1->a1.h0<q>"]["score"] == float(
        denoise.scores[g.edge_index("a0.h1->a1.h0<q>")]
    )


def test_faithfulness_curve_measures_both_rankings_each_distinct_circuit_once() -> None:
    model = tiny_model(arch_or_hooked("llama"))  # grouped-query attention on TL 4
    g = Graph.from_model(model)
    scores = random_scores(g, 0)
    seen: list[Circuit] = []
    ablations: list[str] = []

    def signed_sum(model, circuit, clean, corrupted, metric, *, ablation):  # noqa: ANN001, ANN202
        assert clean == "a b" and corrupted == "a c" and metric is len
        seen.append(circuit)
        ablations.append(ablation)
        return float((scores.scores * circuit.edges).sum())

    sizes = [0.001, 0.002, 0.1, 0.5, 1.0]
    curve = faithfulness_curve(
        model, scores, "a b", "a c", len, sizes=sizes, ablation="mean", evaluate=signed_sum
    )
    n_total = g.n_edges_ungrouped
    signed = [scores.top(int(k * n_total), absolute=False, units="ungrouped") for k in sizes]
    by_abs = [scores.top(int(k * n_total), units="ungrouped") for k in sizes]
    assert curve.sizes == sizes and curve.n_total == n_total and curve.units == "ungrouped"
    assert curve.signed_n_edges == [c.n_edges_ungrouped for c in signed]
    assert curve.abs_n_edges == [c.n_edges_ungrouped for c in by_abs]
    assert curve.signed_values == [float((scores.scores * c.edges).sum()) for c in signed]
    assert curve.abs_values == [float((scores.scores * c.edges).sum()) for c in by_abs]
    assert curve.signed_values[3] > curve.abs_values[3]  # the signed ranking keeps what helps
    distinct = {c.edges.numpy().tobytes() for c in signed + by_abs}
    assert len(seen) == len(distinct) < 2 * len(sizes)  # the empty and full circuits once each
    assert curve.method == "eap" and set(ablations) == {"mean"}
    grouped = faithfulness_curve(
        model, scores, "a b", "a c", len, sizes=[0.5], units="grouped", evaluate=signed_sum
    )
    assert grouped.n_total == g.n_edges and grouped.abs_n_edges == [
        scores.top(int(0.5 * g.n_edges), units="grouped").n_edges
    ]
    greedy = faithfulness_curve(
        model, scores, "a b", "a c", len, sizes=[0.5], selection="greedy", evaluate=signed_sum
    )
    assert greedy.abs_n_edges == [scores.greedy(int(0.5 * n_total), units="ungrouped").n_edges_ungrouped]  # fmt: skip
    for bad, message in [([50, 100], "fractions"), ([0.5, 0.1], "increasing"), ([], "fractions")]:
        with pytest.raises(ValueError, match=message):
            faithfulness_curve(model, scores, "a", "b", len, sizes=bad, evaluate=signed_sum)
    with pytest.raises(ValueError, match="units"):
        faithfulness_curve(model, scores, "a", "b", len, units="heads", evaluate=signed_sum)  # type: ignore[arg-type]
    other = EdgeScores(Graph(1, 4, 4, 32), torch.zeros(6, 14), method="eap", direction="noise")
    with pytest.raises(ValueError, match="the scores are for"):
        faithfulness_curve(model, other, "a", "b", len, evaluate=signed_sum)


@pytest.mark.parametrize("ablation", ["patching", "mean", "zero"])
def test_faithfulness_curve_with_edge_patching_ends_at_exactly_0_and_1(ablation: str) -> None:
    """Normalised by the empty circuit under the same ablation (MIB's baseline): the empty
    circuit gives exactly 0 and the full one 1 under every ablation, and the one definition
    holds for `faithfulness`, the evaluator and the curve alike."""
    from ra_lens.circuits import FaithfulnessEvaluator, faithfulness
    from ra_lens.metrics import logit_diff

    model = tiny_model(arch_or_hooked("llama"), dtype=torch.float64)  # GQA on TL 4
    g = Graph.from_model(model)
    scores = random_scores(g, 0)
    clean, corrupted = "The capital of France is", "The capital of Italy is"
    metric = logit_diff([294], [52])
    curve = faithfulness_curve(
        model, scores, clean, corrupted, metric, sizes=[0.001, 0.3, 1.0], ablation=ablation
    )
    assert curve.signed_n_edges[0] == curve.abs_n_edges[0] == 0
    assert curve.signed_n_edges[-1] == curve.abs_n_edges[-1] == g.n_edges_ungrouped
    assert curve.signed_values[0] == curve.abs_values[0] == 0.0
    assert curve.signed_values[-1] == pytest.approx(1.0, abs=1e-10)
    middle = scores.top(int(0.3 * g.n_edges_ungrouped), absolute=False, units="ungrouped")
    result = faithfulness(model, middle, clean, corrupted, metric, ablation=ablation)
    evaluator = FaithfulnessEvaluator(model, clean, corrupted, metric, ablation=ablation)
    assert curve.signed_values[1] == evaluator(middle).value == result.value
    expected = (result.circuit_metric - result.empty_metric) / (
        result.clean_metric - result.empty_metric
    )
    assert result.value == pytest.approx(expected, rel=1e-12)
    assert result.baseline.startswith("empty circuit") and result.ablation == ablation
    empty = faithfulness(model, Circuit.empty(g), clean, corrupted, metric, ablation=ablation)
    assert empty.circuit_metric == empty.empty_metric and empty.value == 0.0
    if ablation == "patching":  # every edge patched is the corrupted run
        assert empty.empty_metric == pytest.approx(empty.corrupted_metric, abs=1e-10)
    elif ablation == "zero":  # not the corrupted run: normalising by it would differ
        assert abs(empty.empty_metric - empty.corrupted_metric) > 1e-3


def gqa_and_ungrouped_copy() -> tuple[object, object]:
    """A tiny float64 grouped-query model (4 query heads on 2 key/value heads) and the same
    model ungrouped, each key/value head's weights repeated for each query head of its group:
    what EAP-IG runs on a grouped-query model."""
    from helpers import has_bridge

    if has_bridge():
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ra_lens.models import hub_offline
        from ra_lens.toy_models import hf_config, tiny_tokenizer_dir

        models = []
        torch.manual_seed(0)
        grouped_hf = AutoModelForCausalLM.from_config(hf_config("llama", 300, 32, 2, 4, 64))
        state = grouped_hf.state_dict()
        flat_cfg = hf_config("llama", 300, 32, 2, 4, 64)
        flat_cfg.num_key_value_heads = 4
        flat_hf = AutoModelForCausalLM.from_config(flat_cfg)
        flat_state = {
            k: v.view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1)
            if k.endswith(("k_proj.weight", "v_proj.weight"))
            else v
            for k, v in state.items()
        }
        flat_hf.load_state_dict(flat_state)
        tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        for hf in (grouped_hf, flat_hf):
            hf.config._attn_implementation = "eager"
            with hub_offline():
                models.append(
                    TransformerBridge.boot_transformers(
                        "tiny-llama", hf_model=hf.eval(), tokenizer=tok
                    )
                    .to(torch.float64)
                    .eval()
                )
        return models[0], models[1]
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    def build(n_kv: int | None) -> HookedTransformer:
        cfg = HookedTransformerConfig(
            d_model=32,
            d_head=8,
            n_layers=2,
            n_heads=4,
            n_key_value_heads=n_kv,
            n_ctx=64,
            d_vocab=300,
            d_mlp=64,
            act_fn="silu",
            normalization_type="RMS",
            positional_embedding_type="rotary",
            dtype=torch.float64,
            seed=0,
        )
        return HookedTransformer(cfg).eval()

    grouped, flat = build(2), build(None)
    state = {}
    for k, v in grouped.state_dict().items():
        if "attn._W_" in k or "attn._b_" in k:
            k, v = k.replace("attn._", "attn."), v.repeat_interleave(2, 0)
        state[k] = v
    flat.load_state_dict(state, strict=False)
    return grouped, flat


def test_gqa_file_read_as_the_ungrouped_model_gives_the_same_faithfulness(tmp_path: Path) -> None:
    from ra_lens.circuits import faithfulness
    from ra_lens.metrics import logit_diff

    grouped, flat = gqa_and_ungrouped_copy()
    clean, corrupted = torch.tensor([[1, 5, 7, 9, 11, 13]]), torch.tensor([[1, 5, 8, 9, 12, 13]])
    metric = logit_diff([3], [4])
    assert torch.allclose(grouped(clean), flat(clean), atol=1e-10)  # the same function
    g = Graph.from_model(grouped)
    assert (g.n_heads, g.n_kv_heads) == (4, 2)
    torch.manual_seed(3)
    circuit = EdgeScores(g, torch.randn(g.real.shape) * g.real, "eap", "denoise").top(
        g.n_edges // 3
    )
    assert any(name.endswith(("<k>", "<v>")) for name in circuit.edge_names)
    circuit.to_json(tmp_path / "gqa.json")
    as_flat = Circuit.from_json(tmp_path / "gqa.json", flat)
    value = faithfulness(grouped, circuit, clean, corrupted, metric).value
    assert abs(value - 1) > 1e-3 and abs(value) > 1e-3  # neither the full nor the empty circuit
    assert faithfulness(flat, as_flat, clean, corrupted, metric).value == pytest.approx(
        value, abs=1e-9
    )
