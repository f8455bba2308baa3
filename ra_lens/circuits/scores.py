"""Edge scores over a component graph (see `graph.py`) and choosing a circuit from them.

A `Circuit` (`circuit.py`) is a set of edges of a `Graph`. `EdgeScores.top(n)`, `.threshold(t)` and `.greedy(n)`
choose one from scores and prune it to the edges on a path from `input` to `logits`, as EAP-IG's
`apply_topn` / `apply_threshold` / `apply_greedy` do:

    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> s = torch.zeros(len(g.writers), len(g.readers))
    >>> for name, value in [("input->a0.h0<q>", 3.0), ("a0.h0->logits", -2.0),
    ...                     ("a0.h1->logits", 1.0), ("input->m0", 0.5)]:
    ...     s[g.edge_index(name)] = value
    >>> scores = EdgeScores(g, s, method="eap", direction="denoise")
    >>> scores.top(3).edge_names  # a0.h1->logits has no path from input among the top 3
    ['input->a0.h0<q>', 'a0.h0->logits']
    >>> scores.top(3).nodes
    ['input', 'a0.h0', 'logits']
    >>> (scores.top(3) | Circuit.from_edges(g, ["input->m0", "m0->logits"])).n_edges
    4

Sizes in ungrouped units (`units="ungrouped"`, what MIB counts on a grouped-query model). A
grouped key/value edge stands for `group` edges of EAP-IG's ungrouped graph, one per query head of
its group: patching the key (value) input that query head h alone reads. `attribute` scores each
copy itself (`EdgeScores.ungrouped_scores`: the part of the shared input's score that goes through
head h, so the copies add up to the grouped score); files for EAP-IG and MIB carry those. Two
ways to choose:

- equal shares (default): each copy enters the ungrouped ranking with score / group, and a
  circuit of n ungrouped edges keeps a grouped edge when ALL its copies are among the n best (a
  group cut by the boundary is left out, at most group - 1 edges unspent). The circuit is
  grouped: a key/value edge is patched for all its query heads at once.
- own copies (`own_copies=True`): each copy is ranked by its own score, exactly as EAP-IG's
  `apply_topn` / `apply_greedy` rank its ungrouped graph, and kept on its own: the circuit is
  per copy (`Circuit.ungrouped_edges`), pruned as EAP-IG prunes, and edge patching gives each
  query head its own key and value (`faithfulness`), as EAP-IG's evaluator does.

Without grouped-query attention both units and both ways agree.

    >>> gqa = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> s = torch.zeros(len(gqa.writers), len(gqa.readers))
    >>> for name, value in [("input->a0.h0<k>", 6.0), ("input->a0.h0<q>", 2.0),
    ...                     ("a0.h0->logits", 2.5), ("input->logits", 0.1)]:
    ...     s[gqa.edge_index(name)] = value
    >>> kv = EdgeScores(gqa, s, method="eap", direction="denoise")
    >>> kv.top(3, units="ungrouped").edge_names  # the k edge: 2 copies of 3.0, 2 edges
    ['input->a0.h0<k>', 'a0.h0->logits']
    >>> kv.top(3, units="ungrouped").n_edges_ungrouped
    3
    >>> kv.top(4, units="ungrouped").n_edges_ungrouped  # + input->a0.h0<q> (2.0)
    4
    >>> own = kv.top(3, units="ungrouped", own_copies=True)  # head 1 writes nowhere: pruned
    >>> own.per_copy, own.n_edges_ungrouped, own.to_dict()["ungrouped_edges"]
    (True, 2, ['input->a0.h0<k>', 'a0.h0->logits'])
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.checks import check_count
from ra_lens.circuits.checks import check_copies, check_extras, check_finite, split_fields
from ra_lens.circuits.circuit import Circuit, ungrouped_owners
from ra_lens.circuits.graph import UNITS, Graph, Units
from ra_lens.circuits.mib import mib_sign
from ra_lens.types import HookedModel, MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ra_lens.circuits.curve import FaithfulnessCurve
    from ra_lens.circuits.mib import ChosenCircuits
    from ra_lens.circuits.page import CircuitPage


@dataclass
class EdgeScores:
    """One score per edge: `scores[w, r]` estimates what patching edge writer w -> reader r from
    the clean run into the corrupted one (denoise) or the reverse (noise) does to the metric.
    Entries where `graph.real` is False are 0.

    Optional: `per_pair` [pair, writer, reader] (the scores of each pair; `scores` is their
    mean), `node_scores` [writer] (one score per writer node, written to files as EAP-IG's node
    "score"), `seconds` (how long scoring took), `ungrouped_scores` [writer, ureader] (the scores
    over EAP-IG's ungrouped readers, `graph.ungrouped_readers`: on a grouped-query model each
    query head's copy of a key/value edge with its own score, the copies of an edge adding up to
    its entry of `scores` (checked to 1e-6 of the largest |score|); the other readers as in
    `scores`). Without it each copy gets an equal share."""

    graph: Graph
    scores: Float[Tensor, "writer reader"]
    method: str
    direction: str
    per_pair: Float[Tensor, "pair writer reader"] | None = None
    node_scores: Float[Tensor, " writer"] | None = None
    seconds: float | None = None
    ungrouped_scores: Float[Tensor, "writer ureader"] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        shape = (len(self.graph.writers), len(self.graph.readers))
        if tuple(self.scores.shape) != shape:
            raise ValueError(
                f"scores has shape {tuple(self.scores.shape)}, the graph needs {shape} "
                "([writer, reader], in the order of graph.writers / graph.readers)"
            )
        if self.direction not in ("denoise", "noise"):
            raise ValueError(f"direction={self.direction!r}: expected 'denoise' or 'noise'")
        check_finite(self.graph, self.scores, "scores")
        check_extras(self.graph, self.per_pair, self.node_scores)
        if self.ungrouped_scores is not None:
            check_copies(self.graph, self.ungrouped_scores, self.scores)

    def __repr__(self) -> str:
        return (
            f"EdgeScores(method={self.method!r}, direction={self.direction!r}, "
            f"{self.graph.n_edges} edges, {self.graph})"
        )

    @property
    def helps(self) -> Float[Tensor, "writer reader"]:
        """The scores in MIB's sign, positive where the edge helps the metric: denoise scores as
        they are (m(corrupted run with the edge clean) - m(corrupted) > 0 for an edge that helps),
        noise scores negated (m(clean run with the edge corrupted) - m(clean) < 0 for one). The
        signed rankings (absolute=False) and MIB files use it; float64 on the CPU, detached."""
        return mib_sign(self.direction) * self.scores.detach().to("cpu", torch.float64)

    @property
    def ungrouped_helps(self) -> Float[Tensor, "writer ureader"]:
        """`helps` over EAP-IG's ungrouped readers (`graph.ungrouped_readers`): each query head's
        copy of a key/value edge with its own score (`ungrouped_scores`), or an equal share of the
        grouped score when there are none. What `top(units="ungrouped")` ranks and `export_mib`
        writes; float64 on the CPU, detached."""
        g = self.graph
        if self.ungrouped_scores is None:
            return (self.helps / g.copies[None, :])[:, g.ungrouped_target]
        return mib_sign(self.direction) * self.ungrouped_scores.detach().to("cpu", torch.float64)

    def _keys(self, absolute: bool) -> Float[Tensor, "writer reader"]:
        """The ranking key per edge (|score|, or `helps` for a signed ranking); -inf where there
        is no edge."""
        keys = self.helps
        keys = keys.abs() if absolute else keys
        return keys.masked_fill(~self.graph.real, float("-inf"))

    def _circuit(
        self, edges: Bool[Tensor, "writer reader"], copies: Tensor | None = None
    ) -> Circuit:
        """The pruned circuit of `edges`, or of the ungrouped edges `copies` (per copy)."""
        ungrouped = self.ungrouped_scores
        extras: dict[str, Any] = dict(
            scores=self.scores.detach().cpu(),
            node_scores=self.node_scores,
            ungrouped_scores=None if ungrouped is None else ungrouped.detach().cpu(),
        )
        if copies is not None:
            return Circuit.from_copies(self.graph, copies, prune=True, **extras)
        return Circuit(self.graph, edges, **extras).prune()

    def _ungrouped_keys(self, absolute: bool, own: bool) -> Float[Tensor, "writer ureader"]:
        """The ranking key of each ungrouped edge (own=False: equal shares); -inf where there
        is no edge."""
        g = self.graph
        keys = (
            self.ungrouped_helps if own else (self.helps / g.copies[None, :])[:, g.ungrouped_target]
        )
        keys = keys.abs() if absolute else keys
        return keys.masked_fill(~g.real[:, g.ungrouped_target], float("-inf"))

    def _check_own(self, own_copies: bool, units: str) -> None:
        if own_copies and units != "ungrouped":
            raise ValueError(
                "own_copies=True chooses each query head's copy of a key/value edge on its own, "
                "which only ungrouped units count: pass units='ungrouped'"
            )

    def _check_count(self, n: Validated[int], units: Validated[Units] = "ungrouped") -> None:
        if units not in UNITS:
            raise ValueError(f"units={units!r}: expected 'grouped' or 'ungrouped'")
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n={n!r}: pass a whole number of edges (int)")
        total = self.graph.count(units)
        if not 0 <= n <= total:
            raise ValueError(f"n={n}: the graph has {total} edges ({units}); pass 0..that")

    def top(
        self,
        n: Validated[int],
        *,
        absolute: bool = True,
        units: Validated[Units] = "ungrouped",
        own_copies: bool = False,
    ) -> Circuit:
        """The `n` edges with the largest |score| (with absolute=False: the largest `helps`, the
        score in MIB's sign, so the edges that help the metric most, for noise scores too),
        pruned to those on a path from input to logits (so at most n edges; ties go to the edge
        earlier in graph order).

        units="ungrouped" (default, as every curve and MIB count): n counts edges of EAP-IG's
        ungrouped graph; units="grouped" counts this graph's edges (a key/value edge once). Each
        key/value edge enters the ranking once per query head of its group with an equal share of
        its score, and is kept when all its copies are among the n best (a grouped circuit).
        own_copies=True ranks each copy by its own score (`ungrouped_helps`) and keeps each copy
        on its own, as EAP-IG's `apply_topn` on its ungrouped graph: a per-copy circuit
        (module docstring); it needs units="ungrouped"."""
        self._check_count(n, units)
        self._check_own(own_copies, units)
        if units == "grouped":
            order = torch.argsort(self._keys(absolute).flatten(), descending=True, stable=True)
            edges = torch.zeros(self.graph.real.numel(), dtype=torch.bool)
            edges[order[:n]] = True
            return self._circuit(edges.view_as(self.graph.real))
        g = self.graph
        ukeys = self._ungrouped_keys(
            absolute, own_copies
        )  # [writer, ungrouped reader], EAP-IG's layout
        order = torch.argsort(ukeys.flatten(), descending=True, stable=True)
        picked = torch.zeros(ukeys.numel(), dtype=torch.long)
        picked[order[:n]] = 1
        if own_copies:
            return self._circuit(g.real, copies=picked.view_as(ukeys) > 0)
        index = g.ungrouped_target.expand(len(g.writers), -1)
        n_picked = torch.zeros(g.real.shape, dtype=torch.long).scatter_add(
            1, index, picked.view_as(ukeys)
        )
        return self._circuit((n_picked == g.copies[None, :]) & g.real)

    def threshold(self, t: Validated[float], *, absolute: bool = True) -> Circuit:
        """The edges with |score| >= t (`helps` >= t with absolute=False), pruned."""
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"t={t!r}: pass the threshold as a number (float)")
        if math.isnan(t):
            raise ValueError(
                "t=nan: no score compares with NaN; pass a number (t=-inf keeps every edge "
                "with absolute=False)"
            )
        # Entries off the graph hold -inf keys, which t=-inf would take in: keep to the graph.
        return self._circuit((self._keys(absolute) >= t) & self.graph.real)

    def greedy(
        self,
        n: Validated[int],
        *,
        absolute: bool = True,
        units: Validated[Units] = "ungrouped",
        own_copies: bool = False,
    ) -> Circuit:
        """Grow a circuit from the logits, as EAP-IG's greedy: start with the edges into
        `logits` as candidates; `n` times, add the best candidate (by |score|, or with
        absolute=False by `helps`); when that adds a new writer, its incoming edges become
        candidates (a head's: those into its `<q>` and into its key/value head's `<k>` and
        `<v>`). Then prune.
        Ties go to the edge earlier in graph order.

        units="ungrouped": n counts ungrouped edges; a key/value edge is ranked by its share,
        score / group, and costs `group` edges; growing stops when the best candidate no longer
        fits (its copies would be cut by the boundary). own_copies=True grows EAP-IG's ungrouped
        graph itself: each copy is a candidate with its own score and cost 1 (a head's incoming
        candidates are then its `<q>` and its own copies of `<k>` and `<v>`), giving a per-copy
        circuit (see `top`)."""
        self._check_count(n, units)
        self._check_own(own_copies, units)
        g = self.graph
        if own_copies:
            keys = self._ungrouped_keys(absolute, own=True)
            real, owner = g.real[:, g.ungrouped_target], ungrouped_owners(g)
            cost = [1] * real.shape[1]
        else:
            keys, real, owner = self._keys(absolute), g.real, g.reader_owners
            cost = [1] * len(g.readers)
            if units == "ungrouped":  # each copy's equal share; -inf off the graph stays
                keys, cost = keys / g.copies[None, :], g.copies.tolist()
        edges = _grow(keys, real, owner, cost, n, g.writer_index["input"])
        return self._circuit(g.real, copies=edges) if own_copies else self._circuit(edges)

    def to_html(
        self,
        path: str | Path | None = None,
        *,
        curve: FaithfulnessCurve | None = None,
        sizes: Sequence[float] | None = None,
        selection: Literal["top", "greedy"] = "top",
        circuit: Circuit | None = None,
        faithfulness: float | None = None,
        model: HookedModel | None = None,
        clean: Tokens | None = None,
        metric: MetricFn | None = None,
        n_pairs: int = 3,
        title: str | None = None,
        chosen: ChosenCircuits | None = None,
    ) -> CircuitPage:
        """One self-contained offline HTML page (see `page.py`) walking the circuits these scores
        pick at each size (`curve`'s sizes and selection, else `sizes`, default MIB's fractions,
        and `selection`), beside the faithfulness curve when `curve` is given; `circuit` (with
        its `faithfulness`) is one more stop, opened first. With `model`, `clean` and `metric`,
        a click on a head shows its attention pattern and RA on each of the first `n_pairs`
        clean prompts. Written to `path` when given; the returned page shows inline in Jupyter.
        `chosen` (`mib.ChosenCircuits` of these scores) hands over circuits already chosen.
        """
        from ra_lens.circuits.page import scores_page

        page = scores_page(
            self,
            curve=curve,
            sizes=sizes,
            selection=selection,
            circuit=circuit,
            faithfulness=faithfulness,
            model=model,
            clean=clean,
            metric=metric,
            n_pairs=n_pairs,
            title=title,
            chosen=chosen,
        )
        if path is not None:
            page.save(path)
        return page

    def top_edges(self, k: Validated[int] = 10) -> list[tuple[str, float]]:
        """The k edges with the largest |score|, as (name, score), largest first.

        >>> g = Graph(n_layers=1, n_heads=1, n_kv_heads=1, d_model=8)
        >>> s = torch.zeros(len(g.writers), len(g.readers))
        >>> s[g.edge_index("input->a0.h0<q>")], s[g.edge_index("a0.h0->logits")] = 0.5, -2.0
        >>> EdgeScores(g, s, method="eap", direction="denoise").top_edges(2)
        [('a0.h0->logits', -2.0), ('input->a0.h0<q>', 0.5)]
        """
        check_count(k, "k")
        keys = self._keys(absolute=True).flatten()
        order = keys.argsort(descending=True, stable=True)[: min(k, self.graph.n_edges)]
        width = len(self.graph.readers)
        return [
            (self.graph.edge_name(i // width, i % width), float(self.scores.flatten()[i]))
            for i in order.tolist()
        ]

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        """A JSON-ready summary: settings, the graph, edge counts, the k edges with the largest
        |score| and the shape of every tensor field (the tensors themselves go to `save`).

        >>> g = Graph(n_layers=1, n_heads=1, n_kv_heads=1, d_model=8)
        >>> s = torch.zeros(len(g.writers), len(g.readers))
        >>> s[g.edge_index("a0.h0->logits")] = 2.0
        >>> report = EdgeScores(g, s, method="eap", direction="noise").to_dict(k=1)
        >>> report["top_edges"], report["tensors"]
        ([{'edge': 'a0.h0->logits', 'score': 2.0, 'helps': -2.0}], {'scores': [3, 5]})
        """
        tensors, plain = split_fields(self)
        sign = mib_sign(self.direction)
        return {
            **plain,
            "graph": dataclasses.asdict(self.graph),
            "n_edges": self.graph.n_edges,
            "n_edges_ungrouped": self.graph.n_edges_ungrouped,
            "top_edges": [
                {"edge": name, "score": score, "helps": sign * score}
                for name, score in self.top_edges(k)
            ],
            "tensors": {name: list(value.shape) for name, value in tensors.items()},
        }

    def table(self, k: int = 10) -> str:
        """A Markdown table of the k edges with the largest |score|."""
        rows = [
            f"{self.method} edge scores ({self.direction}), {self.graph}",
            "",
            "| rank | edge | score | helps (MIB's sign) |",
            "|---:|---|---:|---:|",
        ]
        sign = mib_sign(self.direction)
        for i, (name, score) in enumerate(self.top_edges(k), 1):
            rows.append(f"| {i} | {name} | {score:.4g} | {sign * score:.4g} |")
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None, *, k: int = 20) -> Figure:
        """The k edges with the largest |score| as bars, in MIB's sign (`helps`); `save` also
        writes the figure (png, pdf, svg by suffix). Returns the figure."""
        from ra_lens.viz import save_figure
        from ra_lens.viz.circuit_draw import draw_scores

        return save_figure(draw_scores(self, k), save)

    def save(self, path: str | Path) -> None:
        """Write every field (the tensors, the graph, the settings) to one safetensors file,
        atomically and through symlinks like `ReversedAttention.save`.

        >>> import tempfile
        >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
        >>> scores = EdgeScores(g, torch.rand(len(g.writers), len(g.readers)) * g.real,
        ...                     method="eap", direction="denoise", seconds=1.5)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     scores.save(f"{folder}/scores.safetensors")
        ...     back = EdgeScores.load(f"{folder}/scores.safetensors")
        >>> torch.equal(back.scores, scores.scores), back.graph == g, back.seconds
        (True, True, 1.5)
        """
        from ra_lens.circuits import _store

        _store.save(self, path)

    @classmethod
    def load(cls, path: str | Path) -> EdgeScores:
        """Read a file written by `EdgeScores.save`; other and damaged files are refused with
        one ValueError naming the file."""
        from ra_lens.circuits import _store

        return _store.load(cls, path)


def _grow(
    keys: Float[Tensor, "writer reader"],
    real: Bool[Tensor, "writer reader"],
    owner: Bool[Tensor, "reader writer"],
    cost: list[int],
    budget: int,
    input_writer: int,
) -> Bool[Tensor, "writer reader"]:
    """EAP-IG's greedy growth from the logits (the last reader), `EdgeScores.greedy`: the best
    candidate by `keys` while its `cost` fits the `budget`; a new writer's incoming edges (into
    the readers it owns) become candidates. Ties go to the edge earlier in graph order."""
    heap: list[tuple[float, int, int]] = []
    seen_readers: set[int] = set()

    def push_into(reader: int) -> None:
        if reader in seen_readers:
            return
        seen_readers.add(reader)
        for w in torch.nonzero(real[:, reader]).flatten().tolist():
            heapq.heappush(heap, (-float(keys[w, reader]), w, reader))

    push_into(real.shape[1] - 1)
    edges = torch.zeros_like(real)
    writers_in = {input_writer}
    while heap and budget > 0:
        _, w, r = heap[0]
        if cost[r] > budget:
            break
        heapq.heappop(heap)
        budget -= cost[r]
        edges[w, r] = True
        if w not in writers_in:
            writers_in.add(w)
            for reader in torch.nonzero(owner[:, w]).flatten().tolist():
                push_into(reader)
    return edges
