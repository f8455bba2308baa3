"""`circuits.circuit`: sizes count MIB's unit (ungrouped edges) unless grouped is asked for."""

from __future__ import annotations

import torch

from ra_lens.circuits import EdgeScores, Graph


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
