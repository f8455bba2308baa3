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
"""

from __future__ import annotations

import dataclasses
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
    of equal shares). Set operations (`|`, `&`, `-`) act on edges and do not prune (a union
    of pruned circuits is pruned; call `.prune()` after `&` or `-` if needed); the result keeps
    the scores only when both sides carry the same ones. `==` compares graph and edges."""

    graph: Graph
    edges: Bool[Tensor, "writer reader"]
    scores: Float[Tensor, "writer reader"] | None = field(default=None, repr=False)
    node_scores: Float[Tensor, " writer"] | None = field(default=None, repr=False)
    ungrouped_scores: Float[Tensor, "writer ureader"] | None = field(default=None, repr=False)

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
        edge once per query head of its group, as it is written to files."""
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
        """Only the edges on a path from `input` to `logits` (see the module docstring)."""
        g = self.graph
        owner = g.reader_owners.to(torch.float64)
        edges = self.edges.to(torch.float64)
        # Reachability over a DAG of depth <= 2 * n_layers + 2 steps; iterate to the fixpoint.
        reached = torch.zeros(len(g.writers), dtype=torch.float64)
        reached[g.writer_index["input"]] = 1
        leads = torch.zeros(len(g.readers), dtype=torch.float64)
        leads[g.reader_index["logits"]] = 1
        for _ in range(2 * g.n_layers + 3):
            readers_hit = (reached @ edges) > 0
            new_reached = ((owner.T @ readers_hit.to(torch.float64)) > 0).to(torch.float64)
            new_reached[g.writer_index["input"]] = 1
            writers_live = (edges @ leads) > 0
            new_leads = ((owner @ writers_live.to(torch.float64)) > 0).to(torch.float64)
            new_leads[g.reader_index["logits"]] = 1
            if torch.equal(new_reached, reached) and torch.equal(new_leads, leads):
                break
            reached, leads = new_reached, new_leads
        keep = self.edges & (reached > 0)[:, None] & (leads > 0)[None, :]
        return Circuit(
            g,
            keep,
            scores=self.scores,
            node_scores=self.node_scores,
            ungrouped_scores=self.ungrouped_scores,
        )

    def _combine(self, other: Circuit, op: Callable[[Tensor, Tensor], Tensor]) -> Circuit:
        if other.graph != self.graph:
            raise ValueError(
                f"the circuits belong to different graphs: {self.graph} and {other.graph}"
            )

        def same(a: Tensor | None, b: Tensor | None) -> Tensor | None:
            return a if a is not None and b is not None and torch.equal(a, b) else None

        scores = same(self.scores, other.scores)
        return Circuit(
            self.graph,
            op(self.edges, other.edges),
            scores=scores,
            node_scores=same(self.node_scores, other.node_scores),
            ungrouped_scores=None
            if scores is None
            else same(self.ungrouped_scores, other.ungrouped_scores),
        )

    def __or__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a | b)

    def __and__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a & b)

    def __sub__(self, other: Circuit) -> Circuit:
        return self._combine(other, lambda a, b: a & ~b)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Circuit):
            return NotImplemented
        return self.graph == other.graph and torch.equal(self.edges, other.edges)

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
        kv: Literal["strict", "any", "all"] = "strict",
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
        }

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
