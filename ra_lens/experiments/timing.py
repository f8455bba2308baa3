"""Wall-clock spans for experiment reports (never used for assertions in tests)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


def _sync() -> None:
    # CUDA runs asynchronously: without this a span would end before its kernels do.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the time spent in the block to seconds[name] (CUDA work finished at both ends).

    >>> seconds = {}
    >>> with timed(seconds, "work"):
    ...     _ = sum(range(1000))
    >>> with timed(seconds, "work"):  # adds up
    ...     pass
    >>> list(seconds), seconds["work"] > 0
    (['work'], True)
    """
    _sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
