"""Circuits over a component graph (see `graph.py`): sets of edges, combined, pruned, drawn and
written to files. `EdgeScores` (`scores.py`) chooses them from edge scores.

    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> c = Circuit.from_edges(g, ["input->a0.h0<q>", "a0.h0->logits", "a0.h1->logits"])
    >>> c.prune().edge_names  # a0.h1 is not reached from input
    ['input->a0.h0<q>', 'a0.h0->logits']

Pruning: an edge w -> r is kept when w is reached from `input` and r leads to `logits` through
edges of the circuit. A writer is reached when it is `input` or one of its readers has an
incoming edge from a reached writer; a head's readers are its `<q>` and the `<k>`/`<v>` of its
key/value head (shared by the query heads of a group on a grouped-query model). A reader leads to
`logits` when it is `logits` or belongs to a writer with an outgoing edge to a reader that does.

Per-copy circuits (grouped-query models): `ungrouped_edges` [writer, ureader] says which query
heads' copies of each key/value edge are in the circuit, as EAP-IG's ungrouped graph holds them
(`EdgeScores.top(n, own_copies=True)`, or an EAP-IG file whose groups disagree). `edges` then
holds a key/value edge when ANY of its copies is in; edge patching gives each query head its own
key and value (`faithfulness`), and pruning runs on the ungrouped graph as EAP-IG's `prune`
(query head h's copy of a key/value input belongs to head h alone). A circuit whose copies of
every edge agree holds `ungrouped_edges=None`: it is the grouped circuit, patched as one unit.

    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> u = torch.zeros(len(g.writers), len(g.ungrouped_readers), dtype=torch.bool)
    >>> names = [name for name, _ in g.ungrouped_readers]
    >>> for w, r in [("input", "a0.h0<k>"), ("input", "a0.h0<q>"), ("a0.h0", "logits")]:
    ...     u[g.writer_index[w], names.index(r)] = True
    >>> c = Circuit.from_copies(g, u)  # head 0's copy of the key input, not head 1's
    >>> c.edge_names, c.n_edges_ungrouped, c.per_copy
    (['input->a0.h0<q>', 'input->a0.h0<k>', 'a0.h0->logits'], 3, True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.circuits.checks import check_copies, check_extras, check_finite
from ra_lens.circuits.graph import UNITS, Graph, Units
from ra_lens.types import HookedModel, MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ra_lens.viz.circuit_page import CircuitPage


@dataclass(eq=False)
class Circuit:
    """A set of edges of a graph: `edges[w, r]` True where edge w -> r is in the circuit.

    Optional: `scores` [writer, reader] (the edge scores it was chosen from, written to files),
    `node_scores` [writer] and `ungrouped_scores` [writer, ureader] (each query head's copy of a
    key/value edge with its own score, `EdgeScores.ungrouped_scores`; written to files instead
    of equal shares), `ungrouped_edges` [writer, ureader] (per-copy membership, module
    docstring; build with `from_copies`). Set operations (`|`, `&`, `-`) act on edges (on each
    copy when either side is per copy) and do not prune (a union of pruned circuits is pruned;
    call `.prune()` after `&` or `-` if needed); the result keeps the scores only when both
    sides carry the same ones. `==` compares graph, edges and copies."""

    graph: Graph
    edges: Bool[Tensor, "writer reader"]
    scores: Float[Tensor, "writer reader"] | None = field(default=None, repr=False)
    node_scores: Float[Tensor, " writer"] | None = field(default=None, repr=False)
    ungrouped_scores: Float[Tensor, "writer ureader"] | None = field(default=None, repr=False)
    ungrouped_edges: Bool[Tensor, "writer ureader"] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        shape = (len(self.graph.writers), len(self.graph.readers))
        if tuple(self.edges.shape) != shape or self.edges.dtype != torch.bool:
            raise ValueError(
                f"edges must be a bool tensor of shape {shape} ([writer, reader]), got "
                f"{self.edges.dtype} {tuple(self.edges.shape)}"
            )
        self.edges = self.edges.detach().cpu()
        stray = self.edges & ~self.graph.real
        if stray.any():
            w, r = torch.nonzero(stray)[0].tolist()
            raise ValueError(
                f"{int(stray.sum())} entries of edges are not edges of the graph, e.g. "
                f"{self.graph.edge_name(w, r)} (the writer comes after the reader)"
            )
        if self.scores is not None and tuple(self.scores.shape) != shape:
            raise ValueError(f"scores has shape {tuple(self.scores.shape)}, expected {shape}")
        if self.scores is not None:
            check_finite(self.graph, self.scores, "scores")
        check_extras(self.graph, None, self.node_scores)
        if self.ungrouped_scores is not None:
            if self.scores is None:
                raise ValueError("ungrouped_scores need the grouped scores they add up to")
            check_copies(self.graph, self.ungrouped_scores, self.scores)
        if self.ungrouped_edges is not None:
            self.ungrouped_edges = _checked_copies(self.graph, self.edges, self.ungrouped_edges)

    @classmethod
    def from_copies(
        cls,
        graph: Graph,
        ungrouped_edges: Bool[Tensor, "writer ureader"],
        *,
        prune: bool = False,
        **fields: Any,
    ) -> Circuit:
        """The circuit of these ungrouped edges (EAP-IG's layout, `graph.ungrouped_readers`):
        `edges` holds an edge when any of its copies is in. prune=True first keeps the copies
        on a path from input to logits in EAP-IG's ungrouped graph (as its `prune`). `fields`:
        scores, node_scores, ungrouped_scores."""
        copies = ungrouped_edges.detach().cpu().to(torch.bool)
        if prune:
            copies = _on_a_path(copies, ungrouped_owners(graph), graph)
        return cls(graph, _any_copy(graph, copies), ungrouped_edges=copies, **fields)

    @property
    def per_copy(self) -> bool:
        """True when the query heads of some group hold different copies of a key/value edge
        (`ungrouped_edges`), so that patching gives each query head its own key and value."""
        return self.ungrouped_edges is not None

    @property
    def copies(self) -> Bool[Tensor, "writer ureader"]:
        """Membership of every edge of EAP-IG's ungrouped graph: `ungrouped_edges`, or each
        edge's copies as the grouped edge (every copy in or every copy out)."""
        if self.ungrouped_edges is not None:
            return self.ungrouped_edges
        return self.edges[:, self.graph.ungrouped_target]

    @classmethod
    def full(cls, graph: Graph) -> Circuit:
        """Every edge of the graph (faithfulness 1 by construction)."""
        return cls(graph, graph.real.clone())

    @classmethod
    def empty(cls, graph: Graph) -> Circuit:
        """No edge (faithfulness 0 by construction)."""
        return cls(graph, torch.zeros_like(graph.real))

    @classmethod
    def from_edges(
        cls, graph: Graph, names: Validated[list[str]], *, prune: bool = False
    ) -> Circuit:
        """The circuit of the named edges (`a0.h1->a3.h2<q>`, k/v per key/value head)."""
        if isinstance(names, str):
            raise TypeError("names must be a list of edge names, not one string: wrap it in [ ]")
        edges = torch.zeros_like(graph.real)
        for name in names:
            edges[graph.edge_index(name)] = True
        circuit = cls(graph, edges)
        return circuit.prune() if prune else circuit

    @property
    def n_edges(self) -> int:
        """Edges in the circuit (a grouped key/value edge counts once)."""
        return int(self.edges.sum())

    @property
    def n_edges_ungrouped(self) -> int:
        """Edges in the circuit counted in EAP-IG's ungrouped graph (MIB's count): a key/value
        edge once per query head of its group that holds it, as it is written to files."""
        if self.ungrouped_edges is not None:
            return int(self.ungrouped_edges.sum())
        return int((self.edges.long() * self.graph.copies[None, :]).sum())

    def count(self, units: Validated[Units] = "ungrouped") -> int:
        """`n_edges_ungrouped` (default, MIB's unit) or `n_edges` (units="grouped")."""
        if units not in UNITS:
            raise ValueError(f"units={units!r}: expected 'grouped' or 'ungrouped'")
        return self.n_edges if units == "grouped" else self.n_edges_ungrouped

    @property
    def edge_names(self) -> list[str]:
        """The edges' names, writer by writer in graph order."""
        return [self.graph.edge_name(w, r) for w, r in torch.nonzero(self.edges).tolist()]

    @property
    def nodes(self) -> list[str]:
        """The writers with an outgoing edge, in graph order, then `logits` when an edge reaches
        it. On a pruned circuit these are the nodes on a path from input to logits."""
        names = [w for w, out in zip(self.graph.writers, self.edges.any(1).tolist()) if out]
        return names + (["logits"] if self.edges[:, -1].any() else [])

    def prune(self) -> Circuit:
        """Only the edges on a path from `input` to `logits` (see the module docstring); a
        per-copy circuit is pruned on the ungrouped graph, as EAP-IG prunes."""
        g = self.graph
        extras: dict[str, Any] = dict(
            scores=self.scores,
            node_scores=self.node_scores,
            ungrouped_scores=self.ungrouped_scores,
        )
        if self.ungrouped_edges is not None:
            return Circuit.from_copies(g, self.ungrouped_edges, prune=True, **extras)
        return Circuit(g, _on_a_path(self.edges, g.reader_owners, g), **extras)

    def _combine(self, other: Circuit, op: Callable[[Tensor, Tensor], Tensor]) -> Circuit:
        if other.graph != self.graph:
            raise ValueError(
                f"the circuits belong to different graphs: {self.graph} and {other.graph}"
            )

        def same(a: Tensor | None, b: Tensor | None) -> Tensor | None:
            return a if a is not None and b is not None and torch.equal(a, b) else None

        scores = same(self.scores, other.scores)
        extras: dict[str, Any] = dict(
            scores=scores,
            node_scores=same(self.node_scores, other.node_scores),
            ungrouped_scores=None
            if scores is None
            else same(self.ungrouped_scores, other.ungrouped_scores),
        )
        if self.per_copy or other.per_copy:
            return Circuit.from_copies(self.graph, op(self.copies, other.copies), **extras)
        return Circuit(self.graph, op(self.edges, other.edges), **extras)

    def __or__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a | b)

    def __and__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a & b)

    def __sub__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a & ~b)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Circuit):
            return NotImplemented
        return (
            self.graph == other.graph
            and torch.equal(self.edges, other.edges)
            and torch.equal(self.copies, other.copies)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside

    def __repr__(self) -> str:
        g = self.graph
        return (
            f"Circuit({self.n_edges} of {g.n_edges} edges, {len(self.nodes)} nodes; "
            f"{g.n_layers} layers x {g.n_heads} heads, {g.n_kv_heads} kv heads)"
        )

    def to_json(self, path: str | Path) -> None:
        """Write the circuit in EAP-IG's graph JSON layout (see `eapig_json.py`) with the one file
        writer, `ra_lens.files.write_file` (atomic, through symlinks, the file's mode kept)."""
        from ra_lens.circuits.eapig_json import write_json

        write_json(self, path)

    @classmethod
    def from_json(
        cls,
        path: str | Path,
        model_or_graph: Validated[HookedModel | Graph],
        *,
        kv: Literal["copies", "strict", "any", "all"] = "copies",
    ) -> Circuit:
        """Read a circuit from an EAP-IG graph JSON file for this model (see `eapig_json.py`)."""
        from ra_lens.circuits.eapig_json import read_fields

        g = (
            model_or_graph
            if isinstance(model_or_graph, Graph)
            else Graph.from_model(model_or_graph)
        )
        return cls(g, **read_fields(path, g, kv=kv))

    def plot(
        self, save: str | Path | None = None, *, title: str | None = None, max_width: float = 4.0
    ) -> Figure:
        """A picture of the circuit (see `ra_lens.viz.circuit_draw`), also written to `save` when
        given (PNG, SVG or PDF by suffix); `max_width`: line width of the edge with the largest
        |score|."""
        from ra_lens.viz.circuit_draw import draw_circuit

        return draw_circuit(self, save, title=title, max_width=max_width)

    def draw(
        self, path: str | Path | None = None, *, title: str | None = None, max_width: float = 4.0
    ) -> Figure:
        """`plot` under its earlier name."""
        return self.plot(path, title=title, max_width=max_width)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: the graph, edge and node counts, and every edge with its
        score (None without scores).

        >>> g = Graph(n_layers=1, n_heads=1, n_kv_heads=1, d_model=8)
        >>> c = Circuit.from_edges(g, ["input->a0.h0<q>", "a0.h0->logits"])
        >>> c.to_dict()["edges"], c.to_dict()["nodes"]
        ([{'edge': 'input->a0.h0<q>', 'score': None}, {'edge': 'a0.h0->logits', 'score': None}], ['input', 'a0.h0', 'logits'])
        """  # noqa: E501
        where = torch.nonzero(self.edges).tolist()
        return {
            "graph": dataclasses.asdict(self.graph),
            "n_edges": self.n_edges,
            "n_edges_ungrouped": self.n_edges_ungrouped,
            "nodes": self.nodes,
            "edges": [
                {
                    "edge": self.graph.edge_name(w, r),
                    "score": None if self.scores is None else float(self.scores[w, r]),
                }
                for w, r in where
            ],
            "node_scores": None if self.node_scores is None else self.node_scores.tolist(),
            **({"ungrouped_edges": self._copy_names()} if self.per_copy else {}),
        }

    def _copy_names(self) -> list[str]:
        """The names of the ungrouped edges in a per-copy circuit (EAP-IG's names)."""
        g, readers = self.graph, self.graph.ungrouped_readers
        return [f"{g.writers[w]}->{readers[u][0]}" for w, u in torch.nonzero(self.copies).tolist()]

    def table(self) -> str:
        """A Markdown table of the circuit's edges with their scores, in graph order."""
        rows = [repr(self), "", "| edge | score |", "|---|---:|"]
        for edge in self.to_dict()["edges"]:
            score = "" if edge["score"] is None else f"{edge['score']:.4g}"
            rows.append(f"| {edge['edge']} | {score} |")
        return "\n".join(rows)

    def save(self, path: str | Path) -> None:
        """Write the circuit with its graph and scores to one safetensors file (lossless; for
        EAP-IG's JSON layout use `to_json`).

        >>> import tempfile
        >>> g = Graph(n_layers=1, n_heads=1, n_kv_heads=1, d_model=8)
        >>> c = Circuit.from_edges(g, ["input->a0.h0<q>", "a0.h0->logits"])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     c.save(f"{folder}/circuit.safetensors")
        ...     back = Circuit.load(f"{folder}/circuit.safetensors")
        >>> back == c, back.edge_names
        (True, ['input->a0.h0<q>', 'a0.h0->logits'])
        """
        from ra_lens.circuits import _store

        _store.save(self, path)

    @classmethod
    def load(cls, path: str | Path) -> Circuit:
        """Read a file written by `Circuit.save`; other and damaged files are refused with one
        ValueError naming the file."""
        from ra_lens.circuits import _store

        return _store.load(cls, path)

    def to_html(
        self,
        path: str | Path | None = None,
        *,
        faithfulness: float | None = None,
        model: HookedModel | None = None,
        clean: Tokens | None = None,
        metric: MetricFn | None = None,
        n_pairs: int = 3,
        title: str | None = None,
    ) -> CircuitPage:
        """One self-contained offline HTML page of this circuit (see `ra_lens.viz.circuit_page`;
        to walk circuits of several sizes use `EdgeScores.to_html`). With `model`, `clean` and
        `metric`, a click on a head shows its attention pattern and RA (`circuits.page.heads_ra`)
        on each of the first `n_pairs` clean prompts. Written to `path` when given; the returned
        page shows inline in Jupyter."""
        from ra_lens.circuits.page import circuit_page

        page = circuit_page(
            self,
            faithfulness=faithfulness,
            model=model,
            clean=clean,
            metric=metric,
            n_pairs=n_pairs,
            title=title,
        )
        if path is not None:
            page.save(path)
        return page


def _any_copy(
    graph: Graph, copies: Bool[Tensor, "writer ureader"]
) -> Bool[Tensor, "writer reader"]:
    """Each edge of `graph` that holds at least one of its ungrouped copies."""
    counts = torch.zeros(graph.real.shape, dtype=torch.long)
    return counts.index_add_(1, graph.ungrouped_target, copies.to(torch.long)) > 0


def _checked_copies(
    graph: Graph, edges: Tensor, copies: Tensor
) -> Bool[Tensor, "writer ureader"] | None:
    """`copies` (a circuit's `ungrouped_edges`) checked against the graph and `edges`; None
    when every group agrees (the circuit is then the grouped one: module docstring)."""
    shape = (len(graph.writers), len(graph.ungrouped_readers))
    if tuple(copies.shape) != shape or copies.dtype != torch.bool:
        raise ValueError(
            f"ungrouped_edges must be a bool tensor of shape {shape} ([writer, ureader], in the "
            f"order of graph.ungrouped_readers), got {copies.dtype} {tuple(copies.shape)}"
        )
    copies = copies.detach().cpu()
    stray = copies & ~graph.real[:, graph.ungrouped_target]
    if stray.any():
        w, u = torch.nonzero(stray)[0].tolist()
        raise ValueError(
            f"{int(stray.sum())} entries of ungrouped_edges are not edges of the graph, e.g. "
            f"{graph.writers[w]}->{graph.ungrouped_readers[u][0]}"
        )
    if not torch.equal(_any_copy(graph, copies), edges):
        raise ValueError(
            "edges must hold each edge with at least one copy in ungrouped_edges and no other: "
            "build the circuit with Circuit.from_copies(graph, ungrouped_edges)"
        )
    grouped = edges[:, graph.ungrouped_target]
    return None if torch.equal(grouped, copies) else copies


@functools.cache
def ungrouped_owners(graph: Graph) -> Bool[Tensor, "ureader writer"]:
    """owner[u, w]: ungrouped reader u is an input of writer w, as in EAP-IG's graph (query head
    h's copy of a key/value input belongs to head h alone). Computed once per graph."""
    owner = torch.zeros(len(graph.ungrouped_readers), len(graph.writers), dtype=torch.bool)
    for u, (name, _) in enumerate(graph.ungrouped_readers):
        if name != "logits":
            writer = name.split("<")[0]  # a{l}.h{h} (q, k, v of head h) or m{l}
            owner[u, graph.writer_index[writer]] = True
    return owner


def _on_a_path(
    edges: Bool[Tensor, "writer reader"], owner: Bool[Tensor, "reader writer"], graph: Graph
) -> Bool[Tensor, "writer reader"]:
    """The edges on a path from `input` to `logits` (the last reader), `owner[r, w]` saying
    which writer each reader feeds (module docstring)."""
    owners = owner.to(torch.float64)
    flow = edges.to(torch.float64)
    # Reachability over a DAG of depth <= 2 * n_layers + 2 steps; iterate to the fixpoint.
    reached = torch.zeros(len(graph.writers), dtype=torch.float64)
    reached[graph.writer_index["input"]] = 1
    leads = torch.zeros(edges.shape[1], dtype=torch.float64)
    leads[-1] = 1  # logits
    for _ in range(2 * graph.n_layers + 3):
        readers_hit = (reached @ flow) > 0
        new_reached = ((owners.T @ readers_hit.to(torch.float64)) > 0).to(torch.float64)
        new_reached[graph.writer_index["input"]] = 1
        writers_live = (flow @ leads) > 0
        new_leads = ((owners @ writers_live.to(torch.float64)) > 0).to(torch.float64)
        new_leads[-1] = 1
        if torch.equal(new_reached, reached) and torch.equal(new_leads, leads):
            break
        reached, leads = new_reached, new_leads
    return edges & (reached > 0)[:, None] & (leads > 0)[None, :]
