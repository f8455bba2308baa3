"""The result contract on circuits' results: EdgeScores, Circuit and FaithfulnessCurve have
to_dict / table / save / load / plot(save=None) like ReversedAttention, on real scores of a tiny
model; every field round-trips (a tensor field added later too), damaged files are refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import arch_or_hooked
from matplotlib.figure import Figure
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ra_lens import circuits
from ra_lens.circuits import _store
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.curve import FaithfulnessCurve
from ra_lens.circuits.scores import EdgeScores
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import tiny_model

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("llama"), seed=1)


@pytest.fixture(scope="module")
def scores(model) -> EdgeScores:
    """EAP scores with every optional field filled from real runs: each pair's own scores, the
    node scores, a time."""
    metric = logit_diff([294, 52], [52, 294])
    edge = attribute(model, CLEAN, CORRUPTED, metric, method="eap")
    per_pair = torch.stack(
        [
            attribute(model, [c], [x], metric[i], method="eap").scores
            for i, (c, x) in enumerate(zip(CLEAN, CORRUPTED))
        ]
    )
    nodes = circuits.attribute_nodes(model, CLEAN, CORRUPTED, metric, method="eap")
    torch.testing.assert_close(per_pair.mean(0), edge.scores, atol=1e-6, rtol=1e-6)
    return dataclasses.replace(edge, per_pair=per_pair, node_scores=nodes.writers, seconds=0.25)


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def test_edge_scores_round_trip(scores, tmp_path):
    path = tmp_path / "scores.safetensors"
    scores.save(path)
    back = EdgeScores.load(path)
    _same(back, scores)
    assert back.top(5) == scores.top(5) and back.top(5).edge_names == scores.top(5).edge_names


def test_edge_scores_to_dict_and_table_against_a_sort(scores):
    """The top edges are the |score| order of every real edge, by brute force over names."""
    g = scores.graph
    every = [
        (g.edge_name(w, r), float(scores.scores[w, r]))
        for w in range(len(g.writers))
        for r in range(len(g.readers))
        if g.real[w, r]
    ]
    expected = sorted(every, key=lambda e: -abs(e[1]))[:6]
    report = json.loads(json.dumps(scores.to_dict(k=6)))
    assert [(e["edge"], e["score"]) for e in report["top_edges"]] == expected
    assert all(e["helps"] == e["score"] for e in report["top_edges"])  # denoise: same sign
    copies = {}  # a grouped-query model: each query head's copy of a key/value edge too
    if g.n_kv_heads < g.n_heads:
        copies = {"ungrouped_scores": [len(g.writers), len(g.ungrouped_readers)]}
    assert report["tensors"] == {
        "scores": list(scores.scores.shape),
        "per_pair": [2, *scores.scores.shape],
        "node_scores": [len(g.writers)],
        **copies,
    }
    assert report["method"] == "eap" and report["seconds"] == 0.25
    assert report["n_edges"] == g.n_edges and report["graph"]["n_kv_heads"] == g.n_kv_heads
    table = scores.table(k=6)
    assert table.count("\n| ") == 1 + 6 and f"| 1 | {expected[0][0]} |" in table


def test_a_tensor_field_added_later_round_trips(scores, tmp_path):
    """save/load iterate the dataclass's fields: a subclass with one more tensor field (as a
    per-query-head key/value field would be) needs no edit in the file code."""

    @dataclasses.dataclass
    class Wider(EdgeScores):
        extra: torch.Tensor | None = None

    wide = Wider(**{f.name: getattr(scores, f.name) for f in dataclasses.fields(scores)})
    wide.extra = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    wide.save(tmp_path / "wide.safetensors")
    back = Wider.load(tmp_path / "wide.safetensors")
    _same(back, wide)
    assert "extra" in wide.to_dict()["tensors"]
    with pytest.raises(ValueError, match="holds a Wider, not a EdgeScores"):
        EdgeScores.load(tmp_path / "wide.safetensors")


def test_circuit_round_trip_and_to_dict(scores, tmp_path):
    circuit = scores.top(12)
    assert circuit.scores is not None
    circuit.save(tmp_path / "c.safetensors")
    back = Circuit.load(tmp_path / "c.safetensors")
    _same(back, circuit)
    report = json.loads(json.dumps(circuit.to_dict()))
    assert [e["edge"] for e in report["edges"]] == circuit.edge_names
    for e in report["edges"]:
        assert e["score"] == float(scores.scores[scores.graph.edge_index(e["edge"])])
    assert report["nodes"] == circuit.nodes and report["n_edges"] == circuit.n_edges
    assert report["node_scores"] == scores.node_scores.tolist()
    assert circuit.table().count("\n| ") == 1 + circuit.n_edges  # the header, then the edges
    plain = Circuit.from_edges(scores.graph, circuit.edge_names)  # no scores at all
    plain.save(tmp_path / "plain.safetensors")
    assert Circuit.load(tmp_path / "plain.safetensors").scores is None
    with pytest.raises(ValueError, match="holds a Circuit, not a EdgeScores"):
        EdgeScores.load(tmp_path / "c.safetensors")


def test_damaged_files_are_refused_by_name(scores, tmp_path):
    path = tmp_path / "scores.safetensors"
    scores.save(path)
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()  # the header as written: only the tensors are damaged below
    for name, bad in [
        ("per_pair", tensors["per_pair"][:, :3]),
        ("node_scores", tensors["node_scores"][:-1]),
        ("scores", tensors["scores"][:-1]),
    ]:
        save_file({**tensors, name: bad.contiguous()}, tmp_path / "bad.safetensors", metadata=meta)
        with pytest.raises(ValueError, match=r"bad\.safetensors.*shape"):
            EdgeScores.load(tmp_path / "bad.safetensors")
    (tmp_path / "text.safetensors").write_text("not a file of tensors")
    with pytest.raises(ValueError, match="text.safetensors"):
        EdgeScores.load(tmp_path / "text.safetensors")
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        Circuit.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="one file"):
        scores.save(tmp_path)  # a folder


def test_faithfulness_curve_round_trip(model, scores, tmp_path):
    metric = logit_diff([294, 52], [52, 294])
    curve = circuits.faithfulness_curve(
        model, scores, CLEAN, CORRUPTED, metric, sizes=[0.1, 0.5, 1.0]
    )
    assert len(curve.seconds) == 3 and all(s >= 0 for s in curve.seconds)
    curve.save(tmp_path / "curve.json")
    back = FaithfulnessCurve.load(tmp_path / "curve.json")
    assert back == curve and back.cpr == curve.cpr and back.cmd == curve.cmd
    data = json.loads((tmp_path / "curve.json").read_text())
    data["cpr"] += 0.5  # a file whose CPR does not follow from its curve
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"edited\.json is not a faithfulness curve.*cpr"):
        FaithfulnessCurve.load(tmp_path / "edited.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list\.json is not a faithfulness curve"):
        FaithfulnessCurve.load(tmp_path / "list.json")


def test_plot_returns_a_figure_and_writes_save(model, scores, tmp_path):
    metric = logit_diff([294, 52], [52, 294])
    curve = circuits.faithfulness_curve(model, scores, CLEAN, CORRUPTED, metric, sizes=[0.5, 1.0])
    for name, result in [("scores", scores), ("circuit", scores.top(8)), ("curve", curve)]:
        assert isinstance(result.plot(), Figure)
        path = tmp_path / "figs" / f"{name}.png"
        fig = result.plot(save=path)
        assert isinstance(fig, Figure) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bars = scores.plot(k=5).axes[0]
    names = [t.get_text() for t in bars.get_yticklabels()][::-1]
    assert names == [name for name, _ in scores.top_edges(5)]
    heights = sorted((p.get_width() for p in bars.patches), key=abs, reverse=True)
    assert heights == pytest.approx([value for _, value in scores.top_edges(5)])
    path = tmp_path / "drawn.svg"
    assert isinstance(scores.top(8).draw(path), Figure) and path.read_text().startswith("<?xml")


def test_store_header_names_the_class(scores, tmp_path):
    scores.save(tmp_path / "s.safetensors")
    meta, _ = _store.read_safetensors(tmp_path / "s.safetensors", _store.HEADER, "x")
    assert meta["class"] == "EdgeScores" and meta["fields"]["graph"]["graph"]["n_layers"] == 2
