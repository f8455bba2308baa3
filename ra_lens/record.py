"""A result's fields as one JSON file and back, exactly: `Recorded`, the `save` / `load` that the
results which are not safetensors files inherit (`NodeScores`, `Faithfulness`, `Refinement`,
`EditDynamics`, `AblationCurve`, `LearnedMask`, `NegativeScale`, the experiments' results).

The file is the result's `to_dict()` report (what scripts and readers of the JSON use) with one
more key, `"ra_lens.record"`: every dataclass field encoded so that `load` rebuilds an equal
object. A tensor is its dtype, shape and raw bytes (base64: exact, NaN kept), a nested dataclass
(a `Graph`, an `EdgeScores`, an `Accuracy`) its module, class and fields, a float that JSON cannot
hold (NaN, inf) a tagged string. A field added to a class later round-trips without edits here.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import math
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from ra_lens.files import load_json, write_file

T = TypeVar("T")

#: The key of the encoded fields in the file (the rest is the report).
KEY = "ra_lens.record"


class Recorded:
    """`save` / `load` of a dataclass result whose report is `to_dict()`: the one file format of
    the results that are not safetensors files (the module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} writes no report")  # each class does

    def save(self, path: str | Path) -> None:
        """Write `to_dict()` (strict JSON, NaN as null) and every field, so that `load` gives
        the result back equal, to one JSON file (atomic, through symlinks, folders made)."""
        write(self, path, self.to_dict())

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Read a file `save` wrote; another class's file or a damaged one is refused with a
        ValueError naming the file."""
        return read(cls, path)


def write(obj: Any, path: str | Path, report: dict[str, Any]) -> None:
    """Write `report` (NaN and inf as null) plus `obj`'s fields under KEY as strict JSON to
    `path` (`files.write_file`: atomic, through symlinks, missing folders made)."""
    data = {**json_ready(report), KEY: encode(obj)}
    write_file(path, json.dumps(data, indent=1, allow_nan=False) + "\n", make_folders=True)


def read(cls: type[T], path: str | Path) -> T:
    """Read a file written by `write` for `cls`; another class's file or a damaged one is refused
    with one ValueError naming the file."""
    what = f"a {cls.__name__} file ({cls.__name__}.save)"
    data = load_json(path, what)
    try:
        if not isinstance(data, dict) or KEY not in data:
            raise ValueError(f"no {KEY!r} key")
        found = data[KEY].get("class") if isinstance(data[KEY], dict) else None
        if found != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"it holds a {found}")
        obj = decode(data[KEY])
    except (KeyError, TypeError, ValueError, AttributeError, ImportError) as error:
        raise ValueError(f"{path} is not {what}: {type(error).__name__}: {error}") from None
    return obj  # type: ignore[no-any-return]  # decode built a cls (checked by name above)


def json_ready(value: Any) -> Any:
    """`value` with NaN and inf as None (strict JSON, for a report), through lists and dicts.

    >>> json_ready([1.0, float("nan")])
    [1.0, None]
    """
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode(value: Any) -> Any:
    """A JSON-ready form of `value` that `decode` turns back into an equal value."""
    if isinstance(value, Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        dtype = str(data.dtype).removeprefix("torch.")
        return {"tensor": dtype, "shape": list(data.shape), "bytes": base64.b64encode(raw).decode()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a dict with keys {list(value)}: only str keys are saved")
        return {"dict": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot save a {type(value).__name__} field")


def decode(data: Any) -> Any:
    """The value `encode` encoded."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "tensor" in data:
        dtype = getattr(torch, data["tensor"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['tensor']!r}")
        raw = bytearray(base64.b64decode(data["bytes"]))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(data["shape"]).clone()
    if "class" in data:
        module, _, name = data["class"].partition(":")
        if not module.startswith("ra_lens."):
            raise ValueError(f"{data['class']} is not an ra_lens class")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"{data['class']} is not a result class")
        fields = {k: decode(v) for k, v in data["fields"].items()}
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for k in set(fields) - init:  # fields filled after construction
            object.__setattr__(obj, k, fields[k])
        return obj
    if "float" in data:
        return float(data["float"])
    if "dict" in data:
        return {k: decode(v) for k, v in data["dict"].items()}
    if "tuple" in data:
        return tuple(decode(v) for v in data["tuple"])
    raise ValueError(f"an entry with keys {sorted(data)}")
