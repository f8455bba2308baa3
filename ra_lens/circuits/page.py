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

    >>> from ra_lens import circuits
    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = ["The capital of France is"], ["The capital of Italy is"]
    >>> metric = logit_diff([294], [52])
    >>> scores = circuits.attribute(model, clean, corrupted, metric, method="eap")
    >>> page = scores_page(scores, model=model, clean=clean, metric=metric)
    >>> page.n_circuits, page.html.startswith("<!DOCTYPE html>"), "://" in page.html
    (20, True, False)
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
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens._version import __version__
from ra_lens.circuits.graph import Graph, Units
from ra_lens.circuits.mib import MIB_FRACTIONS, ChosenCircuits, check_fractions, chosen_for
from ra_lens.types import HookedModel, MetricFn, Tokens

# Results import their page; the page names them for type hints only.
if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.curve import FaithfulnessCurve
    from ra_lens.circuits.scores import EdgeScores

#: Circuits with more edges draw only this many (the largest |score|): a browser draws 5,000
#: SVG paths in well under a second, and a denser picture is no longer readable anyway.
MAX_DRAWN = 5000
#: The page opens on the largest circuit with at most this many edges (or on `circuit=`).
OPEN_AT = 1000
#: Height of the page inside a notebook cell, in pixels.
NOTEBOOK_HEIGHT = 780
#: The faithfulness the page's "smallest circuit reaching F" box asks for first.
TARGET = 0.8
#: The rankings a page walks: MIB's signed one (CPR's curve) and its |score| one (CMD's curve).
RANKINGS = ("signed", "abs")


@dataclass(frozen=True)
class CircuitPage:
    """A circuit page: `html` (the whole self-contained document), `n_circuits` (stops of its
    size control). Shown inline by Jupyter (`_repr_html_`: the page in an iframe); `save(path)`
    writes it."""

    html: str
    n_circuits: int

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (atomically, folders created); returns the file written."""
        from ra_lens.files import write_file

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
class _Stop:
    """One circuit of the size control: `fraction` of the graph's edges asked for (None for a
    circuit given as is), its label, its faithfulness when measured, and the ranking that chose
    it ("signed", "abs", or "given" for a circuit given as is)."""

    circuit: Circuit
    label: str
    fraction: float | None
    faithfulness: float | None
    ranking: str = "given"


def scores_page(
    scores: EdgeScores,
    *,
    curve: FaithfulnessCurve | None = None,
    sizes: Sequence[float] | None = None,
    selection: str = "top",
    circuit: Circuit | None = None,
    faithfulness: float | None = None,
    model: HookedModel | None = None,
    clean: Tokens | None = None,
    metric: MetricFn | None = None,
    n_pairs: int = 3,
    max_drawn: int = MAX_DRAWN,
    title: str | None = None,
    target: float = TARGET,
    chosen: ChosenCircuits | None = None,
) -> CircuitPage:
    """The page of the circuits `scores` picks at each size (`EdgeScores.to_html`).

    Args:
        scores: edge scores [writer reader].
        curve: a faithfulness curve measured on these scores: its sizes and selection give the
            circuits, its values the curve beside them (checked: each circuit's edge count).
        sizes: fractions of the graph's edges without a curve (default MIB's 0.1 % .. 100 %).
        selection: "top" or "greedy", without a curve.
        circuit: one more circuit (e.g. the one a run saved), placed by its edge count; the page
            opens on it. faithfulness: its faithfulness, marked on the curve.
        model, clean, metric: to show each head's attention pattern and RA
            (`ra_lens.reversed_attention` of `metric`) on the first `n_pairs` clean prompts.
        max_drawn: the most edges drawn per circuit (the largest |score|).
        title: the page's title.
        target: the faithfulness the page first asks its smallest circuit to reach (changeable
            on the page).
        chosen: circuits already chosen from these scores by the selection (e.g. by the
            curve's `faithfulness_curve(..., chosen=...)`), taken instead of choosing again.
    """
    graph = scores.graph
    units: Units = "ungrouped"
    if curve is not None:
        units = curve.units
        total = graph.count(units)
        if curve.n_total != total:
            raise ValueError(
                f"the curve is over {curve.n_total} edges, the scores' graph has {total} ({units})"
            )
        sizes, selection = curve.sizes, curve.selection
    fractions = check_fractions(MIB_FRACTIONS if sizes is None else sizes)
    if selection not in ("top", "greedy"):
        raise ValueError(f"selection={selection!r}: expected 'top' or 'greedy'")
    kept = chosen_for(scores, chosen, selection)  # each circuit chosen once per scores
    stops = []
    for ranking in RANKINGS:  # MIB's circuits of both rankings, int(k * N) edges in MIB's units
        absolute = ranking == "abs"
        picked = kept.at(fractions, absolute=absolute, units=units)
        for i, (k, at_k) in enumerate(zip(fractions, picked)):
            value = None
            if curve is not None:
                counts = curve.abs_n_edges if absolute else curve.signed_n_edges
                if counts[i] != at_k.count(units):
                    raise ValueError(
                        f"the curve's circuit at {k:g} ({ranking} ranking) has {counts[i]} edges, "
                        f"these scores give {at_k.count(units)}: pass the curve measured on "
                        "these scores"
                    )
                value = (curve.abs_values if absolute else curve.signed_values)[i]
            label = f"{100 * k:g} % ({at_k.n_edges:,} edges)"
            stops.append(_Stop(at_k, label, k, value, ranking))
    # opens on the largest |score| circuit with at most OPEN_AT edges (stops[n:] are |score|)
    n = len(fractions)
    start = n + max((i for i in range(n) if stops[n + i].circuit.n_edges <= OPEN_AT), default=0)
    if circuit is not None:
        if circuit.graph != graph:
            raise ValueError(f"circuit is for {circuit.graph}, the scores for {graph}")
        start = len(stops)
        label = f"the chosen circuit ({circuit.n_edges:,} edges)"
        stops.append(_Stop(circuit, label, None, faithfulness))
    summary = (
        f"{scores.method} edge scores ({scores.direction}), circuits by {selection} signed score "
        f"and by {selection} |score| at {len(fractions)} sizes, pruned to input -> logits paths"
    )
    return _page(
        graph,
        stops,
        start,
        scores=scores.scores,
        node_scores=scores.node_scores,
        per_pair=scores.per_pair,
        curve=curve,
        method=scores.method,
        direction=scores.direction,
        ra=(model, clean, metric, n_pairs),
        max_drawn=max_drawn,
        title=title or f"Circuit: {scores.method} edge scores",
        summary=summary,
        target=target,
    )


def circuit_page(
    circuit: Circuit,
    *,
    faithfulness: float | None = None,
    model: HookedModel | None = None,
    clean: Tokens | None = None,
    metric: MetricFn | None = None,
    n_pairs: int = 3,
    max_drawn: int = MAX_DRAWN,
    title: str | None = None,
) -> CircuitPage:
    """The page of one circuit (`Circuit.to_html`); arguments as `scores_page`. The edges'
    scores are the circuit's own (`circuit.scores`), uniform grey lines without them."""
    stop = _Stop(circuit, f"{circuit.n_edges:,} edges", None, faithfulness)
    return _page(
        circuit.graph,
        [stop],
        0,
        scores=circuit.scores,
        node_scores=circuit.node_scores,
        per_pair=None,
        curve=None,
        method="given",
        direction="",
        ra=(model, clean, metric, n_pairs),
        max_drawn=max_drawn,
        title=title or f"Circuit: {circuit.n_edges:,} edges",
        summary=f"one circuit of {circuit.graph.n_edges:,} edges' graph",
        target=TARGET,
    )


def _page(
    graph: Graph,
    stops: list[_Stop],
    start: int,
    *,
    scores: Float[Tensor, "writer reader"] | None,
    node_scores: Float[Tensor, " writer"] | None,
    per_pair: Float[Tensor, "pair writer reader"] | None,
    curve: FaithfulnessCurve | None,
    method: str,
    direction: str,
    ra: tuple[Any, Any, Any, int],
    max_drawn: int,
    title: str,
    summary: str,
    target: float,
) -> CircuitPage:
    """Assemble the page's JSON and inline it, with the script and styles, into the template."""
    if max_drawn < 1:
        raise ValueError(f"max_drawn={max_drawn}: draw at least one edge")
    if not math.isfinite(target):
        raise ValueError(f"target={target}: pass a finite faithfulness, e.g. 0.8")
    n_readers = len(graph.readers)
    dense = None if scores is None else scores.detach().to("cpu", torch.float64)

    # What each circuit draws, as flat indices w * n_readers + r: all of its edges, or its
    # max_drawn largest |score|.
    drawn_sets: list[set[int]] = []
    for stop in stops:
        flat = torch.nonzero(stop.circuit.edges.flatten()).flatten()
        if flat.numel() > max_drawn and dense is not None:
            keys = dense.flatten()[flat].abs()
            flat = flat[torch.argsort(keys, descending=True, stable=True)[:max_drawn]]
        elif flat.numel() > max_drawn:
            flat = flat[:max_drawn]
        drawn_sets.append(set(flat.tolist()))
    stored = sorted(set().union(*drawn_sets))
    row = {flat: i for i, flat in enumerate(stored)}
    writers = [flat // n_readers for flat in stored]
    readers = [flat % n_readers for flat in stored]
    edge_scores = None if dense is None else [_num(dense[w, r]) for w, r in zip(writers, readers)]

    payload_stops: list[dict[str, Any]]
    previous: set[int]
    payload_stops, previous = [], set()
    # the curve's x axis counts edges as MIB does (ungrouped) unless the curve says otherwise
    units = "ungrouped" if curve is None else curve.units
    n_total = graph.count(units)
    for stop, drawn in zip(stops, drawn_sets):
        payload_stops.append(
            {
                "label": stop.label,
                "fraction": stop.fraction,
                # where the curve puts it: the fraction asked, else the share of edges kept
                "x": stop.fraction
                if stop.fraction is not None
                else stop.circuit.count(units) / n_total,
                "n_edges": stop.circuit.n_edges,
                # its size in the curve's units (what "the smallest circuit" compares)
                "n_units": stop.circuit.count(units),
                "ranking": stop.ranking,
                "n_nodes": len(stop.circuit.nodes),
                "faithfulness": None if stop.faithfulness is None else _num(stop.faithfulness),
                "add": sorted(row[f] for f in drawn - previous),
                "remove": sorted(row[f] for f in previous - drawn),
            }
        )
        previous = drawn

    if node_scores is not None:
        nodes, note = [_num(v) for v in node_scores.tolist()], "as given with the scores"
    elif dense is not None:
        # attribute_nodes' writer score: the sum of its outgoing edges' scores
        nodes = [_num(v) for v in (dense * graph.real).sum(1).tolist()]
        note = "sum of its outgoing edges' scores"
    else:
        nodes, note = None, "no scores"

    model, clean, metric, n_pairs = ra
    largest = max(stops, key=lambda s: s.circuit.n_edges).circuit
    heads = [n for n in largest.nodes if n.startswith("a")]
    pairs: list[dict[str, Any]]
    head_maps: dict[str, dict[str, Any]]
    pairs, head_maps, metric_name = [], {}, ""
    if model is not None:
        if clean is None or metric is None:
            raise ValueError("pass clean= and metric= with model= (for the heads' RA)")
        pairs, head_maps = _head_maps(model, clean, metric, graph, heads, n_pairs)
        metric_name = _metric_name(metric)
    elif clean is not None or metric is not None:
        raise ValueError("pass model= with clean= and metric= (for the heads' RA)")

    pair_rows = None
    if per_pair is not None and pairs:
        cut = per_pair.detach().to("cpu", torch.float64)[: len(pairs)]
        pair_rows = [[_num(p[w, r]) for w, r in zip(writers, readers)] for p in cut]

    data = {
        "summary": summary,
        "method": method,
        "direction": direction,
        "metric": metric_name or "the metric",
        "graph": {
            "n_layers": graph.n_layers,
            "n_heads": graph.n_heads,
            "n_kv_heads": graph.n_kv_heads,
            "n_edges": graph.n_edges,
            "n_edges_total": n_total,
            "units": units,
            "writers": graph.writers,
            "readers": graph.readers,
        },
        "edges": {"w": writers, "r": readers, "s": edge_scores},
        "per_pair": pair_rows,
        "node_scores": nodes,
        "node_score_note": note,
        "stops": payload_stops,
        "start": start,
        "walks": _walks(stops),
        "curve": _curve(curve),
        "target": target,
        "pairs": pairs,
        "heads": head_maps,
    }
    text = _template("page.html")
    parts = {
        "TITLE": html.escape(title),
        "VERSION": __version__,
        "CSS": _template("page.css"),
        # "<" escaped inside the JSON (still the same JSON) so no text can close the script tag
        "DATA": json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c"),
        "JS": _template("page.js"),
    }
    # One pass, so that nothing substituted is itself searched for placeholders.
    page = re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], text)
    return CircuitPage(html=page, n_circuits=len(stops))


def _walks(stops: list[_Stop]) -> dict[str, list[int]]:
    """For each ranking, the stops its size control walks (indices into `stops`): its own
    circuits and any circuit given as is, by edge count. A page of given circuits only has one
    walk, "given"."""
    rankings = [r for r in RANKINGS if any(s.ranking == r for s in stops)] or ["given"]
    walks = {}
    for ranking in rankings:
        chosen = [i for i, s in enumerate(stops) if s.ranking in (ranking, "given")]
        walks[ranking] = sorted(chosen, key=lambda i: stops[i].circuit.n_edges)
    return walks


def _curve(curve: FaithfulnessCurve | None) -> dict[str, Any] | None:
    """Both of the curve's rankings, each with its own points and area: the signed ranking with
    CPR (the area under its faithfulness), the |score| ranking with CMD (the area of |1 - f|)."""
    if curve is None:
        return None
    return {
        "cpr": _num(curve.cpr),
        "cmd": _num(curve.cmd),
        "rankings": {
            "signed": {
                "label": "signed score",
                "area_name": "CPR",
                "area": _num(curve.cpr),
                "sizes": list(curve.sizes),
                "values": [_num(v) for v in curve.signed_values],
                "n_edges": list(curve.signed_n_edges),
            },
            "abs": {
                "label": "|score|",
                "area_name": "CMD",
                "area": _num(curve.cmd),
                "sizes": list(curve.sizes),
                "values": [_num(v) for v in curve.abs_values],
                "n_edges": list(curve.abs_n_edges),
            },
        },
    }


def _head_maps(
    model: HookedModel,
    clean: Tokens,
    metric: MetricFn,
    graph: Graph,
    heads: list[str],
    n_pairs: int,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The first n_pairs clean prompts' tokens, and for each head its attention pattern and RA
    (`reversed_attention` of `metric`, keep="maps", convention "qk") on each of them, 8-bit."""
    from ra_lens.core import reversed_attention

    if Graph.from_model(model) != graph:
        raise ValueError(f"the model's graph {Graph.from_model(model)} is not the page's {graph}")
    if n_pairs < 1:
        raise ValueError(f"n_pairs={n_pairs}: show at least one pair")
    batch = capture.to_batch(model, clean)
    k = min(n_pairs, batch.tokens.shape[0])
    # A metric of ra_lens.metrics is cut to the chosen prompts; any other callable gets them all.
    if hasattr(metric, "__getitem__"):
        metric = metric[0:k]
    else:
        k = batch.tokens.shape[0]
    width = int(batch.lengths[:k].max())
    part = capture.Batch(batch.tokens[:k, :width], batch.lengths[:k])
    result = reversed_attention(model, part, metric, keep="maps")  # leaves the model as found
    tokens = result.str_tokens or [[str(t) for t in row] for row in part.tokens.tolist()]
    pairs = []
    for i in range(k):
        n = int(part.lengths[i])
        text = "".join(tokens[i][:n]).replace("\n", " ")
        pairs.append(
            {
                "label": f"{i + 1}: {text[:60]}{'...' if len(text) > 60 else ''}",
                "tokens": tokens[i][:n],
            }
        )
    head_maps = {}
    for name in heads:
        w = graph.writer(name)
        layer = result.layers.index(w.layer)
        entry: dict[str, list[Any]] = {"pattern": [], "ra": [], "scale": []}
        for i in range(k):
            n = int(part.lengths[i])
            # keep="maps" keeps both
            pattern = cast(Tensor, result.patterns)[i, layer, w.head, :n, :n].double().numpy()
            ra = torch.tril(cast(Tensor, result.maps)[i, layer, w.head, :n, :n]).double().numpy()
            scale = float(np.abs(ra).max())
            entry["pattern"].append(_bytes(np.rint(np.clip(pattern, 0, 1) * 255).astype(np.uint8)))
            q = np.rint(ra / scale * 127) if scale > 0 else np.zeros_like(ra)
            entry["ra"].append(_bytes(q.astype(np.int8)))
            entry["scale"].append(_num(scale))
        head_maps[name] = entry
    return pairs, head_maps


def _bytes(array: np.ndarray) -> str:
    """Row-major bytes of an 8-bit array, base64 (decoded by the page's `decode`)."""
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _num(value: float | Tensor) -> float | None:
    """Four significant digits (enough for a picture and a table); None for NaN."""
    x = float(value)
    return None if math.isnan(x) else float(f"{x:.4g}")


def _metric_name(metric: MetricFn) -> str:
    from ra_lens.metrics import LogitDiff

    if isinstance(metric, LogitDiff):
        return "M = logit(answer) - logit(wrong)"
    return f"M = {type(metric).__name__}"


def _template(name: str) -> str:
    # typeshed's Traversable.joinpath takes several parts from Python 3.11; on 3.10 files()
    # gives a pathlib or zipfile Path, whose joinpath takes several too
    return resources.files("ra_lens.circuits").joinpath("page_assets", name).read_text("utf-8")  # type: ignore[call-arg]
