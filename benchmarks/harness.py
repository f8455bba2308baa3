"""Benchmark harness: clocks, peak-memory meters and run groups. The timer is the library's one
`ra_lens.timing.timed` (CUDA synchronised at both ends); nothing else of ra_lens here.

The method (what is timed and how, why the CPU clock, how memory is counted) is described once, in
benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ra_lens.timing import timed

MIB = 2**20
Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# Clocks and timers: the clock is always passed in, never global
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """What a timer reads: `name` ("cpu" or "wall") and `read()` in seconds."""

    name: str
    read: Callable[[], float]


CPU_CLOCK = Clock("cpu", time.process_time)
WALL_CLOCK = Clock("wall", time.perf_counter)


def choose_clock(device: str, threads: int, wall: bool = False) -> Clock:
    """Process CPU time on the CPU with one intra-op thread, wall time otherwise.

    With one thread, another process's load barely moves CPU time; with several threads CPU time
    adds up over threads, and on CUDA the host waits on the device: there only wall time means
    anything. `wall=True` forces wall time."""
    return CPU_CLOCK if device == "cpu" and threads == 1 and not wall else WALL_CLOCK


def make_tokens(vocab: int, batch: int, length: int, seed: int, device: str) -> Tensor:
    """Seeded random token ids in [3, vocab) (ids below 3 are special in the tiny tokenizers)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).to(device)


# ---------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------


def _rss_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active and still alive: the CPU counterpart
    of torch.cuda.max_memory_allocated.

    Every op's outputs pass through __torch_dispatch__ (forward, backward and hooks alike, on this
    thread); a storage not aliasing an input is new, and a weakref finalizer on its Python object
    (which torch keeps alive exactly as long as the storage) subtracts it when it is freed. Tensors
    that existed before (weights, inputs) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, Tensor) and not t.is_meta
        }
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or getattr(storage, "_ra_bench_tracked", False):
                continue
            nbytes = storage.nbytes()
            storage._ra_bench_tracked = True
            weakref.finalize(storage, self._freed, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            inputs.add(key)
        return out


class PeakMemory:
    """Peak extra memory of one call: `with meter.measure(out): ...` fills out["peak_mb"].

    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated
    before. CPU: the peak of live tensor bytes created by the call (LiveTensorBytes), and, as a
    secondary figure (out["rss_peak_mb"]), the Linux peak resident set (VmHWM reset through
    /proc/self/clear_refs) minus the resident set before, after gc.collect() and malloc_trim(0).
    """

    def __init__(self, device: str):
        self.device = device
        self._libc = None
        self._hwm = False
        if device.startswith("cuda"):
            self.method = "torch.cuda.max_memory_allocated - memory_allocated before"
            return
        self.method = (
            "peak live tensor bytes created by the call (TorchDispatchMode + storage finalizers; "
            "the CPU analogue of torch.cuda.max_memory_allocated)"
        )
        with contextlib.suppress(OSError):
            self._libc = ctypes.CDLL("libc.so.6")
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self._hwm = _rss_kib("VmHWM") is not None
        except OSError:
            self._hwm = False

    @contextlib.contextmanager
    def measure(self, out: dict[str, float]) -> Iterator[None]:
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            yield
            torch.cuda.synchronize()
            out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / MIB
            return
        if self._libc is not None:
            self._libc.malloc_trim(0)
        base_rss = _rss_kib("VmRSS")
        if self._hwm:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        tracker = LiveTensorBytes()
        with tracker:
            yield
        out["peak_mb"] = tracker.peak / MIB
        if self._hwm and base_rss is not None:
            out["rss_peak_mb"] = ((_rss_kib("VmHWM") or 0) - base_rss) / 1024


def calibrate(memory: PeakMemory, device: str) -> dict[str, float]:
    """Peak memory of a 256 MiB tensor plus a 64 MiB temporary: checks the meter (320 MiB)."""
    out: dict[str, float] = {}
    with memory.measure(out):
        x = torch.ones(256 * MIB // 4, device=device)
        y = x[: 64 * MIB // 4] * 2  # a temporary, freed before the next allocation
        del y
        z = x[: 32 * MIB // 4] + 1
        del x, z
    return {"expected_mb": 320.0, "measured_mb": round(out["peak_mb"], 1)}


# ---------------------------------------------------------------------------------------------
# Run groups: configurations measured side by side
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One measured configuration: a name, a zero-argument callable and how often to time it."""

    name: str
    fn: Callable[[], Any]
    reps: int
    memory: bool = True  # measure its peak memory (a separate, untimed run that is the warm-up)


def run_group(
    configs: list[Config], *, clock: Clock, device: str, memory: PeakMemory, log: Log
) -> dict[str, dict[str, Any]]:
    """Time and memory of configurations measured side by side.

    First one untimed run of every configuration under the memory meter (it is also the warm-up;
    configurations with memory=False get no warm-up run). Then the timed runs, interleaved
    round-robin with a rotating order, `config.reps` each, so that a load spike from another
    process hits every configuration alike. Returns name -> {"times_s", "wall_times_s",
    "median_s" (on `clock`), "wall_median_s", "reps", "peak_mb", ...}.
    """
    results: dict[str, dict[str, Any]] = {
        c.name: {"times_s": [], "wall_times_s": []} for c in configs
    }
    for c in configs:
        if not c.memory:
            results[c.name]["peak_mb"] = float("nan")
            continue
        out: dict[str, float] = {}
        with memory.measure(out):
            spans: dict[str, float] = {}
            with timed(spans, c.name, clock=clock.read):
                result = c.fn()
            elapsed = spans[c.name]
            del result
        results[c.name].update(out)
        results[c.name]["memory_run_s"] = elapsed
        log(
            f"    {c.name:<19} memory run {elapsed:8.3f} s: peak +{out['peak_mb']:9.1f} MiB "
            f"(RSS +{out.get('rss_peak_mb', float('nan')):.0f} MiB)"
        )
    for rep in range(max(c.reps for c in configs)):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for c in order:
            if len(results[c.name]["times_s"]) >= c.reps:
                continue
            gc.collect()
            wall_start = WALL_CLOCK.read()
            spans = {}
            with timed(spans, c.name, clock=clock.read):
                result = c.fn()
            results[c.name]["wall_times_s"].append(WALL_CLOCK.read() - wall_start)
            results[c.name]["times_s"].append(spans[c.name])
            del result
    for c in configs:
        r = results[c.name]
        r["median_s"] = statistics.median(r["times_s"])
        r["wall_median_s"] = statistics.median(r["wall_times_s"])
        r["reps"] = len(r["times_s"])
        log(
            f"    {c.name:<19} median {r['median_s']:8.3f} s ({clock.name}) over "
            f"{r['reps']}; wall {r['wall_median_s']:.3f} s"
        )
    return results
