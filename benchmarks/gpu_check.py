"""The GPU run sheet: on one CUDA machine, in under 8 minutes, the figures a CPU cannot give,
printed as one JSON object.

    python benchmarks/gpu_check.py --json bench_out/gpu_check.json    # CUDA, SmolLM2-135M
    python benchmarks/gpu_check.py --smoke --json out.json            # CPU, tiny Llama, seconds

Sections (each also under "seconds" with its own run time):
- `bf16_vs_fp32`: RA of the model in bfloat16 against float32 on the same weights (relative
  Frobenius error of the maps and of the per-head norms; overlap of the top-10 heads).
- `norms_vs_floor`: RA keep="norms" (and "maps") time and peak memory over the floor, the
  forward+backward without RA (`baselines.floor`), timed by `harness.run_group`.
- `causal_mediation_vs_ra`: the library's causal-mediation scan (`bench_ra.measure_causal_mediation`)
  over RA keep="norms" at the same batch and length.
- `layerwise_long`: `memory="layerwise"` keep="norms" at 8,192 tokens
  (`bench_long_context.layerwise_only`): peak bytes and tokens per second.
- `nnsight_vs_bridge`: RA through nnsight over RA through the bridge (`bench_nnsight.compare`).
- `split_vs_unsplit`: the bridge booted on a HuggingFace model split by accelerate's device_map
  over cuda:0 and the CPU (--smoke: the CPU and disk offload) gives the unsplit model's RA.

The JSON goes to stdout (and to --json FILE), progress to stderr. A section that cannot run here
says {"skipped": "<reason>"}; one that fails says {"error": "<what>"} and the others still run
(exit status 1). The method of each figure is that of the benchmark it reuses
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_long_context
import bench_nnsight
import torch
from baselines import floor, plain_hf_copy
from bench_ra import measure_causal_mediation, ra
from harness import WALL_CLOCK, Clock, Config, Log, PeakMemory, choose_clock, make_tokens, run_group
from torch import Tensor

from ra_lens import reversed_attention
from ra_lens.files import write_file
from ra_lens.metrics import target_nll
from ra_lens.models import bridge_available
from ra_lens.timing import timed

MIB = 2**20


@dataclass(frozen=True)
class Sizes:
    """Lengths and repetitions of one run (batch 1 throughout)."""

    model: str  # "smollm2" or "tiny"
    bf16_len: int
    floor_len: int  # norms / floor and nnsight / bridge
    cm_len: int  # causal mediation / RA
    long_len: int  # memory="layerwise"
    split_len: int
    reps: int


GPU_SIZES = Sizes("smollm2", 128, 1024, 64, 8192, 128, 5)
SMOKE_SIZES = Sizes("tiny", 16, 32, 8, 96, 16, 1)


def load(sizes: Sizes, device: str, dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M-Instruct (bridge under TL 4, HookedTransformer under TL 2), or a tiny Llama."""
    if sizes.model == "tiny":
        from ra_lens.toy_models import tiny_model

        arch = "llama" if bridge_available() else "hooked"
        model = tiny_model(arch, d_model=64, n_layers=2, n_heads=4, n_ctx=256, dtype=dtype)
        return model.to(device)
    from ra_lens.models import load_model

    return load_model(device=device, dtype=dtype)


def rel_error(got: Tensor, ref: Tensor) -> float:
    """||got - ref||_F / ||ref||_F, in float64 on the CPU."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return float((got - ref).norm() / ref.norm())


def max_rel_diff(got: Tensor, ref: Tensor) -> float:
    """max |got - ref| / max |ref| (float64, CPU): the tests' measure of "equal"."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return float((got - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def bf16_vs_fp32(model: Any, sizes: Sizes, device: str) -> dict[str, Any]:
    """RA maps and norms of the bfloat16 model against the float32 one, same weights."""
    low = load(sizes, device, torch.bfloat16)
    tokens = make_tokens(int(model.cfg.d_vocab), 1, sizes.bf16_len, 1, device)
    targets = make_tokens(int(model.cfg.d_vocab), 1, 1, 2, device)[0]
    ref = ra(model, tokens, targets, "maps")
    got = ra(low, tokens, targets, "maps")
    del low
    top = min(10, ref.norms[0].numel() // 2)
    ref_top = {(la, h) for la, h, _ in ref.top_heads(top)}
    got_top = {(la, h) for la, h, _ in got.top_heads(top)}
    return {
        "tokens": sizes.bf16_len,
        "maps_rel_error": rel_error(got.maps, ref.maps),
        "norms_rel_error": rel_error(got.norms, ref.norms),
        "top_heads": top,
        "top_heads_overlap": len(ref_top & got_top) / top,
    }


def norms_vs_floor(model: Any, sizes: Sizes, device: str, clock: Clock, log: Log) -> dict[str, Any]:
    """bench_ra's floor, RA keep="norms" and keep="maps", side by side (batch 1, floor_len)."""
    vocab = int(model.cfg.d_vocab)
    tokens = make_tokens(vocab, 1, sizes.floor_len, 1, device)
    targets = make_tokens(vocab, 1, 1, 2, device)[0]
    configs = [
        Config("floor", lambda: floor(model, tokens, targets), sizes.reps),
        Config("ra_norms", lambda: ra(model, tokens, targets, "norms"), sizes.reps),
        Config("ra_maps", lambda: ra(model, tokens, targets, "maps"), sizes.reps),
    ]
    res = run_group(configs, clock=clock, device=device, memory=PeakMemory(device), log=log)
    fl = res["floor"]
    return {
        "tokens": sizes.floor_len,
        "seconds": {name: r["median_s"] for name, r in res.items()},
        "peak_mb": {name: r["peak_mb"] for name, r in res.items()},
        "norms_vs_floor": res["ra_norms"]["median_s"] / fl["median_s"],
        "maps_vs_floor": res["ra_maps"]["median_s"] / fl["median_s"],
        "norms_peak_memory_vs_floor": res["ra_norms"]["peak_mb"] / fl["peak_mb"],
    }


def causal_mediation_vs_ra(
    model: Any, sizes: Sizes, device: str, clock: Clock, log: Log
) -> dict[str, Any]:
    """One run of the causal-mediation scan over the median RA keep="norms" time (batch 1)."""
    vocab = int(model.cfg.d_vocab)
    tokens = make_tokens(vocab, 1, sizes.cm_len, 1, device)
    targets = make_tokens(vocab, 1, 1, 2, device)[0]
    configs = [Config("ra_norms", lambda: ra(model, tokens, targets, "norms"), sizes.reps)]
    ra_s = run_group(configs, clock=clock, device=device, memory=PeakMemory(device), log=log)
    cm = measure_causal_mediation(model, 1, sizes.cm_len, clock, device, log)
    return {
        "tokens": sizes.cm_len,
        "heads": cm["heads"],
        "causal_mediation_s": cm["median_s"],
        "ra_norms_s": ra_s["ra_norms"]["median_s"],
        "causal_mediation_vs_ra": cm["median_s"] / ra_s["ra_norms"]["median_s"],
    }


def layerwise_long(model: Any, sizes: Sizes, device: str) -> dict[str, Any]:
    """memory="layerwise" keep="norms" at long_len tokens, after a warm-up at long_len / 8."""
    bench_long_context.layerwise_only(model, max(sizes.long_len // 8, 16), "norms", device)
    out = bench_long_context.layerwise_only(model, sizes.long_len, "norms", device)
    return {
        "tokens": sizes.long_len,
        "peak_bytes": int(out["peak_mb"] * MIB),
        "seconds": out["seconds"],
        "tokens_per_s": sizes.long_len / out["seconds"],
        "timed_inside_memory_tracker": out["timed_inside_memory_tracker"],
    }


def nnsight_vs_bridge(
    model: Any, sizes: Sizes, device: str, clock: Clock, log: Log
) -> dict[str, Any]:
    """bench_nnsight.compare at (1, floor_len): the time and peak-memory ratios, per keep."""
    reason = bench_nnsight.nnsight_available()
    if reason:
        return {"skipped": reason}
    nn_model = bench_nnsight.wrap_in_nnsight(model)
    res = bench_nnsight.compare(
        model, nn_model, batch=1, length=sizes.floor_len, reps=sizes.reps, clock=clock,
        device=device, log=log,
    )  # fmt: skip
    return {
        "tokens": sizes.floor_len,
        "seconds": {name: r["median_s"] for name, r in res["measurements"].items()},
        "peak_mb": {name: r["peak_mb"] for name, r in res["measurements"].items()},
        "ratios": res["ratios"],
        "goals": res["goals"],
        "max_norm_rel_diff": res["max_norm_rel_diff"],
    }


def split_devices(device: str, smoke: bool) -> tuple[str, str] | str:
    """(first, second) devices of the split, or why there is no second one."""
    if device.startswith("cuda"):
        if torch.cuda.device_count() >= 2:
            return "cuda:0", "cuda:1"
        # Seen on an H200 (TL 4.3): boot_transformers raises its MIXED_OFFLOAD_GPU_ERROR for a
        # map that puts layers on a GPU and on the CPU, so one GPU has nothing to split over.
        return (
            "one CUDA device: TransformerLens 4.3's bridge refuses a device_map that mixes a GPU "
            "with CPU/disk offload, and a split across GPUs needs two"
        )
    if smoke:
        return "cpu", "disk"  # accelerate's disk offload stands in for the second device
    return "no CUDA device to split over (the CPU run of the split is --smoke's cpu+disk one)"


def split_vs_unsplit(model: Any, sizes: Sizes, device: str, smoke: bool) -> dict[str, Any]:
    """The bridge booted on the same weights dispatched by accelerate over two devices (first
    half of the layers, embedding and tied head on the first; the rest on the second): RA maps
    (memory="full") and norms (memory="layerwise") against the unsplit model's."""
    if not bridge_available():
        return {"skipped": "splitting needs TransformerBridge (TransformerLens >= 3)"}
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {"skipped": "accelerate is not installed (pip install 'ra-lens[multi-device]')"}
    devices = split_devices(device, smoke)
    if isinstance(devices, str):
        return {"skipped": devices}
    with split_bridge(model, *devices) as split:
        vocab = int(model.cfg.d_vocab)
        tokens = make_tokens(vocab, 1, sizes.split_len, 1, device)
        metric = target_nll(make_tokens(vocab, 1, 1, 2, device)[0])
        ref = reversed_attention(model, tokens, metric, keep="maps")
        got = reversed_attention(split, tokens, metric, keep="maps")
        ref_lw = reversed_attention(model, tokens, metric, keep="norms", memory="layerwise")
        got_lw = reversed_attention(split, tokens, metric, keep="norms", memory="layerwise")
        return {
            "devices": list(devices),
            "tokens": sizes.split_len,
            "maps_max_rel_diff": max_rel_diff(got.maps, ref.maps),
            "norms_max_rel_diff": max_rel_diff(got.norms, ref.norms),
            "layerwise_norms_max_rel_diff": max_rel_diff(got_lw.norms, ref_lw.norms),
        }


@contextlib.contextmanager
def split_bridge(model: Any, first: str, second: str) -> Iterator[Any]:
    """A bridge on a plain HF copy of `model`'s weights, saved and reloaded with a device_map."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    from ra_lens.models import hub_offline

    hf = plain_hf_copy(model)
    n = hf.config.num_hidden_layers
    with tempfile.TemporaryDirectory(prefix="ra_lens_split_") as folder:
        hf.to("cpu").save_pretrained(folder)
        model.tokenizer.save_pretrained(folder)
        del hf
        device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "lm_head": first}
        device_map |= {f"model.layers.{i}": first if i < n // 2 else second for i in range(n)}
        device_map["model.norm"] = second
        split = AutoModelForCausalLM.from_pretrained(
            folder,
            device_map=device_map,
            offload_folder=str(Path(folder) / "offload"),
            attn_implementation="eager",
        ).eval()
        with hub_offline():
            yield TransformerBridge.boot_transformers(
                folder, hf_model=split, tokenizer=model.tokenizer
            )


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def section(report: dict[str, Any], name: str, log: Log) -> Iterator[dict[str, Any]]:
    """report[name] = what the block puts in the yielded dict, or {"error": ...} if it raises;
    report["seconds"][name] its wall time."""
    out: dict[str, Any] = {}
    log(f"== {name}")
    spans: dict[str, float] = {}
    try:
        with timed(spans, name, clock=WALL_CLOCK.read):
            yield out
    except Exception as error:  # one broken section must not lose the others' figures
        out.clear()
        out["error"] = f"{type(error).__name__}: {error}"[:2000]
        log(traceback.format_exc())
    report[name] = out
    report["seconds"][name] = spans.get(name, float("nan"))
    log(json.dumps(out, default=float)[:2000])


def run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run with --smoke (CPU, tiny model)")
    if device == "cpu":
        torch.set_num_threads(1)
    clock = choose_clock(device, torch.get_num_threads(), wall=device != "cpu")
    started = WALL_CLOCK.read()
    model = load(sizes, device)
    report: dict[str, Any] = {
        "meta": {
            "smoke": args.smoke,
            "model": model.cfg.model_name,
            "model_class": type(model).__name__,
            "device": device
            + (f" ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else ""),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "time_basis": clock.name,
            "sizes": asdict(sizes),
        },
        "seconds": {},
    }
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("bf16_vs_fp32", lambda: bf16_vs_fp32(model, sizes, device)),
        ("norms_vs_floor", lambda: norms_vs_floor(model, sizes, device, clock, log)),
        (
            "causal_mediation_vs_ra",
            lambda: causal_mediation_vs_ra(model, sizes, device, clock, log),
        ),
        ("layerwise_long", lambda: layerwise_long(model, sizes, device)),
        ("nnsight_vs_bridge", lambda: nnsight_vs_bridge(model, sizes, device, clock, log)),
        ("split_vs_unsplit", lambda: split_vs_unsplit(model, sizes, device, args.smoke)),
    ]
    for name, step in steps:
        with section(report, name, log) as out:
            out.update(step())
    report["meta"]["wall_s"] = WALL_CLOCK.read() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny Llama, tiny sizes (the test)")
    p.add_argument("--device", default=None, help="default: cuda (--smoke: cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    log: Log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    # stdout carries the JSON alone: progress and what the reused benchmarks print go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        report = run(args, log)
    text = json.dumps(report, indent=1, default=float)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, text)
    failed = any(isinstance(v, dict) and "error" in v for v in report.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
