"""A picture of a circuit with matplotlib alone (no graphviz): layers bottom to top.

`input` sits at the bottom and `logits` on top; each layer with a node in the circuit is one row
(layers without one are left out and the rows are labelled), its heads in head order with the
MLP to the right and a little higher (it reads the heads of its layer). Only nodes of the circuit
are drawn. An edge ends at its reader: a head's query input on the left of its box, key in the
middle, value on the right (a key/value head's edge goes to each drawn query head of its group).
Every edge leaves the top of its writer's box and enters the bottom of its reader's box
vertically, arrowhead first (a curve with vertical ends, so an edge from an MLP, which sits
beside and a little above its layer's heads, still reads upwards into its reader); its colour
says the reader kind, its width |score| relative to the largest in the circuit (both in the
legend), and a dashed line a negative score.

A view on the ground floor: it draws the circuits and scores it is given and names their classes
for type hints only (`Circuit.plot` and `EdgeScores.plot` import it when called).

    >>> from ra_lens.circuits import Circuit, Graph
    >>> g = Graph(n_layers=2, n_heads=2, n_kv_heads=2, d_model=8)
    >>> c = Circuit.from_edges(g, ["input->a0.h1<q>", "a0.h1->a1.h0<k>", "a1.h0->logits"])
    >>> fig = draw_circuit(c)  # draw_circuit(c, "circuit.png") also writes it
    >>> len(fig.axes)
    1
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path as CurvePath

from ra_lens.viz._base import save_figure

# Circuits import their drawing; the drawing names them for type hints only.
if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.graph import Graph
    from ra_lens.circuits.scores import EdgeScores

__all__ = ["draw_circuit", "draw_scores"]

#: Edge colour per reader kind.
COLORS = {"q": "#1f77b4", "k": "#2ca02c", "v": "#ff7f0e", "mlp": "#9467bd", "logits": "#444444"}
_FILL = {"input": "#e0e0e0", "head": "#dbe9f6", "mlp": "#fdf1c7", "logits": "#e0e0e0"}
_BOX_W, _BOX_H, _MLP_LIFT = 0.8, 0.3, 0.5
_PORT = {"q": -0.25, "k": 0.0, "v": 0.25}


def draw_circuit(
    circuit: Circuit,
    path: str | Path | None = None,
    *,
    title: str | None = None,
    max_width: float = 4.0,
) -> Figure:
    """Draw `circuit`; write it to `path` too (PNG, SVG or PDF, by suffix) when given."""
    g = circuit.graph
    nodes = _drawn_nodes(circuit)
    layers = sorted({g.writer(n).layer for n in nodes if n not in ("input", "logits")})
    row = {layer: 1.0 + 1.2 * i for i, layer in enumerate(layers)}
    top = 1.0 + 1.2 * len(layers)
    centre = _mlp_x(g) / 2
    pos = {}
    for name in nodes:
        if name == "input":
            pos[name] = (centre, 0.0)
        elif name == "logits":
            pos[name] = (centre, top)
        else:
            w = g.writer(name)
            if w.kind == "mlp":
                pos[name] = (_mlp_x(g), row[w.layer] + _MLP_LIFT)
            else:
                pos[name] = (float(cast(int, w.head)), row[w.layer])  # a head: head is set

    width = max(6.0, 0.8 * (g.n_heads + 3))
    fig = Figure(figsize=(width, max(3.5, 0.75 * (top + 1))), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlim(-1.1, _mlp_x(g) + 0.6)
    ax.set_ylim(-0.5, top + 0.5)
    ax.axis("off")
    for layer, y in row.items():
        ax.text(-1.05, y, f"L{layer}", ha="left", va="center", fontsize=8)

    biggest = _draw_edges(ax, circuit, nodes, pos, max_width)
    for name, (x, y) in pos.items():
        kind = name if name in ("input", "logits") else g.writer(name).kind
        ax.add_patch(
            FancyBboxPatch(
                (x - _BOX_W / 2, y - _BOX_H / 2),
                _BOX_W,
                _BOX_H,
                boxstyle="round,pad=0.02",
                facecolor=_FILL[kind],
                edgecolor="black",
                linewidth=0.6,
                zorder=3,
            )
        )
        ax.text(x, y, name, ha="center", va="center", fontsize=7, zorder=4)

    handles = [Line2D([], [], color=c, lw=2, label=f"into {k}") for k, c in COLORS.items()]
    handles.append(Line2D([], [], color="black", lw=1, ls="--", label="score < 0"))
    handles += _width_handles(biggest if circuit.scores is not None else None, max_width)
    ax.legend(handles=handles, loc="upper left", fontsize=7, frameon=False, ncols=2)
    ax.set_title(
        title
        or f"{circuit.n_edges} edges, {len(nodes)} nodes ({g.n_layers} layers x {g.n_heads} heads)",
        fontsize=9,
    )
    return save_figure(fig, path)


def draw_scores(scores: EdgeScores, k: int = 20) -> Figure:
    """The k edges with the largest |score| as horizontal bars, largest on top, in MIB's sign
    (positive: the edge helps the metric), coloured by reader kind as in `draw_circuit`.

    >>> from ra_lens.circuits import EdgeScores, Graph
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    >>> s = torch.zeros(len(g.writers), len(g.readers))
    >>> s[g.edge_index("a0.h1->logits")] = 2.0
    >>> fig = draw_scores(EdgeScores(g, s, method="eap", direction="denoise"), k=3)
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()][-1]  # the largest on top
    'a0.h1->logits'
    """
    top = scores.top_edges(k)[::-1]
    helps = scores.helps  # MIB's sign, chosen by the scores
    fig = Figure(figsize=(6, max(2.0, 0.25 * len(top) + 1)), layout="constrained")
    ax = fig.add_subplot()
    colors = [COLORS[scores.graph.reader(name.split("->")[1]).kind] for name, _ in top]
    values = [float(helps[scores.graph.edge_index(name)]) for name, _ in top]
    ax.barh(range(len(top)), values, color=colors)
    ax.set_yticks(range(len(top)), [name for name, _ in top], fontsize=7)
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("score, MIB's sign (> 0: the edge helps)")
    ax.set_title(f"{scores.method}: the {len(top)} edges with the largest |score|", fontsize=9)
    return fig


def _width(size: float, biggest: float, max_width: float) -> float:
    """Line width of an edge of |score| `size` when the circuit's largest is `biggest`."""
    return 0.5 + (max_width - 0.5) * size / biggest


def _width_handles(biggest: float | None, max_width: float) -> list[Line2D]:
    """Legend entries for the edge width: the largest |score| and a quarter of it, or one width
    when the circuit carries no scores."""
    if biggest is None:
        return [Line2D([], [], color="grey", lw=0.5 + (max_width - 0.5) / 2, label="no scores: one width")]  # fmt: skip
    return [
        Line2D([], [], color="grey", lw=_width(f * biggest, biggest, max_width),
               label=f"width: |score| {f * biggest:.3g}" + (" (largest)" if f == 1 else ""))
        for f in (1.0, 0.25)
    ]  # fmt: skip


def _mlp_x(g: Graph) -> float:
    return g.n_heads + 0.2


def _drawn_nodes(circuit: Circuit) -> list[str]:
    """The circuit's nodes, plus a reader's node when no writer of the circuit owns it (an
    unpruned circuit), in graph order with logits last."""
    g = circuit.graph
    names = set(circuit.nodes)
    owner = g.reader_owners
    for r in torch.nonzero(circuit.edges.any(0)).flatten().tolist():
        owners = [g.writers[w] for w in torch.nonzero(owner[r]).flatten().tolist()]
        if owners and not names.intersection(owners):
            names.update(owners)
    if circuit.edges[:, -1].any():
        names.add("logits")
    return [n for n in g.writers if n in names] + (["logits"] if "logits" in names else [])


def _draw_edges(
    ax: Axes,
    circuit: Circuit,
    nodes: list[str],
    pos: dict[str, tuple[float, float]],
    max_width: float,
) -> float:
    """Draw every edge (the strongest last, on top); returns the largest |score| (1 without
    scores), which sets the widths."""
    g = circuit.graph
    drawn = set(nodes)
    owner = g.reader_owners
    pairs = torch.nonzero(circuit.edges).tolist()
    scores = circuit.scores
    size = (
        [abs(float(scores[w, r])) for w, r in pairs] if scores is not None else [1.0] * len(pairs)
    )
    biggest = max(size, default=1.0) or 1.0
    for i in sorted(range(len(pairs)), key=lambda i: size[i]):  # strongest drawn last, on top
        w, r = pairs[i]
        reader = g.reader(g.readers[r])
        if reader.kind == "logits":
            targets = ["logits"]
        else:
            targets = [g.writers[o] for o in torch.nonzero(owner[r]).flatten().tolist()]
            targets = [t for t in targets if t in drawn]
        x0, y0 = pos[g.writers[w]]
        lw = _width(size[i], biggest, max_width)
        negative = scores is not None and float(scores[w, r]) < 0
        for target in targets:
            x1, y1 = pos[target]
            ax.add_patch(
                FancyArrowPatch(
                    path=_edge_path(x0, y0, x1 + _PORT.get(reader.kind, 0.0), y1),
                    arrowstyle="-|>",
                    mutation_scale=5 + 2 * lw,
                    linewidth=lw,
                    linestyle="--" if negative else "-",
                    color=COLORS[reader.kind],
                    alpha=0.7,
                    zorder=2,
                )
            )
    return biggest


def _edge_path(x0: float, y0: float, x1: float, y1: float) -> CurvePath:
    """A cubic curve from the top of the box centred at (x0, y0) to the bottom of the box at
    (x1, y1), vertical at both ends: it leaves upwards and enters its reader from below, so its
    arrowhead shows outside the box even when the two boxes are nearly level (a head and its
    layer's MLP, an MLP and the next layer's heads)."""
    start, end = y0 + _BOX_H / 2, y1 - _BOX_H / 2
    middle = (start + end) / 2
    return CurvePath(
        [(x0, start), (x0, middle), (x1, middle), (x1, end)],
        [CurvePath.MOVETO, CurvePath.CURVE4, CurvePath.CURVE4, CurvePath.CURVE4],
    )
