"""The component graph of a TransformerLens model, named as EAP-IG and MIB name it.

Writers (what adds to the residual stream), in forward order: `input` (the embeddings),
`a{layer}.h{head}` (one head's output, z_h @ W_O[h]) and `m{layer}` (one MLP's output).
Readers (what reads the residual stream): each head's query input `a{layer}.h{head}<q>`, each
key/value head's key and value inputs `a{layer}.h{group}<k>` / `<v>`, each MLP's input `m{layer}`
and `logits`. An edge `writer->reader` exists when the writer comes before the reader. On a
grouped-query model (n_kv_heads < n_heads) the key and value readers are per key/value head:
`a3.h1<k>` is key/value head 1 there, read by query heads 1*r .. 1*r + r - 1 (r = n_heads /
n_kv_heads); files written for EAP-IG's ungrouped model repeat it on each query head of its group.
So on Gemma-3-270M (4 query heads, 1 key/value head) "a11.h1->a12.h0<v>" is the value input of
KEY/VALUE head 0, shared by query heads 0..3, not query head 0's alone; the number after `.h` of
a `<k>`/`<v>` reader is a query head only in the ungrouped names (`ungrouped_readers`).

Edge counts come in two units. `n_edges` counts this graph's edges (a grouped key/value edge
once); `n_edges_ungrouped` counts EAP-IG's ungrouped graph, where a key/value edge exists once per
query head of its group (`copies[r]` = r for a `<k>`/`<v>` reader, 1 otherwise). MIB's circuit
sizes are fractions of the ungrouped count (123,211 edges on SmolLM2, 70,651 grouped).

Scores and circuits are dense `[writer, reader]` tensors; `Graph.real` says which entries are edges.

    >>> g = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
    >>> len(g.writers), len(g.readers), g.n_edges
    (11, 19, 82)
    >>> g.readers[:7]
    ['a0.h0<q>', 'a0.h1<q>', 'a0.h2<q>', 'a0.h3<q>', 'a0.h0<k>', 'a0.h1<k>', 'a0.h0<v>']
    >>> g.edge_name(g.writer_index["a0.h2"], g.reader_index["a1.h1<k>"])
    'a0.h2->a1.h1<k>'
    >>> g.n_edges_ungrouped  # each of the 4 + 24 key/value edges counts twice
    110
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel, model_shape

#: How edges are counted: each key/value edge once ("grouped") or once per query head of its
#: group, as EAP-IG's ungrouped graph and MIB count them ("ungrouped").
Units = Literal["grouped", "ungrouped"]
UNITS: tuple[str, ...] = ("grouped", "ungrouped")

ReaderKind = Literal["q", "k", "v", "mlp", "logits"]
WriterKind = Literal["input", "head", "mlp"]

_READER = re.compile(r"^a(\d+)\.h(\d+)<([qkv])>$|^m(\d+)$|^logits$")
_WRITER = re.compile(r"^a(\d+)\.h(\d+)$|^m(\d+)$|^input$")


@dataclass(frozen=True)
class Reader:
    """One reader of the residual stream: kind, layer (n_layers for logits), head (q: query
    head; k/v: key/value head; None for mlp and logits)."""

    kind: ReaderKind
    layer: int
    head: int | None


@dataclass(frozen=True)
class Writer:
    """One writer to the residual stream: kind, layer (-1 for input), head (None unless a head)."""

    kind: WriterKind
    layer: int
    head: int | None


@dataclass(frozen=True)
class Graph:
    """Writers, readers and which writer feeds which reader, for one model geometry."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    parallel_attn_mlp: bool = False

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.n_heads < 1 or self.n_kv_heads < 1:
            raise ValueError(f"a graph needs at least one layer and one head, got {self}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @classmethod
    def from_model(cls, model: Validated[HookedModel]) -> Graph:
        """The graph of a TransformerLens model (HookedTransformer or TransformerBridge).

        >>> Graph.from_model(model)
        Graph(n_layers=2, n_heads=4, n_kv_heads=4, d_model=32, parallel_attn_mlp=False)
        """
        shape = model_shape(model)
        return cls(
            n_layers=shape.n_layers,
            n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            d_model=shape.d_model,
            parallel_attn_mlp=shape.parallel_attn_mlp,
        )

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @cached_property
    def writers(self) -> list[str]:
        names = ["input"]
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{h}" for h in range(self.n_heads)] + [f"m{layer}"]
        return names

    @cached_property
    def readers(self) -> list[str]:
        names: list[str] = []
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{h}<q>" for h in range(self.n_heads)]
            names += [f"a{layer}.h{g}<k>" for g in range(self.n_kv_heads)]
            names += [f"a{layer}.h{g}<v>" for g in range(self.n_kv_heads)]
            names.append(f"m{layer}")
        return names + ["logits"]

    @cached_property
    def writer_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.writers)}

    @cached_property
    def reader_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.readers)}

    @cached_property
    def real(self) -> Bool[Tensor, "writer reader"]:
        """True where the writer comes before the reader (an edge of the graph)."""
        writer_rank = torch.tensor([self._writer_rank(w) for w in self.writers])
        reader_rank = torch.tensor([self._reader_rank(r) for r in self.readers])
        return writer_rank[:, None] < reader_rank[None, :]

    @cached_property
    def reader_owners(self) -> Bool[Tensor, "reader writer"]:
        """owner[r, w]: reader r is an input of writer w (q: its head; k/v: every query head of
        the key/value head; mlp: the MLP). `logits` belongs to no writer. Computed once per
        graph; read it, do not modify it (as `real`)."""
        owner = torch.zeros(len(self.readers), len(self.writers), dtype=torch.bool)
        for r, name in enumerate(self.readers):
            reader = self.reader(name)
            if reader.kind == "mlp":
                owner[r, self.writer_index[f"m{reader.layer}"]] = True
            elif reader.kind == "q":
                owner[r, self.writer_index[f"a{reader.layer}.h{reader.head}"]] = True
            elif reader.kind in ("k", "v"):
                assert reader.head is not None
                for h in range(reader.head * self.group, (reader.head + 1) * self.group):
                    owner[r, self.writer_index[f"a{reader.layer}.h{h}"]] = True
        return owner

    @property
    def n_edges(self) -> int:
        """Edges of this graph (a grouped key/value edge counts once)."""
        return int(self.real.sum())

    @cached_property
    def copies(self) -> Tensor:
        """Int[Tensor, "reader"]: how many readers of EAP-IG's ungrouped graph each reader stands
        for: `group` for a key/value reader, 1 for the others."""
        return torch.tensor(
            [self.group if name.endswith(("<k>", "<v>")) else 1 for name in self.readers]
        )

    @property
    def n_edges_ungrouped(self) -> int:
        """Edges of EAP-IG's ungrouped graph (MIB's `len(graph.edges)`): a key/value edge counts
        once per query head of its group. Equals `n_edges` without grouped-query attention."""
        return int((self.real.long() * self.copies[None, :]).sum())

    def count(self, units: Units = "ungrouped") -> int:
        """The graph's edges in `units`: `n_edges_ungrouped` (default, MIB's unit) or `n_edges`.

        >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
        >>> g.count(), g.count("grouped")
        (13, 11)
        """
        if units not in UNITS:
            raise ValueError(f"units={units!r}: expected 'grouped' or 'ungrouped'")
        return self.n_edges if units == "grouped" else self.n_edges_ungrouped

    @cached_property
    def ungrouped_readers(self) -> list[tuple[str, int]]:
        """EAP-IG's readers in its order (per layer: every query head's q, then k, then v, then
        the MLP; logits last), each with the index of the reader of this graph it stands for:
        `a3.h5<k>` -> `a3.h{5 // group}<k>`.

        >>> [name for name, _ in Graph(1, 2, 1, 8).ungrouped_readers]
        ['a0.h0<q>', 'a0.h1<q>', 'a0.h0<k>', 'a0.h1<k>', 'a0.h0<v>', 'a0.h1<v>', 'm0', 'logits']
        """
        out: list[tuple[str, int]] = []
        index = self.reader_index
        for layer in range(self.n_layers):
            for kind in "qkv":
                for h in range(self.n_heads):
                    head = h if kind == "q" else h // self.group
                    out.append((f"a{layer}.h{h}<{kind}>", index[f"a{layer}.h{head}<{kind}>"]))
            out.append((f"m{layer}", index[f"m{layer}"]))
        return out + [("logits", index["logits"])]

    @cached_property
    def ungrouped_target(self) -> Tensor:
        """Int[Tensor, "ureader"]: for each reader of `ungrouped_readers`, the index of the reader
        of this graph it stands for."""
        return torch.tensor([r for _, r in self.ungrouped_readers])

    # Ranks place every writer and reader on one forward timeline: layer l's attention readers at
    # 3l, its head writers at 3l + 1, its MLP reader at 3l + 1 (3l with parallel attention/MLP,
    # so that the heads of the same layer do not feed it), its MLP writer at 3l + 2.
    def _writer_rank(self, name: str) -> float:
        w = self.writer(name)
        if w.kind == "input":
            return -1.0
        return 3 * w.layer + (1.0 if w.kind == "head" else 2.0)

    def _reader_rank(self, name: str) -> float:
        r = self.reader(name)
        if r.kind in ("q", "k", "v"):
            return 3.0 * r.layer
        if r.kind == "mlp":
            return 3 * r.layer + (0.0 if self.parallel_attn_mlp else 1.5)
        return 3.0 * self.n_layers

    def writer(self, name: str) -> Writer:
        """Parse a writer name: `input`, `a{l}.h{h}` or `m{l}`."""
        match = _WRITER.match(name)
        if match is None or (name != "input" and name not in self.writer_index):
            raise KeyError(
                f"{name!r} is not a writer of {self}: expected input, a{{l}}.h{{h}}, m{{l}}"
            )
        if name == "input":
            return Writer("input", -1, None)
        if match.group(3) is not None:
            return Writer("mlp", int(match.group(3)), None)
        return Writer("head", int(match.group(1)), int(match.group(2)))

    def reader(self, name: str) -> Reader:
        """Parse a reader name: `a{l}.h{h}<q|k|v>`, `m{l}` or `logits`."""
        match = _READER.match(name)
        if match is None or name not in self.reader_index:
            raise KeyError(
                f"{name!r} is not a reader of {self}: expected a{{l}}.h{{h}}<q|k|v> (k/v per "
                "key/value head), m{l} or logits"
            )
        if name == "logits":
            return Reader("logits", self.n_layers, None)
        if match.group(4) is not None:
            return Reader("mlp", int(match.group(4)), None)
        return Reader(match.group(3), int(match.group(1)), int(match.group(2)))  # type: ignore[arg-type]

    def edge_name(self, writer: int, reader: int) -> str:
        """`writer->reader` for indices into `writers` and `readers`. A `<k>`/`<v>` reader is
        named by its key/value head on a grouped-query model (module docstring)."""
        return f"{self.writers[writer]}->{self.readers[reader]}"

    def edge_index(self, name: str) -> tuple[int, int]:
        """(writer index, reader index) of an edge name such as `a0.h1->a3.h2<q>`."""
        writer, sep, reader = name.partition("->")
        if not sep or writer not in self.writer_index or reader not in self.reader_index:
            raise KeyError(f"{name!r} is not an edge of {self}")
        w, r = self.writer_index[writer], self.reader_index[reader]
        if not self.real[w, r]:
            raise KeyError(f"{name!r}: {writer} comes after {reader}, so there is no such edge")
        return w, r
