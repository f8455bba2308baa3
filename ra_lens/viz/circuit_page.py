"""One self-contained, offline HTML page per circuit: see it, walk its sizes, open its heads.

The page (`page_assets/`: page.html, page.css and page.js, written by hand in plain JavaScript
and SVG, no library) draws the component graph by layer, input at the bottom and logits on top,
heads `a{l}.h{h}` and MLPs `m{l}` as boxes; an edge runs from its writer to its reader's port
(query left, key middle, value right of a head's box; keys dashed, values dotted), red for a
positive score and blue for a negative one, its width |score|. On a grouped-query model a key or
value reader is named by its key/value head (`a12.h0<v>` is key/value head 0 of layer 12, read by
every query head of its group) and the page says so.

The page carries MIB's two rankings (MIB's fractions of the edges by default): the circuits of the
largest signed scores, whose faithfulness curve's area is CPR, and those of the largest |score|,
whose area of |1 - f| is CMD. Both curves are drawn, each labelled by its ranking and its own area;
a ranking control chooses which circuits the size control walks. First on the page: the smallest
measured circuit reaching a faithfulness F (an input, default `target`, 0.8). Clicking a head
shows its node score, its attention pattern beside its RA on the tokens of a chosen pair, and the
edges into its query and key; clicking an edge its score (per pair where the scores keep them).
Everything the page needs is inlined in one JSON block; a Content-Security-Policy forbids any
request, so it opens offline from a file.

A view on the ground floor: `render_page` draws what it is given, the circuits as `PageStop`s,
the scores, the curve and the heads' RA (a `ReversedAttention` kept with keep="maps"), into one
typed payload (`PagePayload`, the page's JSON), and names the result classes for type hints only.
Choosing the circuits and computing RA is the caller's: `ra_lens.circuits.page`, behind
`EdgeScores.to_html`, `Circuit.to_html` and `ra-lens circuit --html`.

    >>> from ra_lens.circuits import Circuit, Graph
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    >>> circuit = Circuit.from_edges(g, ["input->a0.h1<q>", "a0.h1->logits"])
    >>> page = render_page([PageStop(circuit, "2 edges")], title="Two edges")
    >>> page.n_circuits, page.html.startswith("<!DOCTYPE html>"), "://" in page.html
    (1, True, False)
    >>> page.save("circuit.html")  # doctest: +SKIP

Size: edges are stored once for all circuits (each circuit as what it adds to and removes from
the previous one), a circuit with more than `max_drawn` edges draws its `max_drawn` largest
|score| (the page says so), and the pattern and RA of a head are stored at 8 bits (pattern:
1/255; RA: 1/127 of the head's largest |RA| on that pair) for the heads of the largest circuit
only.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens._version import __version__
from ra_lens.files import write_file

# The results import their page; the page names them for type hints only.
if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.curve import FaithfulnessCurve
    from ra_lens.circuits.graph import Graph, Units
    from ra_lens.result import ReversedAttention

# The one function; the classes it takes and gives are named from this module.
__all__ = ["render_page"]

#: Circuits with more edges draw only this many (the largest |score|): a browser draws 5,000
#: SVG paths in well under a second, and a denser picture is no longer readable anyway.
MAX_DRAWN = 5000
#: The page opens on the largest circuit with at most this many edges (or on `start=`).
OPEN_AT = 1000
#: Height of the page inside a notebook cell, in pixels.
NOTEBOOK_HEIGHT = 780
#: The faithfulness the page's "smallest circuit reaching F" box asks for first.
TARGET = 0.8
Ranking = Literal["signed", "abs", "given"]
#: The rankings a page walks: MIB's signed one (CPR's curve) and its |score| one (CMD's curve).
RANKINGS: tuple[Ranking, ...] = ("signed", "abs")


@dataclass(frozen=True)
class CircuitPage:
    """A circuit page: `html` (the whole self-contained document), `n_circuits` (stops of its
    size control). Shown inline by Jupyter (`_repr_html_`: the page in an iframe); `save(path)`
    writes it."""

    html: str
    n_circuits: int

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (atomically, folders created); returns the file written."""
        return write_file(path, self.html, make_folders=True)

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and styles apart from the notebook's own.
        return (
            f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
            f'style="width: 100%; height: {NOTEBOOK_HEIGHT}px; border: 1px solid #ddd"></iframe>'
        )

    def __repr__(self) -> str:
        return f"CircuitPage({self.n_circuits} circuits, {len(self.html) / 1e3:.0f} kB)"


@dataclass(frozen=True)
class PageStop:
    """One circuit of the size control: its label, the `fraction` of the graph's edges asked for
    (None for a circuit given as is), its faithfulness when measured, and the ranking that chose
    it ("signed", "abs", or "given" for a circuit given as is)."""

    circuit: Circuit
    label: str
    fraction: float | None = None
    faithfulness: float | None = None
    ranking: Ranking = "given"


# The page's JSON, as page.js reads it. Numbers are rounded to four significant digits (`_num`),
# None where they are NaN or absent.


class GraphEntry(TypedDict):
    """The component graph; `n_edges_total` counts the edges in `units`, the curve's x axis."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_edges: int
    n_edges_total: int
    units: str
    writers: list[str]
    readers: list[str]


class EdgesEntry(TypedDict):
    """Every edge any circuit draws, stored once: writer `w` and reader `r` indices of the graph,
    and the score `s` of each (None without scores)."""

    w: list[int]
    r: list[int]
    s: list[float | None] | None


class StopEntry(TypedDict):
    """One stop of the size control. `x`: where the curve puts it (the fraction asked, else the
    share of edges kept); `n_units`: its size in the curve's units (what "the smallest circuit"
    compares); `add` / `remove`: rows of `EdgesEntry` drawn from this stop on, and no longer."""

    label: str
    fraction: float | None
    x: float
    n_edges: int
    n_units: int
    ranking: str
    n_nodes: int
    faithfulness: float | None
    add: list[int]
    remove: list[int]


class RankingCurve(TypedDict):
    """One ranking's faithfulness curve with its own area (CPR or CMD)."""

    label: str
    area_name: str
    area: float | None
    sizes: list[float]
    values: list[float | None]
    n_edges: list[int]


class CurveEntry(TypedDict):
    cpr: float | None
    cmd: float | None
    rankings: dict[str, RankingCurve]


class PairEntry(TypedDict):
    """A prompt whose RA the heads show: its label and its tokens."""

    label: str
    tokens: list[str]


class HeadEntry(TypedDict):
    """One head on each pair: pattern as 8-bit (1/255), RA as signed 8-bit of `scale` (the
    head's largest |RA| on that pair), both row-major [query key] bytes in base64."""

    pattern: list[str]
    ra: list[str]
    scale: list[float | None]


class PagePayload(TypedDict):
    """Everything the page shows, inlined as its one JSON block."""

    summary: str
    method: str
    direction: str
    metric: str
    graph: GraphEntry
    edges: EdgesEntry
    per_pair: list[list[float | None]] | None
    node_scores: list[float | None] | None
    node_score_note: str
    stops: list[StopEntry]
    start: int
    walks: dict[str, list[int]]
    curve: CurveEntry | None
    target: float
    pairs: list[PairEntry]
    heads: dict[str, HeadEntry]


def render_page(
    stops: Sequence[PageStop],
    *,
    start: int | None = None,
    scores: Float[Tensor, "writer reader"] | None = None,
    node_scores: Float[Tensor, " writer"] | None = None,
    per_pair: Float[Tensor, "pair writer reader"] | None = None,
    curve: FaithfulnessCurve | None = None,
    ra: ReversedAttention | None = None,
    method: str = "given",
    direction: str = "",
    metric: str = "the metric",
    max_drawn: int = MAX_DRAWN,
    title: str = "Circuit",
    summary: str = "",
    target: float = TARGET,
) -> CircuitPage:
    """The page of `stops` (circuits of one graph, in the order the curve lists them).

    Args:
        stops: the circuits of the size control.
        start: the stop the page opens on (default: the largest |score| circuit with at most
            `OPEN_AT` edges, else the first stop).
        scores: edge scores [writer reader], drawn as colour and width (grey lines without).
        node_scores: [writer] scores of the nodes (default: each writer's outgoing edges' sum).
        per_pair: [pair writer reader] scores, shown per pair for the pairs of `ra`.
        curve: the faithfulness curve of the stops (its units count the edges).
        ra: the heads' RA and patterns (`reversed_attention(..., keep="maps")`, convention
            "qk") on the prompts a click on a head shows.
        method, direction: how the scores were made. metric: what the metric is, as a label.
        max_drawn: the most edges drawn per circuit (the largest |score|).
        title, summary: the page's heading and its line below.
        target: the faithfulness the page first asks its smallest circuit to reach.
    """
    if not stops:
        raise ValueError("stops is empty: pass at least one circuit to show")
    graph = stops[0].circuit.graph
    if any(stop.circuit.graph != graph for stop in stops):
        raise ValueError(f"the stops' circuits are of different graphs: pass circuits of {graph}")
    if start is not None and not 0 <= start < len(stops):
        raise ValueError(f"start={start}: pass the index of one of the {len(stops)} stops")
    if max_drawn < 1:
        raise ValueError(f"max_drawn={max_drawn}: draw at least one edge")
    if not math.isfinite(target):
        raise ValueError(f"target={target}: pass a finite faithfulness, e.g. 0.8")
    dense = None if scores is None else scores.detach().to("cpu", torch.float64)
    # the curve's x axis counts edges as MIB does (ungrouped) unless the curve says otherwise
    units: Units = "ungrouped" if curve is None else curve.units
    drawn = [_drawn(stop.circuit, dense, max_drawn) for stop in stops]
    edges = _edges(graph, drawn, dense)
    largest = max(stops, key=lambda s: s.circuit.n_edges).circuit
    pairs, heads = _ra_entries(ra, graph, [n for n in largest.nodes if n.startswith("a")])
    nodes, note = _node_entries(graph, node_scores, dense)
    payload = PagePayload(
        summary=summary,
        method=method,
        direction=direction,
        metric=metric,
        graph=_graph_entry(graph, units),
        edges=edges,
        per_pair=_per_pair_rows(per_pair, edges, len(pairs)),
        node_scores=nodes,
        node_score_note=note,
        stops=_stop_entries(stops, drawn, edges, units),
        start=_start(stops) if start is None else start,
        walks=_walks(stops),
        curve=_curve(curve),
        target=target,
        pairs=pairs,
        heads=heads,
    )
    return CircuitPage(html=_fill(payload, title), n_circuits=len(stops))


def _drawn(
    circuit: Circuit, dense: Float[Tensor, "writer reader"] | None, max_drawn: int
) -> set[int]:
    """What a circuit draws, as flat indices w * n_readers + r: all of its edges, or its
    max_drawn largest |score| (its first max_drawn without scores)."""
    flat = torch.nonzero(circuit.edges.flatten()).flatten()
    if flat.numel() > max_drawn and dense is not None:
        keys = dense.flatten()[flat].abs()
        flat = flat[torch.argsort(keys, descending=True, stable=True)[:max_drawn]]
    elif flat.numel() > max_drawn:
        flat = flat[:max_drawn]
    return set(flat.tolist())


def _edges(
    graph: Graph, drawn: list[set[int]], dense: Float[Tensor, "writer reader"] | None
) -> EdgesEntry:
    """Every drawn edge once, in flat index order."""
    stored = sorted(set().union(*drawn))
    n_readers = len(graph.readers)
    writers = [flat // n_readers for flat in stored]
    readers = [flat % n_readers for flat in stored]
    values = None if dense is None else [_num(dense[w, r]) for w, r in zip(writers, readers)]
    return EdgesEntry(w=writers, r=readers, s=values)


def _stop_entries(
    stops: Sequence[PageStop], drawn: list[set[int]], edges: EdgesEntry, units: Units
) -> list[StopEntry]:
    """Each stop with the edges it adds to and removes from the previous one (rows of `edges`)."""
    graph = stops[0].circuit.graph
    n_readers = len(graph.readers)
    row = {w * n_readers + r: i for i, (w, r) in enumerate(zip(edges["w"], edges["r"]))}
    n_total = graph.count(units)
    entries: list[StopEntry] = []
    previous: set[int] = set()
    for stop, now in zip(stops, drawn):
        size = stop.circuit.count(units)
        entries.append(
            StopEntry(
                label=stop.label,
                fraction=stop.fraction,
                x=stop.fraction if stop.fraction is not None else size / n_total,
                n_edges=stop.circuit.n_edges,
                n_units=size,
                ranking=stop.ranking,
                n_nodes=len(stop.circuit.nodes),
                faithfulness=None if stop.faithfulness is None else _num(stop.faithfulness),
                add=sorted(row[f] for f in now - previous),
                remove=sorted(row[f] for f in previous - now),
            )
        )
        previous = now
    return entries


def _start(stops: Sequence[PageStop]) -> int:
    """The last (largest) |score| circuit with at most OPEN_AT edges, else the first |score|
    one; the first stop on a page without |score| circuits."""
    by_abs = [i for i, s in enumerate(stops) if s.ranking == "abs"]
    small = [i for i in by_abs if stops[i].circuit.n_edges <= OPEN_AT]
    return small[-1] if small else by_abs[0] if by_abs else 0


def _graph_entry(graph: Graph, units: Units) -> GraphEntry:
    return GraphEntry(
        n_layers=graph.n_layers,
        n_heads=graph.n_heads,
        n_kv_heads=graph.n_kv_heads,
        n_edges=graph.n_edges,
        n_edges_total=graph.count(units),
        units=units,
        writers=graph.writers,
        readers=graph.readers,
    )


def _node_entries(
    graph: Graph,
    node_scores: Float[Tensor, " writer"] | None,
    dense: Float[Tensor, "writer reader"] | None,
) -> tuple[list[float | None] | None, str]:
    """Each writer's score and where it comes from."""
    if node_scores is not None:
        return [_num(v) for v in node_scores.tolist()], "as given with the scores"
    if dense is not None:
        # attribute_nodes' writer score: the sum of its outgoing edges' scores
        return [_num(v) for v in (dense * graph.real).sum(1).tolist()], (
            "sum of its outgoing edges' scores"
        )
    return None, "no scores"


def _per_pair_rows(
    per_pair: Float[Tensor, "pair writer reader"] | None, edges: EdgesEntry, n_pairs: int
) -> list[list[float | None]] | None:
    """The stored edges' scores on each of the first n_pairs pairs (those the heads show)."""
    if per_pair is None or n_pairs == 0:
        return None
    cut = per_pair.detach().to("cpu", torch.float64)[:n_pairs]
    return [[_num(p[w, r]) for w, r in zip(edges["w"], edges["r"])] for p in cut]


def _walks(stops: Sequence[PageStop]) -> dict[str, list[int]]:
    """For each ranking, the stops its size control walks (indices into `stops`): its own
    circuits and any circuit given as is, by edge count. A page of given circuits only has one
    walk, "given"."""
    rankings = [r for r in RANKINGS if any(s.ranking == r for s in stops)] or ["given"]
    walks: dict[str, list[int]] = {}
    for ranking in rankings:
        chosen = [i for i, s in enumerate(stops) if s.ranking in (ranking, "given")]
        walks[ranking] = sorted(chosen, key=lambda i: stops[i].circuit.n_edges)
    return walks


def _curve(curve: FaithfulnessCurve | None) -> CurveEntry | None:
    """Both of the curve's rankings, each with its own points and area: the signed ranking with
    CPR (the area under its faithfulness), the |score| ranking with CMD (the area of |1 - f|)."""
    if curve is None:
        return None
    both = (
        ("signed", "signed score", "CPR", curve.cpr, curve.signed_values, curve.signed_n_edges),
        ("abs", "|score|", "CMD", curve.cmd, curve.abs_values, curve.abs_n_edges),
    )
    rankings = {
        ranking: RankingCurve(
            label=label,
            area_name=area_name,
            area=_num(area),
            sizes=list(curve.sizes),
            values=[_num(v) for v in values],
            n_edges=list(n_edges),
        )
        for ranking, label, area_name, area, values, n_edges in both
    }
    return CurveEntry(cpr=_num(curve.cpr), cmd=_num(curve.cmd), rankings=rankings)


def _ra_entries(
    ra: ReversedAttention | None, graph: Graph, heads: list[str]
) -> tuple[list[PairEntry], dict[str, HeadEntry]]:
    """The tokens of each prompt of `ra`, and for each head its attention pattern and RA on
    each of them, 8-bit (none without `ra`)."""
    if ra is None:
        return [], {}
    maps, patterns = ra.maps, ra.patterns
    if maps is None or patterns is None:
        raise ValueError(
            f'ra holds {ra.keep}: compute it with reversed_attention(..., keep="maps")'
        )
    if ra.convention != "qk":
        raise ValueError(
            f"ra is in the {ra.convention!r} convention: the page shows dL/d(QK^T), compute it "
            'with convention="qk"'
        )
    needed = sorted({graph.writer(name).layer for name in heads})
    if maps.shape[2] != graph.n_heads or not set(needed) <= set(ra.layers):
        raise ValueError(
            f"ra holds layers {ra.layers} of {maps.shape[2]} heads, the circuit's heads are in "
            f"layers {needed} of {graph.n_heads}: compute RA on the circuit's model, all layers"
        )
    tokens = ra.str_tokens or [[str(t) for t in row] for row in ra.tokens.tolist()]
    lengths = [int(n) for n in ra.lengths]
    pairs = []
    for i, n in enumerate(lengths):
        text = "".join(tokens[i][:n]).replace("\n", " ")
        label = f"{i + 1}: {text[:60]}{'...' if len(text) > 60 else ''}"
        pairs.append(PairEntry(label=label, tokens=tokens[i][:n]))
    entries = {}
    for name in heads:
        w = graph.writer(name)
        layer = ra.layers.index(w.layer)
        entry = HeadEntry(pattern=[], ra=[], scale=[])
        for i, n in enumerate(lengths):
            pattern = patterns[i, layer, w.head, :n, :n].double().numpy()
            values = torch.tril(maps[i, layer, w.head, :n, :n]).double().numpy()
            scale = float(np.abs(values).max())
            entry["pattern"].append(_bytes(np.rint(np.clip(pattern, 0, 1) * 255).astype(np.uint8)))
            q = np.rint(values / scale * 127) if scale > 0 else np.zeros_like(values)
            entry["ra"].append(_bytes(q.astype(np.int8)))
            entry["scale"].append(_num(scale))
        entries[name] = entry
    return pairs, entries


def _fill(payload: PagePayload, title: str) -> str:
    """The payload inlined, with the script and styles, into the template."""
    parts = {
        "TITLE": html.escape(title),
        "VERSION": __version__,
        "CSS": _template("page.css"),
        # "<" escaped inside the JSON (still the same JSON) so no text can close the script tag
        "DATA": json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c"),
        "JS": _template("page.js"),
    }
    # One pass, so that nothing substituted is itself searched for placeholders.
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], _template("page.html"))


def _bytes(array: np.ndarray) -> str:
    """Row-major bytes of an 8-bit array, base64 (decoded by the page's `decode`)."""
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _num(value: float | Tensor) -> float | None:
    """Four significant digits (enough for a picture and a table); None for NaN."""
    x = float(value)
    return None if math.isnan(x) else float(f"{x:.4g}")


def _template(name: str) -> str:
    # typeshed's Traversable.joinpath takes several parts from Python 3.11; on 3.10 files()
    # gives a pathlib or zipfile Path, whose joinpath takes several too
    return resources.files("ra_lens.viz").joinpath("page_assets", name).read_text("utf-8")  # type: ignore[call-arg]
