"""The one check of a whole-number argument (a count such as `steps`, `batch_size`, `k`,
`n_boot`), of a list of layers and of `reversed_attention`'s options: every function that takes
one refuses a bad value with the same message, naming the parameter. On the ground floor: it
imports nothing of ra_lens but its type aliases and `math`'s names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.math import CONVENTIONS


def check_count(value: Any, name: str, minimum: int = 1, why: str = "") -> int:
    """`value` when it is an int >= `minimum` (True and 1.0 are not ints here), else a
    ValueError naming the parameter, with `why` the minimum is what it is, when given.

    >>> check_count(5, "steps")
    5
    >>> check_count(0, "steps")
    Traceback (most recent call last):
    ValueError: steps must be an int >= 1, got 0
    >>> check_count(1, "n_prompts", 2, why="RA is averaged over the training prompts")
    Traceback (most recent call last):
    ValueError: n_prompts must be an int >= 2 (RA is averaged over the training prompts), got 1
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}{reason}, got {value!r}")
    return value


def check_layers(layers: Validated[Sequence[int]] | None, n_layers: int) -> list[int]:
    """The chosen layer indices, checked; None means all layers.

    Raises:
        TypeError, ValueError: see `check_layer_list`; also a layer outside 0..n_layers-1.

    >>> check_layers(None, 3), check_layers([0, 2], 3)
    ([0, 1, 2], [0, 2])
    >>> check_layers([2, 0], 3)
    Traceback (most recent call last):
    ValueError: layers [2, 0] are not in increasing order: pass [0, 2]
    """
    if layers is None:
        return list(range(n_layers))
    chosen = check_layer_list(layers)
    bad = [layer for layer in chosen if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"layers {chosen} out of range: the model has layers 0..{n_layers - 1}")
    return chosen


def check_layer_list(layers: Validated[Sequence[int]]) -> list[int]:
    """Layer indices as given, refused rather than silently fixed when they are not ints, empty,
    repeated or out of order (results are laid out in the order given, and the backward pass
    stops at the first layer)."""
    if isinstance(layers, (int, str)) or isinstance(layers, Tensor) and layers.ndim == 0:
        raise TypeError(f"layers must be a sequence of ints, e.g. [{layers}], got {layers!r}")
    chosen = [layer.item() if isinstance(layer, Tensor) else layer for layer in layers]
    not_int = [la for la in chosen if isinstance(la, bool) or not isinstance(la, int)]
    if not_int:
        raise TypeError(f"layers must be ints, got {not_int}: pass e.g. [0, 3, 5]")
    if not chosen:
        raise ValueError(
            "layers=[] is out of range (empty): pass at least one layer, or None for all"
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers {chosen} repeat a layer: pass each layer once")
    if chosen != sorted(chosen):
        raise ValueError(f"layers {chosen} are not in increasing order: pass {sorted(chosen)}")
    return chosen


def check_ra_options(keep: str, convention: str, rows_at: Any) -> None:
    """`reversed_attention`'s keep / convention / rows_at, refused naming the choices (the same
    for TransformerLens and nnsight models).

    >>> check_ra_options("rows", "qk", None)
    >>> check_ra_options("all", "qk", None)
    Traceback (most recent call last):
    ValueError: unknown keep 'all': choose 'maps', 'norms' or 'rows'
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}: choose one of {CONVENTIONS}")
    if keep not in ("maps", "norms", "rows"):
        raise ValueError(f"unknown keep {keep!r}: choose 'maps', 'norms' or 'rows'")
    if rows_at is not None and keep != "rows":
        raise ValueError("rows_at chooses the rows of keep='rows': pass keep='rows' with it")
