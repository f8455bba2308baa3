"""The one check of a whole-number argument (a count such as `steps`, `batch_size`, `k`,
`n_boot`): every function that takes one refuses a bad value with the same message, naming the
parameter. On the ground floor: it imports nothing of ra_lens."""

from __future__ import annotations

from typing import Any


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
