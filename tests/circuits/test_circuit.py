"""`circuits.circuit`: sizes count MIB's unit (ungrouped edges) unless grouped is asked for."""

from __future__ import annotations

import pytest
import torch

from ra_lens.circuits import Circuit, EdgeScores, Graph


def test_top_greedy_and_count_default_to_ungrouped_edges() -> None:
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    values = torch.randn(g.real.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # fmt: skip
    scores = EdgeScores(g, values * g.real, "eap", "denoise")
    differs = []
    for n in (40, 60, 80):
        circuit = scores.top(n)
        assert circuit == scores.top(n, units="ungrouped")
        assert circuit.count() == circuit.n_edges_ungrouped <= n
        assert scores.greedy(n) == scores.greedy(n, units="ungrouped")
        differs.append(circuit != scores.top(n, units="grouped"))
    assert any(differs)
    assert scores.top(10, units="grouped").count("grouped") <= 10


# ----------------------------------------------------------------- per-copy circuits


def _copies(g: Graph, edges: list[str]) -> torch.Tensor:
    """ungrouped_edges holding the named ungrouped edges (EAP-IG's names)."""
    names = [name for name, _ in g.ungrouped_readers]
    out = torch.zeros(len(g.writers), len(names), dtype=torch.bool)
    for edge in edges:
        writer, reader = edge.split("->")
        out[g.writer_index[writer], names.index(reader)] = True
    return out


def _eapig_prune(g: Graph, copies: torch.Tensor) -> torch.Tensor:
    """EAP-IG's `Graph.prune`, written from its description: repeatedly drop the nodes without
    an incoming edge (input aside) or an outgoing one, then the edges of dropped nodes; query
    head h's copies of <q>, <k>, <v> are head h's inputs."""
    names = [name for name, _ in g.ungrouped_readers]
    owner = [g.writer_index[n.split("<")[0]] if n != "logits" else None for n in names]
    edges = copies.clone()
    while True:
        outgoing = edges.any(1)
        incoming = torch.zeros(len(g.writers), dtype=torch.bool)
        for u, w in enumerate(owner):
            if w is not None and bool(edges[:, u].any()):
                incoming[w] = True
        incoming[g.writer_index["input"]] = True
        alive = outgoing & incoming
        readers_alive = torch.tensor([w is None or bool(alive[w]) for w in owner])
        new = edges & alive[:, None] & readers_alive[None, :]
        if torch.equal(new, edges):
            return edges
        edges = new


def test_per_copy_circuits_hold_each_copy_and_prune_as_eap_ig() -> None:
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    copies = _copies(g, ["input->a0.h0<k>", "a0.h0->a1.h3<v>", "a1.h3->logits", "a0.h1->logits"])
    circuit = Circuit.from_copies(g, copies)
    assert circuit.per_copy and circuit.n_edges_ungrouped == 4
    # edges: a key/value edge is in when any copy is (a0.h0<k> is key/value head 0's)
    assert "input->a0.h0<k>" in circuit.edge_names and "a0.h0->a1.h1<v>" in circuit.edge_names
    assert circuit.n_edges == 4
    # pruning on the ungrouped graph: a0.h1 has no input (its copy of <k> is not in)
    pruned = circuit.prune()
    assert torch.equal(pruned.copies, _eapig_prune(g, copies))
    assert pruned.to_dict()["ungrouped_edges"] == [
        "input->a0.h0<k>", "a0.h0->a1.h3<v>", "a1.h3->logits",
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for p in (0.05, 0.1, 0.3):
        draw = torch.rand(copies.shape, generator=generator) < p
        draw &= g.real[:, g.ungrouped_target]
        assert torch.equal(Circuit.from_copies(g, draw).prune().copies, _eapig_prune(g, draw))


def test_per_copy_set_operations_equality_and_files(tmp_path) -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    one = Circuit.from_copies(g, _copies(g, ["input->a0.h0<k>", "a0.h0->logits"]))
    other = Circuit.from_copies(g, _copies(g, ["input->a0.h1<k>", "a0.h1->logits"]))
    both = one | other  # both copies of input->a0.h0<k>: the grouped edge
    assert not both.per_copy and both.n_edges_ungrouped == 4
    assert (both - other) == one and (both & one) == one
    # the copies of input->a0.h0<k> agree in the grouped circuit: not equal to one's
    grouped = Circuit.from_edges(g, ["input->a0.h0<k>", "a0.h0->logits"])
    assert grouped != one and grouped.n_edges_ungrouped == 3
    agreeing = Circuit.from_copies(g, grouped.copies)
    assert not agreeing.per_copy and agreeing == grouped
    one.save(tmp_path / "one.safetensors")
    assert Circuit.load(tmp_path / "one.safetensors") == one
    one.to_json(tmp_path / "one.json")
    back = Circuit.from_json(tmp_path / "one.json", g)
    assert back == one and back.per_copy


def test_bad_copies_are_refused() -> None:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    copies = _copies(g, ["input->a0.h0<k>"])
    with pytest.raises(ValueError, match="ungrouped_edges must be a bool tensor of shape"):
        Circuit(g, torch.zeros_like(g.real), ungrouped_edges=copies[:, :3])
    with pytest.raises(ValueError, match="build the circuit with Circuit.from_copies"):
        Circuit(g, torch.zeros_like(g.real), ungrouped_edges=copies)
    stray = copies.clone()
    stray[g.writer_index["a0.h0"], 0] = True  # a0.h0 -> its own query
    with pytest.raises(ValueError, match="not edges of the graph, e.g. a0.h0->a0.h0<q>"):
        Circuit.from_copies(g, stray)
