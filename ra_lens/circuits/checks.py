"""Checks shared by `EdgeScores` and `Circuit`: finite scores, per-pair and node scores of the
right shape, per-query-head copies that add up, and their fields split for the safetensors file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ra_lens.circuits.graph import Graph


def split_fields(obj: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The dataclass's tensor fields and its plain (JSON-ready) ones, the graph left out: a field
    added later lands in one of them without edits."""
    tensors, plain = {}, {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Tensor):
            tensors[f.name] = value
        elif isinstance(value, dict):
            tensors |= {f"{f.name}.{k}": v for k, v in value.items() if isinstance(v, Tensor)}
        elif not isinstance(value, Graph):
            plain[f.name] = value
    return tensors, plain


def check_finite(graph: Graph, scores: Tensor, name: str) -> None:
    """Refuse NaN or infinite scores, naming the first such entry: a NaN sorts above every
    number (it would take a place in `top(n)`) and compares False with every threshold."""
    bad = ~torch.isfinite(scores.detach().cpu())
    if bad.any():
        w, r = torch.nonzero(bad)[0].tolist()
        where = graph.edge_name(w, r) if graph.real[w, r] else f"entry [{w}, {r}] (not an edge)"
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite entries, e.g. {float(scores[w, r])} at "
            f"{where}: edge scores must be finite numbers (a metric or model that overflowed, "
            "e.g. in float16, gives NaN)"
        )


def check_extras(graph: Graph, per_pair: Tensor | None, node_scores: Tensor | None) -> None:
    """`per_pair` [pair>=1, writer, reader] and `node_scores` [writer], where present, have the
    graph's shape and finite values, NaN allowed in node_scores (no score); else `stable`,
    `ensemble` or a page would fail far from here."""
    w, r = len(graph.writers), len(graph.readers)
    for name, value, shape in (("per_pair", per_pair, (w, r)), ("node_scores", node_scores, (w,))):
        if value is None:
            continue
        got = tuple(value.shape)
        if (
            len(got) != len(shape) + (name == "per_pair")
            or got[-len(shape) :] != shape
            or not got[0]
        ):
            wanted = "[pair, writer, reader], pair >= 1" if name == "per_pair" else "[writer]"
            raise ValueError(f"{name} has shape {got}, expected {wanted} with {w} writers, {r} readers")  # fmt: skip
        values = value.detach().cpu()
        # NaN marks a node without a score (EAP-IG files may leave a node's score out)
        bad = values.isinf() if name == "node_scores" else ~torch.isfinite(values)
        if bad.any():
            index = torch.nonzero(bad)[0].tolist()
            raise ValueError(
                f"{name} has {int(bad.sum())} non-finite entries, e.g. {float(value[tuple(index)])}"
                f" at index {index}: scores must be finite numbers (a metric or model that "
                "overflowed, e.g. in float16, gives NaN)"
            )


def check_copies(graph: Graph, ungrouped: Tensor, scores: Tensor) -> None:
    """Ungrouped scores must have EAP-IG's reader layout, be finite, and their copies of each
    edge must add up to its grouped score (to 1e-6 of the largest |score|: the two come from
    different float sums)."""
    shape = (len(graph.writers), len(graph.ungrouped_readers))
    if tuple(ungrouped.shape) != shape:
        raise ValueError(
            f"ungrouped_scores has shape {tuple(ungrouped.shape)}, the graph needs {shape} "
            "([writer, ureader], in the order of graph.ungrouped_readers)"
        )
    values = ungrouped.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(values)
    if bad.any():
        w, u = torch.nonzero(bad)[0].tolist()
        raise ValueError(
            f"ungrouped_scores has {int(bad.sum())} non-finite entries, e.g. {float(values[w, u])}"
            f" at {graph.writers[w]}->{graph.ungrouped_readers[u][0]}: edge scores must be "
            "finite numbers (a metric or model that overflowed, e.g. in float16, gives NaN)"
        )
    grouped = scores.detach().to("cpu", torch.float64)
    summed = torch.zeros_like(grouped).index_add_(1, graph.ungrouped_target, values)
    gap = (summed - grouped).abs()
    scale = float(grouped.abs().max())
    if float(gap.max()) > 1e-6 * scale + 1e-12:
        w, r = divmod(int(gap.argmax()), grouped.shape[1])
        raise ValueError(
            f"ungrouped_scores do not add up to scores: the copies of {graph.edge_name(w, r)} "
            f"sum to {float(summed[w, r]):.6g}, scores has {float(grouped[w, r]):.6g}; each "
            "query head's copy of a key/value edge holds its part of the grouped score"
        )
