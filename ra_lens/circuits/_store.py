"""The safetensors file of `EdgeScores` and `Circuit`: every field of the dataclass, generically.

A tensor field is a tensor of the file, a dict of tensors one tensor per entry (`name.key`), the
graph and every other field JSON in the header (through `result.write_safetensors` /
`read_safetensors`, the writer and reader `ReversedAttention` and `AttentionAttribution` use:
atomic, through symlinks, errors naming the file). A field added to the dataclass later is saved
and loaded without edits here; a file from an older version lacks it and loads with its default.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor

from ra_lens.circuits.graph import Graph
from ra_lens.result import damaged, read_safetensors, write_safetensors

T = TypeVar("T")

#: The header key of the files (one per class: a Circuit file is not read as EdgeScores).
HEADER = "ra_lens.circuits"


def save(obj: Any, path: str | Path) -> None:
    """Write the dataclass `obj` (with a `graph: Graph` field) to `path`."""
    writer = f"{type(obj).__name__}.save"
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {"class": type(obj).__name__, "dicts": [], "fields": {}}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Graph):
            meta["fields"][f.name] = {"graph": dataclasses.asdict(value)}
        elif isinstance(value, Tensor):
            tensors[f.name] = value.detach().cpu().contiguous()
        elif (
            isinstance(value, dict) and value and all(isinstance(v, Tensor) for v in value.values())
        ):
            meta["dicts"].append(f.name)
            for key, v in value.items():
                tensors[f"{f.name}.{key}"] = v.detach().cpu().contiguous()
        else:
            meta["fields"][f.name] = {"value": value}
    write_safetensors(path, tensors, {HEADER: json.dumps(meta)}, writer)


def load(cls: type[T], path: str | Path) -> T:
    """Read a file written by `save` for `cls`; another class's file, an unknown field or
    tensors that do not fit the graph are refused with one ValueError naming the file."""
    writer = f"{cls.__name__}.save"
    meta, tensors = read_safetensors(path, HEADER, writer)
    if not isinstance(meta, dict) or meta.get("class") != cls.__name__:
        found = meta.get("class") if isinstance(meta, dict) else type(meta).__name__
        raise damaged(path, f"it holds a {found}, not a {cls.__name__} ({writer} writes those)")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    try:
        for name, entry in meta["fields"].items():
            kwargs[name] = Graph(**entry["graph"]) if "graph" in entry else entry["value"]
        for name in meta["dicts"]:
            prefix = f"{name}."
            kwargs[name] = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        dicts = tuple(f"{name}." for name in meta["dicts"])
        kwargs |= {k: v for k, v in tensors.items() if not k.startswith(dicts)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"fields {unknown} that {cls.__name__} does not have")
        graph = kwargs.get("graph")
        if not isinstance(graph, Graph):
            raise ValueError("no graph")
        _check_sizes(graph, kwargs)
        return cls(**kwargs)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise damaged(path, f"{type(error).__name__}: {error}") from None


def _check_sizes(graph: Graph, kwargs: dict[str, Any]) -> None:
    """The tensors fit the graph (the optional ones are not checked by the classes: a damaged file
    would otherwise load and fail later, far from the file)."""
    w, r = len(graph.writers), len(graph.readers)
    for name, trailing in _TRAILING.items():
        value = kwargs.get(name)
        if value is None:
            continue
        shape = tuple(value.shape) if isinstance(value, Tensor) else None
        if (
            shape is None
            or len(shape) != trailing[0]
            or shape[-len(trailing[1]) :]
            != (tuple(w if axis == "writer" else r for axis in trailing[1]))
        ):
            raise ValueError(
                f"{name} has shape {shape}, expected {trailing[0]} axes ending in "
                f"{list(trailing[1])} ({w} writers, {r} readers)"
            )


#: Axes count and trailing axes of the tensors whose layout the graph fixes (a new field is
#: checked by its class).
_TRAILING: dict[str, tuple[int, tuple[str, ...]]] = {
    "scores": (2, ("writer", "reader")),
    "edges": (2, ("writer", "reader")),
    "per_pair": (3, ("writer", "reader")),
    "node_scores": (1, ("writer",)),
}
