"""Circuit files in EAP-IG's graph JSON layout, the layout MIB's circuit track reads.

    {"cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": false, "d_model": 16},
     "nodes": {"input": {"in_graph": true, "score": 0.1}, "a0.h0": {...}, "m0": {...}, ...,
               "logits": {"in_graph": true}},
     "edges": {"input->a0.h0<q>": {"score": 0.25, "in_graph": true}, ...}}

Every edge of the graph is written, in or out of the circuit, with its score (0.0 when the circuit
carries none); node "score" only when the circuit carries node scores. EAP-IG's graph has no
grouped-query attention: it has `<k>`/`<v>` readers per QUERY head. A key/value edge of a
grouped-query model (`a0.h1->a3.h2<k>` on key/value head 2) is therefore written on every query
head of its group (`a0.h1->a3.h{2r..2r+r-1}<k>`, r = n_heads / n_kv_heads) with the same
in_graph (each copy's own in_graph in a per-copy circuit, `Circuit.ungrouped_edges`), so EAP-IG
and MIB, which load the file as an ungrouped model, patch exactly the key/value inputs this
circuit patches. Each copy carries its own score where the circuit has
per-query-head scores (`Circuit.ungrouped_scores`, from `attribute`: the part of the edge's score
that goes through that query head, what EAP-IG scores on its ungrouped model), else an equal
share, score / r; either way the r copies add up to the edge's score, so MIB's ranking over the
copies never sees r copies of the whole (see `EdgeScores.top(units="ungrouped")`, which ranks
the same way).

Reading a file back (`read_json`): with `kv="copies"` (default) each query head's copy of a
key/value edge is in the circuit as the file says: where the heads of a group disagree (a file
EAP-IG or `EdgeScores.top(n, own_copies=True)` wrote) the circuit is per copy
(`Circuit.ungrouped_edges`), and edge patching gives each query head its own key and value, as
EAP-IG's evaluator does; where they agree it is the grouped circuit. `kv="strict"` refuses a file
whose groups disagree, naming the first such edge; `kv="any"` keeps an edge (for all its copies)
in_graph on any head of its group, `kv="all"` only those in_graph on all of them. A key/value edge's
score is the sum of its copies' scores (the score written, read back), and on a grouped-query
model each copy's score is kept as read (`Circuit.ungrouped_scores`). Edges missing from the
file are out of the circuit with score 0; unknown names, a mismatched `cfg` or a damaged file
raise an error naming the file.

    >>> import tempfile, pathlib
    >>> from ra_lens.circuits import Circuit
    >>> g = Graph(n_layers=1, n_heads=4, n_kv_heads=2, d_model=8)
    >>> c = Circuit.from_edges(g, ["input->a0.h1<k>", "a0.h2->logits"])
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "circuit.json"
    >>> c.to_json(path)
    >>> d = json.loads(path.read_text())
    >>> [name for name, e in d["edges"].items() if e["in_graph"]]
    ['input->a0.h2<k>', 'input->a0.h3<k>', 'a0.h2->logits']
    >>> Circuit.from_json(path, g) == c
    True
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ra_lens.circuits.graph import Graph
from ra_lens.files import load_json, write_file

# Circuits import their file layout; the layout names Circuit for type hints only.
if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit

KvRule = Literal["copies", "strict", "any", "all"]


class CircuitFields(TypedDict):
    """A `Circuit`'s fields as a file gives them (the graph aside)."""

    edges: Tensor
    scores: Tensor
    node_scores: Tensor | None
    ungrouped_scores: Tensor | None
    ungrouped_edges: Tensor | None


def ungrouped_readers(graph: Graph) -> list[tuple[str, int]]:
    """EAP-IG's readers (k/v per query head) with the index of the reader of `graph` each one
    stands for (`Graph.ungrouped_readers`): `a3.h5<k>` -> `a3.h{5 // group}<k>`.

    >>> [name for name, _ in ungrouped_readers(Graph(1, 2, 1, 8))]
    ['a0.h0<q>', 'a0.h1<q>', 'a0.h0<k>', 'a0.h1<k>', 'a0.h0<v>', 'a0.h1<v>', 'm0', 'logits']
    """
    return graph.ungrouped_readers


def write_json(circuit: Circuit, path: str | Path) -> None:
    """Write `circuit` to `path` in EAP-IG's layout with `ra_lens.files.write_file` (atomic,
    through a symlink, keeping the file's mode, straight into a FIFO)."""
    g = circuit.graph
    scores = circuit.scores
    score = (
        scores.detach().to("cpu", torch.float64)
        if scores is not None
        else torch.zeros(g.real.shape, dtype=torch.float64)
    )
    # each ungrouped copy of a key/value edge carries its own score, or its share (docstring)
    if circuit.ungrouped_scores is not None:
        ungrouped = circuit.ungrouped_scores.detach().to("cpu", torch.float64)
    else:
        ungrouped = (score / g.copies[None, :])[:, g.ungrouped_target]
    in_circuit = set(circuit.nodes)
    nodes: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(g.writers):
        nodes[name] = {"in_graph": name in in_circuit}
        # NaN marks a node without a score (read from a file that gave it none): JSON has no NaN
        if circuit.node_scores is not None and not math.isnan(float(circuit.node_scores[i])):
            nodes[name]["score"] = float(circuit.node_scores[i])
    nodes["logits"] = {"in_graph": True}  # EAP-IG's logits node is always in its graph
    edges: dict[str, dict[str, Any]] = {}
    readers = ungrouped_readers(g)
    # each query head's copy in_graph as the circuit holds it (all alike unless per copy)
    real, chosen, values = g.real.tolist(), circuit.copies.tolist(), ungrouped.tolist()
    for w, writer in enumerate(g.writers):
        for u, (reader, r) in enumerate(readers):
            if real[w][r]:
                edges[f"{writer}->{reader}"] = {"score": values[w][u], "in_graph": chosen[w][u]}
    cfg = {
        "n_layers": g.n_layers,
        "n_heads": g.n_heads,
        "parallel_attn_mlp": g.parallel_attn_mlp,
        "d_model": g.d_model,
    }
    write_file(path, json.dumps({"cfg": cfg, "nodes": nodes, "edges": edges}))


def read_fields(path: str | Path, g: Graph, *, kv: KvRule = "strict") -> CircuitFields:
    """The fields of the `Circuit` an EAP-IG graph JSON file describes on graph `g` (`edges`,
    `scores`, `node_scores`, `ungrouped_scores`): `Circuit.from_json` builds the circuit from
    them. See the module docstring for key/value edges."""
    if kv not in ("copies", "strict", "any", "all"):
        raise ValueError(f"kv={kv!r}: expected 'copies', 'strict', 'any' or 'all'")
    data = _load(Path(path))
    _check_cfg(path, data["cfg"], g)

    readers = ungrouped_readers(g)
    u_index = {name: (u, r) for u, (name, r) in enumerate(readers)}
    real = g.real.tolist()
    ws, us, flags, values = [], [], [], []
    for name, entry in data["edges"].items():
        writer, sep, reader = name.partition("->")
        if not sep or writer not in g.writer_index or reader not in u_index:
            raise ValueError(f"{path}: {name!r} is not an edge of {g} (EAP-IG edge names)")
        w, (u, r) = g.writer_index[writer], u_index[reader]
        if not real[w][r]:
            raise ValueError(f"{path}: {name!r}: {writer} comes after {reader}, no such edge")
        if not isinstance(entry, dict) or not isinstance(entry.get("in_graph"), bool):
            raise ValueError(f"{path}: edge {name!r} needs a boolean 'in_graph', got {entry!r}")
        value = _score(entry.get("score", 0.0))
        if value is None:
            raise ValueError(
                f"{path}: edge {name!r} has score {entry['score']!r}, expected a finite number"
            )
        ws.append(w)
        us.append(u)
        flags.append(entry["in_graph"])
        values.append(value)
    shape = (len(g.writers), len(readers))
    at = (torch.tensor(ws, dtype=torch.long), torch.tensor(us, dtype=torch.long))
    in_graph = torch.zeros(shape, dtype=torch.bool).index_put(
        at, torch.tensor(flags, dtype=torch.bool)
    )
    score = torch.zeros(shape, dtype=torch.float64).index_put(
        at, torch.tensor(values, dtype=torch.float64)
    )
    edges, scores = _merge(path, g, kv, in_graph, score, torch.tensor([r for _, r in readers]))
    node_scores = _node_scores(path, data["nodes"], g)
    copies = score * g.real[:, g.ungrouped_target] if g.group > 1 else None
    return {
        "edges": edges & g.real,
        "scores": scores,
        "node_scores": node_scores,
        "ungrouped_scores": copies,
        # Circuit keeps them only where the heads of a group disagree
        "ungrouped_edges": in_graph & g.real[:, g.ungrouped_target] if kv == "copies" else None,
    }


def _merge(
    path: str | Path,
    g: Graph,
    kv: KvRule,
    in_graph: Bool[Tensor, "writer ureader"],
    score: Float[Tensor, "writer ureader"],
    target: Int[Tensor, " ureader"],
) -> tuple[Bool[Tensor, "writer reader"], Float[Tensor, "writer reader"]]:
    """The file's ungrouped readers merged into the readers of `g` (`target[u]`: the reader an
    ungrouped reader stands for; several query heads' copies for a grouped k/v reader)."""
    shape = (len(g.writers), len(g.readers))
    index = target.expand(shape[0], -1)
    copies = torch.bincount(target, minlength=shape[1])
    n_in = torch.zeros(shape, dtype=torch.long).scatter_add(1, index, in_graph.long())
    everywhere, anywhere = n_in == copies, n_in > 0
    if kv == "strict" and (everywhere != anywhere).any():
        w, r = torch.nonzero(everywhere != anywhere)[0].tolist()
        reader = g.readers[r]
        lo = g.group * (g.reader(reader).head or 0)
        raise ValueError(
            f"{path}: edge {g.writers[w]}->{reader} (key/value head) is in_graph on some but not "
            f"all of its query heads h{lo}..h{lo + g.group - 1}; "
            "make the group agree, or read with kv='any' (in when in on any head of the group) "
            "or kv='all' (in only when in on all of them)"
        )
    total = torch.zeros(shape, dtype=torch.float64).scatter_add(1, index, score)
    return (everywhere if kv == "all" else anywhere), total


def _score(value: Any) -> float | None:
    """A JSON score as a float, or None when it is not a finite number (NaN, Infinity and
    overlong integers, which Python's json reads, true/false, text, lists)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _load(path: Path) -> dict[str, Any]:
    data = load_json(path, "an EAP-IG graph JSON file")
    missing = {"cfg", "nodes", "edges"} - set(data) if isinstance(data, dict) else {"a JSON object"}
    if missing:
        raise ValueError(
            f"{path}: not an EAP-IG graph file, it lacks {sorted(missing)} (expected keys cfg, "
            "nodes, edges)"
        )
    if not isinstance(data["edges"], dict) or not isinstance(data["nodes"], dict):
        raise ValueError(f"{path}: 'nodes' and 'edges' must be JSON objects keyed by name")
    return cast("dict[str, Any]", data)  # a dict: checked above


def _check_cfg(path: str | Path, cfg: Any, g: Graph) -> None:
    expected = {
        "n_layers": g.n_layers,
        "n_heads": g.n_heads,
        "d_model": g.d_model,
        "parallel_attn_mlp": g.parallel_attn_mlp,
    }
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: 'cfg' must be a JSON object, got {cfg!r}")
    wrong = {k: cfg.get(k) for k, v in expected.items() if k in cfg and cfg[k] != v}
    absent = [k for k in ("n_layers", "n_heads") if k not in cfg]
    if wrong or absent:
        raise ValueError(
            f"{path}: written for another model: cfg has {wrong or absent} where this model "
            f"has {expected}"
        )


def _node_scores(path: str | Path, nodes: dict[str, Any], g: Graph) -> Tensor | None:
    """EAP-IG node scores (NaN for a node without one), or None when no node has one."""
    scores = torch.full((len(g.writers),), math.nan, dtype=torch.float64)
    found = False
    for name, entry in nodes.items():
        if name == "logits" or not isinstance(entry, dict) or "score" not in entry:
            continue
        if name not in g.writer_index:
            raise ValueError(f"{path}: node {name!r} is not a node of {g}")
        if entry["score"] is None:  # EAP-IG's node without a score
            continue
        value = _score(entry["score"])
        if value is None:
            raise ValueError(
                f"{path}: node {name!r} has score {entry['score']!r}, expected a finite number "
                "or null"
            )
        scores[g.writer_index[name]] = value
        found = True
    return scores if found else None
