"""circuit.png (ra_lens/viz/circuit_draw.py): every edge enters its reader's box from below with an
arrowhead, from its writer (an MLP's edges read upwards too), and the legend says what an
edge's width is."""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch

from ra_lens.circuits import Circuit, Graph
from ra_lens.viz.circuit_draw import _BOX_H, _PORT, draw_circuit

EDGES = ["input->a0.h0<q>", "a0.h0->m0", "m0->a1.h0<v>", "m0->a1.h3<q>", "m0->a1.h1<k>",
         "a1.h0->m1", "m1->logits", "a1.h3->logits", "input->m0"]  # fmt: skip


def _circuit() -> Circuit:
    g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    scores = torch.zeros(len(g.writers), len(g.readers))
    for i, name in enumerate(EDGES):
        scores[g.edge_index(name)] = (i + 1) * (-1.0 if i == 2 else 1.0)
    return Circuit(g, Circuit.from_edges(g, EDGES).edges, scores=scores * g.real)


def _boxes(fig):
    """Each node's box centre, from the node labels."""
    ax = fig.axes[0]
    return {t.get_text(): t.get_position() for t in ax.texts if not t.get_text().startswith("L")}


def test_every_edge_enters_its_reader_from_below_with_an_arrowhead() -> None:
    c = _circuit()
    fig = draw_circuit(c)
    ax, boxes = fig.axes[0], _boxes(fig)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    # one arrow per edge here: each key/value head has one drawn query head (a1.h0, a1.h3)
    assert len(arrows) == len(EDGES)
    ends = set()
    for arrow in arrows:
        assert arrow.get_arrowstyle().__class__.__name__ == "CurveFilledB"  # "-|>": a head
        # the curve as given, in data coordinates (get_path() is the drawn outline, head included)
        v = arrow._path_original.vertices
        (x0, y0), (cx0, cy0), (cx1, cy1), (x1, y1) = v
        assert cx0 == x0 and cy0 > y0  # leaves the writer's top upwards
        assert cx1 == x1 and cy1 < y1  # enters the reader's bottom upwards
        writer = min(boxes, key=lambda n: np.hypot(boxes[n][0] - x0, boxes[n][1] + _BOX_H / 2 - y0))
        reader = min(boxes, key=lambda n: abs(boxes[n][1] - _BOX_H / 2 - y1) + abs(boxes[n][0] - x1) * 0.1)  # fmt: skip
        assert np.isclose(y0, boxes[writer][1] + _BOX_H / 2)
        assert np.isclose(y1, boxes[reader][1] - _BOX_H / 2)
        ends.add((writer, reader, round(x1 - boxes[reader][0], 6)))
    # m0's value edge ends at the value port (right) of a1.h0, its key edge (key/value head 1)
    # at the key port of a1.h3, its query edge at a1.h3's query port
    assert ("m0", "a1.h0", _PORT["v"]) in ends and ("m0", "a1.h3", _PORT["k"]) in ends
    assert ("m0", "a1.h3", _PORT["q"]) in ends and ("a0.h0", "m0", 0.0) in ends


def test_the_legend_gives_the_edge_width() -> None:
    fig = draw_circuit(_circuit())
    legend = fig.axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert "width: |score| 9 (largest)" in texts and "width: |score| 2.25" in texts
    assert {"into q", "into k", "into v", "into mlp", "into logits", "score < 0"} <= set(texts)
    widths = {t.get_text(): h.get_linewidth() for t, h in zip(legend.get_texts(), legend.legend_handles)}  # fmt: skip
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert max(a.get_linewidth() for a in arrows) == widths["width: |score| 9 (largest)"]
    bare = draw_circuit(Circuit.from_edges(_circuit().graph, EDGES))
    assert "no scores: one width" in [t.get_text() for t in bare.axes[0].get_legend().get_texts()]
