"""Long context: reversed_attention(memory="layerwise") against the default single pass.

    python benchmarks/bench_long_context.py --compare 1024 --json bench_out/long_context.json
    python benchmarks/bench_long_context.py --lengths 2048 4096 --json bench_out/long_context.json
    python benchmarks/bench_long_context.py --quick ...          # tiny model, a smoke test

--compare T: at one length where the default route fits, peak memory and time of the floor (one
forward + one backward to blocks.0.hook_resid_pre, no RA hooks), the default route and the
layerwise route (keep="norms" and "rows"), with the ratios measured in this one run. The default
route is also measured at T/4 and T/2, and its peak memory fitted as a + b*T + c*T^2 (its graph
keeps every layer's T^2 attention), which gives the "formula" figure at lengths where it does not
fit. --lengths: the layerwise route alone at each length, keep="norms" and "rows", batch 1.

Memory: the peak of live tensor bytes created by the call, tracked by a TorchDispatchMode with a
finalizer on each new storage (the CPU analogue of torch.cuda.max_memory_allocated; the same
method as bench_ra.py, in a smaller copy here so the two files stay independent); on CUDA
torch.cuda.max_memory_allocated. Time: process CPU time with one thread (what another process's
load on a shared machine barely moves), wall time on CUDA; at --compare the median of --repeats
interleaved untracked runs, at --lengths the single tracked run (the tracker adds Python work per
op, small next to T^2 kernels; said in the JSON). Results merge into the JSON file by key, so one
length can run at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from harness import LiveTensorBytes
from torch import Tensor

from ra_lens import capture, reversed_attention
from ra_lens.capture import RESID_PRE
from ra_lens.files import write_file
from ra_lens.metrics import target_nll
from ra_lens.timing import timed

MIB = 2**20
_FILLER = (
    "The committee met on a grey morning to review the quarterly reports. Each department "
    "presented its figures, and the discussion moved slowly from budgets to schedules. "
)


@contextlib.contextmanager
def peak_memory(device: str, out: dict[str, float]) -> Iterator[None]:
    """out["peak_mb"]: peak extra memory of the block; out["seconds"]: its time (wall on CUDA,
    process CPU time on the CPU)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with timed(out, "seconds"):
            yield
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / MIB
        return
    tracker = LiveTensorBytes()
    with timed(out, "seconds", clock=time.process_time), tracker:
        yield
    out["peak_mb"] = tracker.peak / MIB


def long_tokens(model: Any, n_tokens: int) -> Tensor:
    """[1, n_tokens] ids: BOS and a repeated office paragraph (content does not change cost)."""
    text = _FILLER * (n_tokens // 20 + 2)
    ids = model.to_tokens(text)[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"filler gave {ids.shape[1]} tokens, fewer than {n_tokens}")
    return ids


def floor(model: Any, tokens: Tensor, target: Tensor) -> None:
    """The default route minus the RA hooks: leaf at blocks.0.hook_resid_pre, autograd.grad to it."""
    store: dict[str, Tensor] = {}
    with capture.preserved_state(model), torch.enable_grad():
        with model.hooks(fwd_hooks=[(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]):
            loss = target_nll(target)(model(tokens)).sum()
            torch.autograd.grad(loss, [store["leaf"]])


def runners(model: Any, tokens: Tensor, target: Tensor) -> dict[str, Callable[[], Any]]:
    def ra(keep: str, memory: str) -> Callable[[], Any]:
        return lambda: reversed_attention(
            model,
            tokens,
            target_nll(target),
            keep=keep,  # type: ignore[arg-type]
            memory=memory,  # type: ignore[arg-type]
        )

    return {
        "floor": lambda: floor(model, tokens, target),
        "full_norms": ra("norms", "full"),
        "layerwise_norms": ra("norms", "layerwise"),
        "layerwise_rows": ra("rows", "layerwise"),
    }


def compare(model: Any, n_tokens: int, repeats: int, device: str) -> dict[str, Any]:
    """Peak memory and time of floor, default and layerwise routes at one length; the fit."""
    fit_lengths = [n_tokens // 4, n_tokens // 2, n_tokens]
    full_peaks = {}
    for n in fit_lengths[:-1]:
        out: dict[str, float] = {}
        tokens = long_tokens(model, n).to(device)
        with peak_memory(device, out):
            runners(model, tokens, tokens[:, -1])["full_norms"]()
        full_peaks[n] = out["peak_mb"]
        print(f"full route at {n} tokens: {out['peak_mb']:.0f} MiB", flush=True)
    tokens = long_tokens(model, n_tokens).to(device)
    run = runners(model, tokens, tokens[:, -1])
    memory: dict[str, float] = {}
    for name, fn in run.items():
        out = {}
        with peak_memory(device, out):
            fn()
        memory[name] = out["peak_mb"]
        print(f"{name} at {n_tokens}: peak {out['peak_mb']:.0f} MiB", flush=True)
    full_peaks[n_tokens] = memory["full_norms"]
    times: dict[str, list[float]] = {name: [] for name in run}
    now = time.perf_counter if device.startswith("cuda") else time.process_time
    for _ in range(repeats):
        for name, fn in run.items():  # interleaved: a load change hits every route alike
            span: dict[str, float] = {}
            with timed(span, name, clock=now):
                fn()
            times[name].append(span[name])
    seconds = {name: statistics.median(values) for name, values in times.items()}
    print({name: round(s, 2) for name, s in seconds.items()}, flush=True)
    coeffs = _fit_quadratic(full_peaks)
    return {
        "n_tokens": n_tokens,
        "peak_mb": memory,
        "seconds": seconds,
        "seconds_all": times,
        "ratios": {
            "layerwise_norms_memory_vs_full": memory["layerwise_norms"] / memory["full_norms"],
            "layerwise_rows_memory_vs_full": memory["layerwise_rows"] / memory["full_norms"],
            "layerwise_norms_time_vs_floor": seconds["layerwise_norms"] / seconds["floor"],
            "layerwise_rows_time_vs_floor": seconds["layerwise_rows"] / seconds["floor"],
            "full_norms_time_vs_floor": seconds["full_norms"] / seconds["floor"],
        },
        "full_route_peak_mb_measured": {str(n): v for n, v in full_peaks.items()},
        "full_route_peak_mb_fit": {
            "a": coeffs[0],
            "b_per_token": coeffs[1],
            "c_per_token2": coeffs[2],
        },
        "full_route_peak_mb_formula": {str(n): _quadratic(coeffs, n) for n in (2048, 4096, 8192)},
    }


def _fit_quadratic(points: dict[int, float]) -> list[float]:
    """a, b, c with a + b*T + c*T^2 through three (T, MiB) points."""
    xs = sorted(points)
    design = torch.tensor([[1.0, x, x * x] for x in xs], dtype=torch.float64)
    ys = torch.tensor([points[x] for x in xs], dtype=torch.float64)
    return torch.linalg.solve(design, ys).tolist()


def _quadratic(coeffs: list[float], n: int) -> float:
    return coeffs[0] + coeffs[1] * n + coeffs[2] * n * n


def layerwise_only(model: Any, n_tokens: int, keep: str, device: str) -> dict[str, Any]:
    tokens = long_tokens(model, n_tokens).to(device)
    out: dict[str, float] = {}
    with peak_memory(device, out):
        ra = reversed_attention(
            model,
            tokens,
            target_nll(tokens[:, -1]),
            keep=keep,  # type: ignore[arg-type]
            memory="layerwise",
        )
    print(f"layerwise keep={keep} at {n_tokens}: {out}", flush=True)
    return {
        "n_tokens": n_tokens,
        "keep": keep,
        "peak_mb": out["peak_mb"],
        "seconds": out["seconds"],
        "timed_inside_memory_tracker": not device.startswith("cuda"),
        "top_heads": ra.top_heads(3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=int, default=None, help="length for the ratios")
    parser.add_argument("--lengths", type=int, nargs="*", default=[])
    parser.add_argument("--keep", nargs="*", default=["norms", "rows"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, short lengths")
    parser.add_argument("--json", type=Path, default=Path("bench_out/long_context.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        from ra_lens.toy_models import tiny_model

        model = tiny_model("llama", n_ctx=256).to(args.device)
    else:
        from ra_lens.models import load_model

        model = load_model(device=args.device)
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    results["meta"] = {
        "model": model.cfg.model_name,
        "device": args.device,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "memory_method": "peak live tensor bytes (TorchDispatchMode)"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated",
        "time_method": "process CPU time" if args.device == "cpu" else "wall time",
    }
    if args.compare:
        results[f"compare_{args.compare}"] = compare(model, args.compare, args.repeats, args.device)
        _write(args.json, results)
    for n in args.lengths:
        for keep in args.keep:
            results[f"layerwise_{n}_{keep}"] = layerwise_only(model, n, keep, args.device)
            _write(args.json, results)
    growth = {
        keep: results[f"layerwise_8192_{keep}"]["peak_mb"]
        / results[f"layerwise_4096_{keep}"]["peak_mb"]
        for keep in ("norms", "rows")
        if f"layerwise_8192_{keep}" in results and f"layerwise_4096_{keep}" in results
    }
    if growth:
        results["growth_4096_to_8192"] = growth
        _write(args.json, results)


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
