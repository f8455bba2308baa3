"""The one timer of the experiments and benchmarks: wall-clock (or any clock's) spans with the
device's queued work finished at both ends (never used for assertions in tests)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch


def sync() -> None:
    """Wait for queued CUDA work (a no-op without CUDA): without it a span would end before its
    kernels do."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cpu_time() -> float:
    """Process CPU time (`time.process_time`), the clock of the circuits' `seconds` and time
    budgets (a busy machine stretches it less than wall time): pass it as `clock`.

    >>> cpu_time() >= 0
    True
    """
    return time.process_time()


def now(clock: Callable[[], float] = time.perf_counter) -> float:
    """`clock()` read once queued CUDA work is done: the marks of a running total read while it
    runs (a study's runtime, shown after each task), where a `timed` block does not fit.

    >>> start = now()
    >>> now() - start >= 0
    True
    """
    sync()
    return clock()


@contextlib.contextmanager
def timed(
    seconds: dict[str, float], name: str, *, clock: Callable[[], float] = time.perf_counter
) -> Iterator[None]:
    """Add the time spent in the block to seconds[name], read on `clock` (default: wall time;
    the benchmarks and circuits pass `cpu_time`), CUDA work finished at both ends.

    >>> seconds = {}
    >>> with timed(seconds, "work"):
    ...     _ = sum(range(1000))
    >>> with timed(seconds, "work"):  # adds up
    ...     pass
    >>> list(seconds), seconds["work"] > 0
    (['work'], True)
    """
    start = now(clock)
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + now(clock) - start
