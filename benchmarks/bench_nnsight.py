"""RA through nnsight against RA through the TransformerLens bridge: the same model and weights,
timed side by side in one process, and the ratios nnsight / bridge of time and peak memory.

    python benchmarks/bench_nnsight.py --json bench_out/bench_nnsight.json   # SmolLM2, 1,024 tokens
    python benchmarks/bench_nnsight.py --length 256 --reps 2                  # shorter
    python benchmarks/bench_nnsight.py --tiny --json out.json                 # tiny Llama (smoke test)

The bridge is the embedded SmolLM2-135M-Instruct (`ra_lens.models.load_model`); the nnsight model
is `nnsight.TransformersModel` around a plain HuggingFace copy of that bridge's weights
(`baselines.plain_hf_copy`, eager attention), so both routes compute the same RA (checked in the
run: their norms agree to 1e-4). Each route runs `ra_lens.reversed_attention` with keep="norms"
and keep="maps". The plain-HF forward+backward without RA (`OfficialStyleLoop.floor`) and the
bridge's floor (`baselines.floor`) are timed beside them, which separates nnsight's own cost
from what the bridge costs over plain HuggingFace.

Time: `harness.run_group` (median of interleaved repetitions after a warm-up, process CPU time
with one thread, wall time on CUDA). Peak memory, two figures:
- `peak_mb` (the goal's basis): the harness's meter, the peak of live tensor bytes created by the
  call (a TorchDispatchMode; nnsight runs its intervention code in greenlets on the calling
  thread, so the mode sees every op of the trace, forward, backward and the reductions), the CPU
  analogue of torch.cuda.max_memory_allocated; on CUDA max_memory_allocated itself.
- `fresh_rss_peak_mb` (CPU only): in a fresh subprocess per route, the rise of the Linux peak resident
  set (VmHWM, reset through /proc/self/clear_refs after a short warm-up and malloc_trim) over the
  resident set before the call: everything the process touched, Python objects and allocator
  slack included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from baselines import OfficialStyleLoop, floor, plain_hf_copy
from harness import (
    WALL_CLOCK,
    Clock,
    Config,
    Log,
    PeakMemory,
    _rss_kib,
    choose_clock,
    make_tokens,
    run_group,
)
from torch import Tensor

from ra_lens import capture, reversed_attention
from ra_lens.files import write_file
from ra_lens.metrics import target_nll
from ra_lens.nnsight.adapter import hf_module

GOAL = 1.3  # nnsight / bridge, time and peak memory, each keep
KEEPS = ("norms", "maps")


def nnsight_available() -> str | None:
    """None where nnsight can be imported, else the reason it cannot (for a "skipped" entry)."""
    try:  # a name from the package itself: under pytest, tests/nnsight/ also imports as "nnsight"
        from nnsight import TransformersModel  # noqa: F401
    except ImportError as error:
        return f"nnsight is not installed here ({error}); it needs transformers >= 5 (.venv)"
    return None


def load_bridge(tiny: bool, device: str) -> Any:
    """The embedded SmolLM2-135M-Instruct as a bridge, or a tiny Llama bridge (GQA)."""
    if tiny:
        from ra_lens.toy_models import tiny_model

        return tiny_model("llama", d_model=64, n_layers=2, n_heads=4, n_ctx=256).to(device)
    from ra_lens.models import load_model

    return load_model(device=device)


def wrap_in_nnsight(bridge: Any) -> Any:
    """nnsight.TransformersModel around a plain HuggingFace copy of the bridge's weights."""
    import nnsight

    return nnsight.TransformersModel(plain_hf_copy(bridge), tokenizer=bridge.tokenizer)


def routes(bridge: Any, nn_model: Any, tokens: Tensor, targets: Tensor) -> dict[str, Callable]:
    """The timed callables: RA by each route and keep, and the two floors (no RA)."""
    metric = target_nll(targets)
    scales = [capture.attention_scale(bridge, la) for la in range(bridge.cfg.n_layers)]
    hf_loop = OfficialStyleLoop(hf_module(nn_model), scales)

    def ra(model: Any, keep: str) -> Callable[[], Any]:
        return lambda: reversed_attention(model, tokens, metric, keep=keep)  # type: ignore[arg-type]

    out: dict[str, Callable] = {
        "bridge_floor": lambda: floor(bridge, tokens, targets),
        "hf_floor": lambda: hf_loop.floor(tokens, targets, per_prompt=False),
    }
    for keep in KEEPS:
        out[f"bridge_{keep}"] = ra(bridge, keep)
        out[f"nnsight_{keep}"] = ra(nn_model, keep)
    return out


def compare(
    bridge: Any,
    nn_model: Any,
    *,
    batch: int,
    length: int,
    reps: int,
    clock: Clock,
    device: str,
    log: Log,
) -> dict[str, Any]:
    """Both routes and both floors timed side by side at (batch, length); ratios and goals.

    Returns {"measurements": run_group's results, "ratios": {...}, "goals": [...],
    "max_norm_rel_diff": nnsight vs bridge norms (the two routes compute the same RA)}."""
    vocab = int(bridge.cfg.d_vocab)
    tokens = make_tokens(vocab, batch, length, 1, device)
    targets = make_tokens(vocab, 1, batch, 2, device)[0]
    fns = routes(bridge, nn_model, tokens, targets)
    same = (fns["nnsight_norms"]().norms, fns["bridge_norms"]().norms)
    diff = float(((same[0] - same[1]).abs() / same[1].abs().clamp_min(1e-12)).max())
    if diff > 1e-3:
        raise RuntimeError(f"nnsight and bridge RA norms differ by {diff:.2e}: not the same model")
    configs = [Config(name, fn, reps) for name, fn in fns.items()]
    results = run_group(configs, clock=clock, device=device, memory=PeakMemory(device), log=log)
    return {
        "batch": batch,
        "length": length,
        "max_norm_rel_diff": diff,
        "measurements": results,
        **ratios_and_goals(results),
    }


def ratios_and_goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """nnsight / bridge time and peak memory per keep (and RSS where measured); floors' ratios."""

    def r(a: str, b: str, what: str = "median_s") -> float | None:
        x, y = results.get(a, {}).get(what), results.get(b, {}).get(what)
        return None if x is None or y is None or not y or x != x or y != y else x / y

    ratios: dict[str, float | None] = {}
    for keep in KEEPS:
        ratios[f"nnsight_vs_bridge_time_{keep}"] = r(f"nnsight_{keep}", f"bridge_{keep}")
        ratios[f"nnsight_vs_bridge_peak_memory_{keep}"] = r(
            f"nnsight_{keep}", f"bridge_{keep}", "peak_mb"
        )
        if "fresh_rss_peak_mb" in results.get(f"nnsight_{keep}", {}):
            ratios[f"nnsight_vs_bridge_fresh_rss_peak_{keep}"] = r(
                f"nnsight_{keep}", f"bridge_{keep}", "fresh_rss_peak_mb"
            )
        ratios[f"nnsight_{keep}_vs_hf_floor"] = r(f"nnsight_{keep}", "hf_floor")
        ratios[f"bridge_{keep}_vs_bridge_floor"] = r(f"bridge_{keep}", "bridge_floor")
    ratios["bridge_floor_vs_hf_floor"] = r("bridge_floor", "hf_floor")
    goals = []
    for key in [k for k in ratios if k.startswith("nnsight_vs_bridge_") and "rss" not in k]:
        value = ratios[key]
        status = "n/a" if value is None else ("PASS" if value <= GOAL else "MISS")
        goals.append({"ratio": key, "value": value, "target": f"<= {GOAL}", "status": status})
    return {"ratios": ratios, "goals": goals}


# ---------------------------------------------------------------------------------------------
# Peak resident set, one fresh process per route (CPU)
# ---------------------------------------------------------------------------------------------


def rss_child(route: str, tiny: bool, batch: int, length: int) -> dict[str, float]:
    """In this (fresh) process: build both models, warm the route up on 8 tokens, then the rise of
    VmHWM over VmRSS across one call at (batch, length). Both models are built in every child, so
    the processes differ only in the route run."""
    import ctypes
    import gc

    torch.set_num_threads(1)
    bridge = load_bridge(tiny, "cpu")
    nn_model = wrap_in_nnsight(bridge)
    vocab = int(bridge.cfg.d_vocab)
    warm = routes(bridge, nn_model, make_tokens(vocab, 1, 8, 0, "cpu"), torch.tensor([5]))
    warm[route]()
    tokens = make_tokens(vocab, batch, length, 1, "cpu")
    targets = make_tokens(vocab, 1, batch, 2, "cpu")[0]
    fn = routes(bridge, nn_model, tokens, targets)[route]
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident set
    before = _rss_kib("VmRSS")
    result = fn()
    peak = _rss_kib("VmHWM")
    del result
    if before is None or peak is None:
        raise RuntimeError("no /proc/self/status VmRSS/VmHWM on this system")
    return {"fresh_rss_peak_mb": (peak - before) / 1024}


def rss_peaks(tiny: bool, batch: int, length: int, names: list[str], log: Log) -> dict[str, Any]:
    """route -> {"fresh_rss_peak_mb"}: `rss_child` of each route in its own `python` process."""
    out = {}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in names:
        cmd = [sys.executable, __file__, "--rss-child", name, "--batch", str(batch)]
        cmd += ["--length", str(length)] + (["--tiny"] if tiny else [])
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"rss child {name} failed: {done.stderr[-2000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"    {name:<19} fresh process: peak RSS +{out[name]['fresh_rss_peak_mb']:9.1f} MiB")
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny Llama, 32 tokens (smoke test)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=None, help="tokens (1024; --tiny: 32)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (3; --tiny: 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS figures")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    length = args.length or (32 if args.tiny else 1024)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.tiny, args.batch, length)))
        return {}
    log: Log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    started = WALL_CLOCK.read()
    reason = nnsight_available()
    if reason:
        raise SystemExit(f"bench_nnsight: {reason}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    clock = choose_clock(args.device, torch.get_num_threads())
    bridge = load_bridge(args.tiny, args.device)
    nn_model = wrap_in_nnsight(bridge)
    log(
        f"bench_nnsight: {bridge.cfg.model_name}, batch {args.batch}, length {length}, {clock.name}"
    )
    res = compare(
        bridge,
        nn_model,
        batch=args.batch,
        length=length,
        reps=args.reps or (1 if args.tiny else 3),
        clock=clock,
        device=args.device,
        log=log,
    )
    if args.device == "cpu" and not args.no_rss:
        names = [n for n in res["measurements"] if "floor" not in n]
        for name, fig in rss_peaks(args.tiny, args.batch, length, names, log).items():
            res["measurements"][name].update(fig)
        res.update(ratios_and_goals(res["measurements"]))
    res["meta"] = {
        "model": bridge.cfg.model_name,
        "tiny": args.tiny,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "time_basis": clock.name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memory_method": PeakMemory(args.device).method,
        "rss_method": "fresh process per route: VmHWM - VmRSS across one call (after a warm-up)",
        "wall_s": WALL_CLOCK.read() - started,
    }
    log("")
    for key, value in res["ratios"].items():
        log(f"  {key:<40} {'-' if value is None else f'{value:8.3f}'}")
    log("Goals:")
    for g in res["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        log(f"  [{g['status']:<4}] {g['ratio']:<40} {value} (target {g['target']})")
    if args.tiny:
        log("  (tiny model: the PASS/MISS above only checks the plumbing, not the goals)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(res, indent=1, default=float))
        log(f"JSON: {args.json}")
    return res


if __name__ == "__main__":
    main()
