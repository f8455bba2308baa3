"""Speed and memory of `reversed_attention`, as ratios to the forward+backward floor and to baselines.

    python benchmarks/bench_ra.py [--quick] [--json FILE] [--device cpu|cuda] [--threads N]
    python benchmarks/bench_ra.py --tiny --json out.json     # seconds: tiny models, for the smoke test
    python benchmarks/bench_ra.py --profile                  # torch.profiler: floor vs RA, op by op

Everything is measured in one process and one run, side by side (repetitions are interleaved
round-robin, so a load spike from another process hits every configuration alike), on the default
model (SmolLM2-135M-Instruct, 30 layers x 9 heads, GQA) and on a GPT-2-small-shaped model with
random weights (12 layers x 12 heads, d_model 768, vocab 300). What is timed:

- forward: `model(tokens)` under no_grad;
- floor: what `reversed_attention` does minus the RA hooks: blocks.0.hook_resid_pre made a fresh
  leaf that requires grad, forward, metric, `torch.autograd.grad(loss, leaf)` (RA cannot be cheaper);
- ra_maps / ra_norms: `reversed_attention(..., keep="maps" | "norms")`, all layers and heads;
- attribution: attribution patching at hook_z (forward+backward on clean, forward on corrupted);
- causal_mediation: zero-ablate one head at hook_z per forward, all heads, change of p(target);
- official_loop: the official code's approach re-written from the formula (never copied): a plain
  HuggingFace model, one prompt at a time, output_attentions for A, a forward hook for V, a full
  backward hook at the attention output projection for G = dL/d(head output), then for every layer
  and head in Python: R = G_h V_h^T, RA = A * (R - rowsum(A * R)) / sqrt(d).

The baselines (attribution, causal_mediation, official_loop) live in this file on purpose: they are
reference implementations for timing, not library code.

Time: median of repetitions, interleaved round-robin after a warm-up; torch.set_num_threads fixed
(default 1 on CPU). With one CPU thread the clock is the process CPU time (time.process_time),
which another process's load on a shared machine barely moves (wall time of one call varied by
30-60% here, CPU time by ~5%); with several threads or on CUDA it is wall time (--wall forces it).

Peak memory: a separate, untimed run per configuration (it doubles as the warm-up). On CPU: the peak
of live tensor bytes created by the call, tracked by a TorchDispatchMode that sees every op's
outputs (forward, backward, hooks) and a finalizer on each new storage: the CPU analogue of
torch.cuda.max_memory_allocated (torch's CPU allocator keeps no statistics and tracemalloc does not
see its allocations). A 256 MiB tensor plus a 64 MiB temporary calibrate it (meta.memory_calibration,
320 MiB). The Linux peak resident set (VmHWM reset through /proc/self/clear_refs, after
malloc_trim) is reported beside it as rss_peak_mb but not used for goals: glibc keeps freed heap
memory, so the RSS peak of one call moved by +-15% between repetitions, and forcing every
allocation through mmap made it stable but the run 1.5-2x slower. On CUDA:
torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ra_lens import capture, reversed_attention
from ra_lens.capture import RESID_PRE, Z
from ra_lens.metrics import target_nll, target_prob
from ra_lens.patching import head_ablation_hooks

MIB = 2**20

# ---------------------------------------------------------------------------------------------
# Plans: which settings are measured. --quick changes repetitions only, never a setting.
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelPlan:
    """What to measure on one model. Settings are (batch, length)."""

    key: str
    label: str
    settings: list[tuple[int, int]]  # forward, floor, ra_norms, ra_maps at each
    norms_only: list[tuple[int, int]] = field(default_factory=list)  # floor and ra_norms only
    attribution_at: tuple[int, int] | None = None
    causal_mediation_at: tuple[int, int] | None = None
    official_at: tuple[int, int] | None = None
    official_breakdown: bool = False  # also time plain-HF floors (batched and per prompt)


@dataclass
class Plan:
    models: list[ModelPlan]
    default_key: str  # the "default model" of the goals
    gpt2_key: str  # the GPT-2-small-shaped model of the goals
    goal_len: int  # maps/norms time and memory goals: batch 1 at this length, default model
    cm_setting: tuple[int, int]  # causal mediation vs RA, default model
    official_setting: tuple[int, int]  # official loop vs RA, GPT-2-small-shaped model
    growth_lengths: tuple[int, int]  # memory growth goal between these lengths (GPT-2 shape)
    heavy_tokens: int  # batch*length at or above which a configuration is "heavy"
    medium_tokens: int  # ... "medium"
    reps_light: int
    reps_medium: int
    reps_heavy: int
    reps_goal: int  # heavy repetitions at the goal setting (default model, batch 1, goal_len)
    cm_layer_subset: bool  # time the causal-mediation scan on 5 layers and extrapolate
    tiny: bool = False


def full_plan(quick: bool, all_scaling: bool) -> Plan:
    default_settings = [(1, 64), (1, 256), (8, 64), (1, 1024)]
    if all_scaling:
        default_settings += [(32, 64)]
    return Plan(
        models=[
            ModelPlan(
                key="smollm2",
                label="SmolLM2-135M-Instruct (default model; 30 layers x 9 heads, 3 kv heads)",
                settings=default_settings,
                norms_only=[(1, 2048)] if all_scaling else [],
                attribution_at=(1, 64),
                causal_mediation_at=(1, 64),
                official_at=(8, 64),
            ),
            ModelPlan(
                key="gpt2-small",
                label="GPT-2-small shape, random weights (12 layers x 12 heads, d_model 768, vocab 300)",
                settings=[(1, 64), (1, 256), (8, 64), (32, 64), (1, 1024)],
                norms_only=[(1, 2048)],
                attribution_at=(1, 64),
                causal_mediation_at=(1, 64),
                official_at=(8, 64),
                official_breakdown=True,
            ),
        ],
        default_key="smollm2",
        gpt2_key="gpt2-small",
        goal_len=1024,
        cm_setting=(1, 64),
        official_setting=(8, 64),
        growth_lengths=(1024, 2048),
        heavy_tokens=1024,
        medium_tokens=256,
        reps_light=3 if quick else 5,
        reps_medium=2 if quick else 3,
        reps_heavy=1,
        reps_goal=1 if quick else 2,
        cm_layer_subset=quick,
    )


def tiny_plan() -> Plan:
    """The same structure on tiny models, for the smoke test (ratios are not meaningful)."""
    return Plan(
        models=[
            ModelPlan(
                key="tiny-llama",
                label="tiny Llama (stand-in for the default model; GQA)",
                settings=[(1, 8), (1, 16), (2, 8), (1, 32)],
                attribution_at=(1, 8),
                causal_mediation_at=(1, 8),
                official_at=(2, 8),
            ),
            ModelPlan(
                key="tiny-gpt2",
                label="tiny GPT-2 (stand-in for the GPT-2-small shape)",
                settings=[(1, 8), (1, 16), (2, 8), (4, 8), (1, 32)],
                norms_only=[(1, 64)],
                attribution_at=(1, 8),
                causal_mediation_at=(1, 8),
                official_at=(2, 8),
                official_breakdown=True,
            ),
        ],
        default_key="tiny-llama",
        gpt2_key="tiny-gpt2",
        goal_len=32,
        cm_setting=(1, 8),
        official_setting=(2, 8),
        growth_lengths=(32, 64),
        heavy_tokens=32,
        medium_tokens=16,
        reps_light=1,
        reps_medium=1,
        reps_heavy=1,
        reps_goal=1,
        cm_layer_subset=True,
        tiny=True,
    )


def load(key: str, device: str, max_len: int) -> Any:
    if key == "smollm2":
        from ra_lens.models import load_model

        return load_model(device=device)
    from ra_lens.toy_models import tiny_model

    if key == "gpt2-small":
        model = tiny_model("gpt2", d_model=768, n_layers=12, n_heads=12, n_ctx=max(max_len, 1024))
    elif key == "tiny-gpt2":
        model = tiny_model("gpt2", d_model=64, n_layers=2, n_heads=4, n_ctx=max_len)
    elif key == "tiny-llama":
        model = tiny_model("llama", d_model=64, n_layers=2, n_heads=4, n_ctx=max_len)
    else:
        raise ValueError(f"unknown model key {key!r}")
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# Measurement: time (median of repetitions) and peak memory
# ---------------------------------------------------------------------------------------------


# Time basis: process CPU time on CPU with one intra-op thread (another process's load on this
# shared machine then barely moves it: wall time of one call varied by 30-60%, CPU time by ~5%),
# wall time otherwise (several threads, or CUDA, where the host waits on the device).
TIME_BASIS = {"name": "wall"}


def now() -> float:
    return time.process_time() if TIME_BASIS["name"] == "cpu" else time.perf_counter()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
    """Peak extra memory of one call.

    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated
    before. CPU: the peak of live tensor bytes created by the call (LiveTensorBytes). Also, as a
    secondary figure, the Linux peak resident set (VmHWM reset through /proc/self/clear_refs)
    minus the resident set before, after gc.collect() and malloc_trim(0): what the machine pays,
    but glibc keeps freed heap memory, so it varies by +-15% between repetitions of one call.
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
    def measure(self, out: dict[str, float]):
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
    """Peak memory of a 256 MiB tensor plus a 64 MiB temporary: checks the method (320 MiB)."""
    out: dict[str, float] = {}
    with memory.measure(out):
        x = torch.ones(256 * MIB // 4, device=device)
        y = x[: 64 * MIB // 4] * 2  # a temporary, freed before the next allocation
        del y
        z = x[: 32 * MIB // 4] + 1
        del x, z
    return {"expected_mb": 320.0, "measured_mb": round(out["peak_mb"], 1)}


@dataclass
class Config:
    """One measured configuration: a name and a zero-argument callable."""

    name: str
    fn: Callable[[], Any]
    tokens: int  # batch * length, decides light/heavy
    memory: bool = True  # measure its peak memory (a separate, untimed run)


def run_group(
    configs: list[Config],
    device: str,
    memory: PeakMemory,
    plan: Plan,
    log: Callable[[str], None],
    reps_heavy: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Time and memory of configurations measured side by side.

    First, one untimed run of every configuration under the memory tracker (it is also the
    warm-up). Then the timed runs, interleaved round-robin with a rotating order: reps_light
    each, reps_medium from plan.medium_tokens (batch*length), reps_heavy from plan.heavy_tokens.
    """
    results: dict[str, dict[str, Any]] = {
        c.name: {"times_s": [], "wall_times_s": []} for c in configs
    }

    def reps(c: Config) -> int:
        if c.tokens >= plan.heavy_tokens:
            return plan.reps_heavy if reps_heavy is None else reps_heavy
        return plan.reps_medium if c.tokens >= plan.medium_tokens else plan.reps_light

    for c in configs:
        if not c.memory:
            results[c.name]["peak_mb"] = float("nan")
            continue
        out: dict[str, float] = {}
        with memory.measure(out):
            start = now()
            result = c.fn()
            _sync(device)
            elapsed = now() - start
            del result
        results[c.name].update(out)
        results[c.name]["memory_run_s"] = elapsed
        log(
            f"    {c.name:<18} memory run {elapsed:8.3f} s: peak +{out['peak_mb']:9.1f} MiB "
            f"(RSS +{out.get('rss_peak_mb', float('nan')):.0f} MiB)"
        )
    for rep in range(max(reps(c) for c in configs)):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for c in order:
            if len(results[c.name]["times_s"]) >= reps(c):
                continue
            gc.collect()
            _sync(device)
            wall, start = time.perf_counter(), now()
            result = c.fn()
            _sync(device)
            results[c.name]["times_s"].append(now() - start)
            results[c.name]["wall_times_s"].append(time.perf_counter() - wall)
            del result
    for c in configs:
        r = results[c.name]
        r["median_s"] = statistics.median(r["times_s"])
        r["wall_median_s"] = statistics.median(r["wall_times_s"])
        r["reps"] = len(r["times_s"])
        log(
            f"    {c.name:<18} median {r['median_s']:8.3f} s ({TIME_BASIS['name']}) over "
            f"{r['reps']}; wall {r['wall_median_s']:.3f} s"
        )
    return results


# ---------------------------------------------------------------------------------------------
# What is timed
# ---------------------------------------------------------------------------------------------


def make_tokens(vocab: int, batch: int, length: int, seed: int, device: str) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).to(device)


def bare_forward(model: Any, tokens: Tensor) -> Tensor:
    with torch.no_grad():
        return model(tokens)


def floor(model: Any, tokens: Tensor, targets: Tensor) -> Tensor:
    """reversed_attention minus the RA hooks: leaf at blocks.0.hook_resid_pre, autograd.grad to it."""
    metric = target_nll(targets)
    store: dict[str, Tensor] = {}
    with capture.preserved_state(model), torch.enable_grad():
        with model.hooks(fwd_hooks=[(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]):
            logits = model(tokens)
            loss = metric(logits).sum()
            (grad,) = torch.autograd.grad(loss, [store["leaf"]])
    return grad


def ra(model: Any, tokens: Tensor, targets: Tensor, keep: str) -> Any:
    return reversed_attention(model, tokens, target_nll(targets), keep=keep)  # type: ignore[arg-type]


def attribution_patching(model: Any, clean: Tensor, corrupted: Tensor, targets: Tensor) -> Tensor:
    """Attribution patching at hook_z, scores [layer, head] = sum (z_corr - z_clean) * dM/dz.

    M = p(target). One forward+backward on clean (the gradient at every hook_z read by backward
    hooks, the pass going to the same leaf as the floor's), one forward on corrupted. Benchmark
    baseline, not library code. (The bridge's hook_z hands hooks a reshaped view, so the gradient
    must come from a backward hook, not from autograd.grad on the tensor a forward hook saw.)
    """
    n_layers = model.cfg.n_layers
    metric = target_prob(targets)
    clean_z: dict[int, Tensor] = {}
    corrupt_z: dict[int, Tensor] = {}
    grads: dict[int, Tensor] = {}

    def save(into: dict[int, Tensor], layer: int):
        def hook(z: Tensor, hook: Any) -> None:
            into[layer] = z.detach()

        return hook

    store: dict[str, Tensor] = {}
    fwd = [(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]
    fwd += [(Z.format(la), save(clean_z, la)) for la in range(n_layers)]
    bwd = [(Z.format(la), save(grads, la)) for la in range(n_layers)]
    with capture.preserved_state(model), torch.enable_grad():
        with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
            loss = metric(model(clean)).sum()
            torch.autograd.grad(loss, [store["leaf"]])
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(Z.format(la), save(corrupt_z, la)) for la in range(n_layers)]),
    ):
        model(corrupted)
    return torch.stack(
        [((corrupt_z[la] - clean_z[la]) * grads[la]).sum(dim=(0, 1, 3)) for la in range(n_layers)]
    )


def causal_mediation_scan(
    model: Any,
    tokens: Tensor,
    targets: Tensor,
    layers: list[int] | None = None,
    per_head_s: list[float] | None = None,
) -> Tensor:
    """Zero-ablate one head at a time at hook_z: p(target) after minus before, [layer, head].

    One forward per head (batch = all prompts), under no_grad. `layers` restricts the scan (for
    timing a subset); `per_head_s` collects the time of each ablated forward. Benchmark baseline.
    """
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    metric = target_prob(targets)
    layers = list(range(n_layers)) if layers is None else layers
    effects = torch.zeros(n_layers, n_heads)
    with torch.no_grad():
        clean = metric(model(tokens))
        for la in layers:
            for h in range(n_heads):
                start = now()
                with model.hooks(fwd_hooks=head_ablation_hooks([(la, h)])):
                    effects[la, h] = (metric(model(tokens)) - clean).mean().cpu()
                if per_head_s is not None:
                    per_head_s.append(now() - start)
    return effects


# ---- the official code's approach, re-implemented from the formula ------------------------------


def plain_hf_copy(bridge: Any) -> Any:
    """A plain HuggingFace model (eager attention) with the bridge's weights.

    The bridge wraps HF submodules in place (LinearBridge, HookPoints), so `bridge.original_model`
    is no longer plain HF; a fresh model from the same config gets the same state dict back.
    """
    from transformers import AutoModelForCausalLM

    orig = bridge.original_model
    config = orig.config.__class__.from_dict(orig.config.to_dict())
    config._attn_implementation = "eager"
    param = next(orig.parameters())
    fresh = AutoModelForCausalLM.from_config(config)
    fresh = fresh.to(device=param.device, dtype=param.dtype).eval()
    wanted = fresh.state_dict()
    source = {k.replace("._original_component", ""): v for k, v in orig.state_dict().items()}
    fresh.load_state_dict({k: v for k, v in source.items() if k in wanted}, strict=False)
    missing = [k for k in wanted if k not in source]
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied:
        raise RuntimeError(f"could not copy {sorted(set(missing) - tied)[:4]} from the bridge")
    fresh.requires_grad_(False)
    return fresh


class OfficialStyleLoop:
    """RA the official code's way: plain HF, batch size 1, Python loops over layers and heads.

    Written here from the formula (paper-notes section 1), for timing only. Parameters are frozen
    and the backward pass goes to the input embeddings only, i.e. the same floor as
    reversed_attention (the official code also computes parameter gradients, which costs more).
    """

    def __init__(self, hf: Any, scales: list[float]):
        self.hf = hf
        cfg = hf.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.d_model = cfg.hidden_size
        self.d_head = getattr(cfg, "head_dim", None) or self.d_model // self.n_heads
        self.scales = scales
        if hasattr(hf, "transformer") and hasattr(hf.transformer, "h"):  # GPT-2
            attns = [block.attn for block in hf.transformer.h]
            self.v_modules = [a.c_attn for a in attns]
            self.o_modules = [a.c_proj for a in attns]
            self.v_slice = slice(2 * self.d_model, 3 * self.d_model)
            self.embed = hf.transformer.wte
        elif hasattr(hf, "model") and hasattr(hf.model, "layers"):  # Llama family
            attns = [layer.self_attn for layer in hf.model.layers]
            self.v_modules = [a.v_proj for a in attns]
            self.o_modules = [a.o_proj for a in attns]
            self.v_slice = slice(None)
            self.embed = hf.model.embed_tokens
        else:
            raise TypeError(f"official-style loop: unsupported architecture {type(hf).__name__}")
        self.n_layers = len(self.o_modules)

    def floor(self, tokens: Tensor, targets: Tensor, per_prompt: bool) -> Tensor:
        """Plain HF forward+backward to the input embeddings, no RA: batched or per prompt.

        Decomposes the comparison: official_loop - hf_floor_per_prompt is the per-head Python
        loop's own cost, hf_floor_per_prompt / hf_floor what batching buys, and
        floor / hf_floor what the bridge costs over plain HuggingFace."""
        chunks = [slice(b, b + 1) for b in range(tokens.shape[0])] if per_prompt else [slice(None)]
        grads = []
        for rows in chunks:
            embeds = self.embed(tokens[rows]).detach().requires_grad_(True)
            with torch.enable_grad():
                logits = self.hf(inputs_embeds=embeds, use_cache=False).logits
                loss = target_nll(targets[rows])(logits).sum()
                grads.append(torch.autograd.grad(loss, [embeds])[0])
        return torch.cat(grads)

    def __call__(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        batch, n = tokens.shape
        maps = torch.zeros(batch, self.n_layers, self.n_heads, n, n, device=tokens.device)
        norms = torch.zeros(batch, self.n_layers, self.n_heads)
        values: dict[int, Tensor] = {}
        grads: dict[int, Tensor] = {}

        def save_v(layer: int):
            def hook(module: Any, inputs: Any, output: Tensor) -> None:
                values[layer] = output.detach()[..., self.v_slice]

            return hook

        def save_g(layer: int):
            def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
                grads[layer] = grad_input[0].detach()

            return hook

        handles = [m.register_forward_hook(save_v(la)) for la, m in enumerate(self.v_modules)]
        handles += [
            m.register_full_backward_hook(save_g(la)) for la, m in enumerate(self.o_modules)
        ]
        group = self.n_heads // self.n_kv
        d = self.d_head
        try:
            for b in range(batch):  # one prompt at a time, as the official code
                ids = tokens[b : b + 1]
                embeds = self.embed(ids).detach().requires_grad_(True)
                with torch.enable_grad():
                    out = self.hf(inputs_embeds=embeds, output_attentions=True, use_cache=False)
                    loss = -out.logits[0, -1].float().log_softmax(-1)[targets[b]]
                    torch.autograd.grad(loss, [embeds])
                for la in range(self.n_layers):
                    attn = out.attentions[la][0].detach()  # [head, q, k]
                    v = values[la][0].view(n, self.n_kv, d)
                    g = grads[la][0]  # [pos, head * d]
                    for h in range(self.n_heads):
                        a = attn[h]
                        r = g[:, h * d : (h + 1) * d] @ v[:, h // group].T
                        ar = a * r
                        ra_map = (ar - a * ar.sum(-1, keepdim=True)) / self.scales[la]
                        maps[b, la, h] = ra_map
                        norms[b, la, h] = ra_map.norm().cpu()
                values.clear()
                grads.clear()
        finally:
            for handle in handles:
                handle.remove()
        return maps, norms


# ---------------------------------------------------------------------------------------------
# Running a model's plan
# ---------------------------------------------------------------------------------------------


def measure_model(
    mp: ModelPlan, plan: Plan, device: str, memory: PeakMemory, log: Callable[[str], None]
) -> dict[str, Any]:
    max_len = max(n for _, n in mp.settings + mp.norms_only)
    start = time.perf_counter()
    model = load(mp.key, device, max_len)
    shape = capture.model_shape(model)
    vocab = int(model.cfg.d_vocab)
    log(f"  loaded in {time.perf_counter() - start:.1f} s: {mp.label}")
    out: dict[str, Any] = {
        "label": mp.label,
        "n_layers": shape.n_layers,
        "n_heads": shape.n_heads,
        "n_kv_heads": shape.n_kv_heads,
        "d_head": shape.d_head,
        "settings": {},
    }
    official = None
    if mp.official_at is not None:
        scales = [capture.attention_scale(model, la) for la in range(shape.n_layers)]
        official = OfficialStyleLoop(plain_hf_copy(model), scales)
    # Warm-up: lazy state (live_pattern_layers probe, hook registration paths, thread pools).
    warm = make_tokens(vocab, 1, 8, 0, device)
    warm_targets = torch.tensor([5], device=device)
    ra(model, warm, warm_targets, "norms")
    floor(model, warm, warm_targets)
    # The model and libraries make ~0.5M Python objects: a full gc.collect() takes ~0.5 s, and an
    # automatic one inside a timed run would be noise. Freeze them out of the collector.
    gc.collect()
    gc.freeze()

    groups = [(s, False) for s in mp.settings] + [(s, True) for s in mp.norms_only]
    groups.sort(key=lambda g: g[0][0] * g[0][1])  # cheap first
    for (batch, length), norms_only in groups:
        tokens = make_tokens(vocab, batch, length, 1, device)
        targets = make_tokens(vocab, 1, batch, 2, device)[0]
        n_tok = batch * length
        heavy = n_tok >= plan.heavy_tokens
        configs = []
        # Memory runs cost a full run each: at heavy settings only where a goal or the length
        # scaling needs them (not the bare forward, not keep="maps" at batch 32).
        if not norms_only:
            configs.append(
                Config("forward", lambda t=tokens: bare_forward(model, t), n_tok, not heavy)
            )
        configs.append(Config("floor", lambda t=tokens, y=targets: floor(model, t, y), n_tok))
        configs.append(
            Config("ra_norms", lambda t=tokens, y=targets: ra(model, t, y, "norms"), n_tok)
        )
        if not norms_only:
            configs.append(
                Config(
                    "ra_maps",
                    lambda t=tokens, y=targets: ra(model, t, y, "maps"),
                    n_tok,
                    not heavy or batch == 1,
                )
            )
        if mp.attribution_at == (batch, length):
            corrupted = make_tokens(vocab, batch, length, 3, device)
            configs.append(
                Config(
                    "attribution",
                    lambda t=tokens, c=corrupted, y=targets: attribution_patching(model, t, c, y),
                    n_tok,
                )
            )
        if official is not None and mp.official_at == (batch, length):
            configs.append(
                Config("official_loop", lambda t=tokens, y=targets: official(t, y), n_tok)
            )
        if official is not None and mp.official_at == (batch, length) and mp.official_breakdown:
            configs.append(
                Config(
                    "hf_floor_per_prompt",
                    lambda t=tokens, y=targets: official.floor(t, y, per_prompt=True),
                    n_tok,
                )
            )
            configs.append(
                Config(
                    "hf_floor",
                    lambda t=tokens, y=targets: official.floor(t, y, per_prompt=False),
                    n_tok,
                )
            )
        name = f"b{batch}_n{length}"
        log(f"  [{mp.key}] batch {batch}, length {length}: {[c.name for c in configs]}")
        goal = mp.key == plan.default_key and (batch, length) == (1, plan.goal_len)
        results = run_group(configs, device, memory, plan, log, plan.reps_goal if goal else None)
        out["settings"][name] = {"batch": batch, "length": length, "measurements": results}
        if mp.causal_mediation_at == (batch, length):
            out["causal_mediation"] = measure_causal_mediation(
                model, tokens, targets, plan, memory, device, log
            )
            out["causal_mediation"]["setting"] = name
    gc.unfreeze()
    del model, official
    gc.collect()
    return out


def measure_causal_mediation(
    model: Any,
    tokens: Tensor,
    targets: Tensor,
    plan: Plan,
    memory: PeakMemory,
    device: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if plan.cm_layer_subset:
        layers = sorted({0, n_layers // 2, n_layers - 1})
    else:
        layers = list(range(n_layers))
    per_head: list[float] = []
    # Timed without the memory tracker (it slows small ops); its memory is one forward's.
    gc.collect()
    start = now()
    causal_mediation_scan(model, tokens, targets, layers, per_head)
    _sync(device)
    measured = now() - start
    clean_s = max(measured - sum(per_head), 0.0)
    n_all = n_layers * n_heads
    extrapolated = len(per_head) < n_all
    total = clean_s + n_all * statistics.median(per_head) if extrapolated else measured
    log(
        f"    causal_mediation   {len(per_head)} of {n_all} heads in {measured:.1f} s"
        + (f" -> {total:.1f} s for all (extrapolated)" if extrapolated else "")
    )
    return {
        "median_s": total,
        "measured_s": measured,
        "heads_measured": len(per_head),
        "heads_total": n_all,
        "extrapolated": extrapolated,
        "per_head_median_s": statistics.median(per_head),
    }


# ---------------------------------------------------------------------------------------------
# Ratios, goals, table
# ---------------------------------------------------------------------------------------------


def _m(res: dict[str, Any], model: str, setting: str, name: str) -> dict[str, Any] | None:
    return (
        res["models"]
        .get(model, {})
        .get("settings", {})
        .get(setting, {})
        .get("measurements", {})
        .get(name)
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def compute_ratios(res: dict[str, Any], plan: Plan) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    d, g = plan.default_key, plan.gpt2_key
    goal = f"b1_n{plan.goal_len}"
    cm_b, cm_n = plan.cm_setting
    off_b, off_n = plan.official_setting
    ratios: dict[str, Any] = {}
    where: dict[str, str] = {}

    def get(model: str, setting: str, name: str, what: str = "median_s") -> float | None:
        m = _m(res, model, setting, name)
        return None if m is None else m.get(what)

    ratios["maps_vs_floor"] = _ratio(get(d, goal, "ra_maps"), get(d, goal, "floor"))
    ratios["norms_vs_floor"] = _ratio(get(d, goal, "ra_norms"), get(d, goal, "floor"))
    ratios["norms_peak_memory_vs_floor"] = _ratio(
        get(d, goal, "ra_norms", "peak_mb"), get(d, goal, "floor", "peak_mb")
    )
    ratios["maps_peak_memory_vs_floor"] = _ratio(
        get(d, goal, "ra_maps", "peak_mb"), get(d, goal, "floor", "peak_mb")
    )
    for key in (
        "maps_vs_floor",
        "norms_vs_floor",
        "norms_peak_memory_vs_floor",
        "maps_peak_memory_vs_floor",
    ):
        where[key] = f"{d}, batch 1, length {plan.goal_len}"
    cm = res["models"].get(d, {}).get("causal_mediation")
    cm_setting = f"b{cm_b}_n{cm_n}"
    ratios["causal_mediation_vs_ra"] = _ratio(
        cm["median_s"] if cm else None, get(d, cm_setting, "ra_norms")
    )
    ratios["causal_mediation_vs_ra_maps"] = _ratio(
        cm["median_s"] if cm else None, get(d, cm_setting, "ra_maps")
    )
    where["causal_mediation_vs_ra"] = f"{d}, batch {cm_b}, length {cm_n}, RA keep='norms'"
    where["causal_mediation_vs_ra_maps"] = f"{d}, batch {cm_b}, length {cm_n}, RA keep='maps'"
    off_setting = f"b{off_b}_n{off_n}"
    ratios["official_loop_vs_ra"] = _ratio(
        get(g, off_setting, "official_loop"), get(g, off_setting, "ra_maps")
    )
    where["official_loop_vs_ra"] = f"{g}, batch {off_b}, length {off_n}, RA keep='maps'"
    for model in (g, d):
        ol = get(model, off_setting, "official_loop")
        pp = get(model, off_setting, "hf_floor_per_prompt")
        hf = get(model, off_setting, "hf_floor")
        fl = get(model, off_setting, "floor")
        ratios.setdefault("official_loop_breakdown", {})[model] = {
            "official_loop_vs_hf_floor_per_prompt": _ratio(ol, pp),
            "hf_floor_per_prompt_vs_hf_floor": _ratio(pp, hf),
            "floor_vs_hf_floor": _ratio(fl, hf),
            "ra_maps_vs_floor": _ratio(get(model, off_setting, "ra_maps"), fl),
        }
    where["official_loop_breakdown"] = (
        f"batch {off_b}, length {off_n}: loop cost over plain-HF per-prompt fwd+bwd; batching gain "
        "of plain HF; bridge floor over plain-HF batched floor; RA maps over bridge floor"
    )
    ratios["official_loop_vs_ra_default_model"] = _ratio(
        get(d, off_setting, "official_loop"), get(d, off_setting, "ra_maps")
    )
    where["official_loop_vs_ra_default_model"] = f"{d}, batch {off_b}, length {off_n}"
    ratios["attribution_vs_ra_norms"] = _ratio(
        get(d, cm_setting, "attribution"), get(d, cm_setting, "ra_norms")
    )
    where["attribution_vs_ra_norms"] = f"{d}, batch {cm_b}, length {cm_n}"
    ratios["floor_vs_forward"] = _ratio(get(d, goal, "floor"), get(d, goal, "forward"))
    where["floor_vs_forward"] = f"{d}, batch 1, length {plan.goal_len}"

    # Memory growth with length: keep="norms" against the floor, on the GPT-2 shape.
    l1, l2 = plan.growth_lengths
    growth: dict[str, Any] = {}
    for model in (g, d):
        n1 = get(model, f"b1_n{l1}", "ra_norms", "peak_mb")
        n2 = get(model, f"b1_n{l2}", "ra_norms", "peak_mb")
        f1 = get(model, f"b1_n{l1}", "floor", "peak_mb")
        f2 = get(model, f"b1_n{l2}", "floor", "peak_mb")
        if None in (n1, n2, f1, f2):
            continue
        growth[model] = {
            "lengths": [l1, l2],
            "norms_increment_vs_floor_increment": _ratio(n2 - n1, f2 - f1),
            "norms_exponent": math.log(n2 / n1) / math.log(l2 / l1) if n1 > 0 and n2 > 0 else None,
            "floor_exponent": math.log(f2 / f1) / math.log(l2 / l1) if f1 > 0 and f2 > 0 else None,
            "norms_vs_floor_at": {str(l1): _ratio(n1, f1), str(l2): _ratio(n2, f2)},
        }
    ratios["norms_memory_growth_vs_floor"] = growth.get(g, {}).get(
        "norms_increment_vs_floor_increment"
    )
    where["norms_memory_growth_vs_floor"] = f"{g}, batch 1, length {l1} -> {l2}"
    ratios["memory_growth"] = growth

    def goal_row(name: str, key: str, op: str, threshold: float) -> dict[str, Any]:
        value = ratios.get(key)
        ok = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
        return {
            "goal": name,
            "ratio": key,
            "value": value,
            "target": f"{op} {threshold}",
            "where": where.get(key, ""),
            "status": "n/a" if ok is None else ("PASS" if ok else "MISS"),
        }

    goals = [
        goal_row("RA keep='maps' time vs floor", "maps_vs_floor", "<=", 1.3),
        goal_row("RA keep='norms' time vs floor", "norms_vs_floor", "<=", 1.15),
        goal_row("RA keep='norms' peak memory vs floor", "norms_peak_memory_vs_floor", "<=", 1.2),
        goal_row("causal-mediation scan vs RA (time)", "causal_mediation_vs_ra", ">=", 50.0),
        goal_row("official-style loop vs RA (time)", "official_loop_vs_ra", ">=", 1.5),
        goal_row(
            "keep='norms' memory growth vs floor's (increment ratio)",
            "norms_memory_growth_vs_floor",
            "<=",
            1.2,
        ),
    ]
    return ratios, goals


def print_table(res: dict[str, Any], log: Callable[[str], None]) -> None:
    for m in res["models"].values():
        log("")
        log(f"== {m['label']}")
        log(
            f"{'setting':<11} {'what':<20} {'median s':>9} {'reps':>4} {'x floor':>8} "
            f"{'x fwd':>6} {'peak MiB':>9} {'mem x floor':>11} {'RSS MiB':>8}"
        )
        for sname, s in m["settings"].items():
            meas = s["measurements"]
            fl = meas.get("floor", {})
            fw = meas.get("forward", {})
            for name, r in meas.items():
                t_ratio = _ratio(r["median_s"], fl.get("median_s"))
                f_ratio = _ratio(r["median_s"], fw.get("median_s"))
                m_ratio = _ratio(r["peak_mb"], fl.get("peak_mb"))
                log(
                    f"{sname:<11} {name:<20} {r['median_s']:9.3f} {r['reps']:4d} "
                    f"{_fmt(t_ratio, 8)} {_fmt(f_ratio, 6)} {r['peak_mb']:9.1f} {_fmt(m_ratio, 11)} "
                    f"{r.get('rss_peak_mb', float('nan')):8.0f}"
                )
        cm = m.get("causal_mediation")
        if cm:
            ra_s = m["settings"][cm["setting"]]["measurements"]["ra_norms"]["median_s"]
            note = " (extrapolated)" if cm["extrapolated"] else ""
            log(
                f"{cm['setting']:<11} {'causal_mediation':<20} {cm['median_s']:9.3f} {1:4d} "
                f"{'':>8} {'':>6} {'':>9} {'':>11}  = {cm['median_s'] / ra_s:.1f}x "
                f"RA norms; {cm['heads_measured']}/{cm['heads_total']} heads timed{note}"
            )


def _fmt(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}"


def print_goals(res: dict[str, Any], log: Callable[[str], None]) -> None:
    log("")
    log("Ratios (JSON 'ratios'):")
    for key, value in res["ratios"].items():
        if not isinstance(value, dict):
            log(f"  {key:<36} {_fmt(value, 8)}")
    for model, br in res["ratios"].get("official_loop_breakdown", {}).items():
        log(
            f"  official loop breakdown {model}: "
            + ", ".join(f"{k} {_fmt(v, 4)}" for k, v in br.items())
        )
    for model, gr in res["ratios"].get("memory_growth", {}).items():
        log(
            f"  memory growth {model}: lengths {gr['lengths']}, norms/floor increments "
            f"{_fmt(gr['norms_increment_vs_floor_increment'], 5)}, exponents norms "
            f"{_fmt(gr['norms_exponent'], 5)} floor {_fmt(gr['floor_exponent'], 5)}"
        )
    log("")
    log("Goals:")
    for g in res["goals"]:
        log(
            f"  [{g['status']:<4}] {g['goal']:<56} {_fmt(g['value'], 7)} (target {g['target']}; "
            f"{g['where']})"
        )
    if res["meta"]["tiny"]:
        log("  (tiny settings: the PASS/MISS above only checks the plumbing, not the goals)")


# ---------------------------------------------------------------------------------------------
# Profiling: where RA's time goes, op by op
# ---------------------------------------------------------------------------------------------


def profile(
    key: str, batch: int, length: int, device: str, top: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """torch.profiler of floor, ra_norms and ra_maps (one run each after a warm-up).

    Prints each run's total and the ops whose self time differs most from the floor's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = load(key, device, length)
    vocab = int(model.cfg.d_vocab)
    tokens = make_tokens(vocab, batch, length, 1, device)
    targets = make_tokens(vocab, 1, batch, 2, device)[0]
    runs = {
        "floor": lambda: floor(model, tokens, targets),
        "ra_norms": lambda: ra(model, tokens, targets, "norms"),
        "ra_maps": lambda: ra(model, tokens, targets, "maps"),
    }
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    tables: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    for name, fn in runs.items():
        fn()  # warm-up
        gc.collect()
        start = now()
        with torch_profile(activities=activities) as prof:
            fn()
            _sync(device)
        totals[name] = now() - start
        tables[name] = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
        log(f"\n--- {name}: {totals[name]:.3f} s under the profiler; top ops by self CPU time")
        log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    diffs: dict[str, Any] = {}
    for name in ("ra_norms", "ra_maps"):
        keys = set(tables[name]) | set(tables["floor"])
        delta = {k: tables[name].get(k, 0.0) - tables["floor"].get(k, 0.0) for k in keys}
        worst = sorted(delta.items(), key=lambda kv: -kv[1])[:top]
        log(f"\n--- {name} minus floor: {totals[name] - totals['floor']:+.3f} s; largest op deltas")
        for op, dt in worst:
            log(f"  {op:<45} {dt:+8.3f} s  (floor {tables['floor'].get(op, 0.0):.3f} s)")
        diffs[name] = {"total_delta_s": totals[name] - totals["floor"], "ops": dict(worst)}
    return {"model": key, "batch": batch, "length": length, "totals_s": totals, "deltas": diffs}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, same settings")
    p.add_argument("--tiny", action="store_true", help="tiny models and settings (smoke test)")
    p.add_argument("--json", type=Path, help="write every figure to this JSON file")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default on CPU: 1, stable on a shared machine; "
        "on CUDA: left as is)",
    )
    p.add_argument("--models", default=None, help="comma-separated subset of the plan's model keys")
    p.add_argument(
        "--all-scaling",
        action="store_true",
        help="also batch 32 and length 2048 on the default model (slow on CPU)",
    )
    p.add_argument("--wall", action="store_true", help="wall-clock time even with 1 CPU thread")
    p.add_argument("--profile", action="store_true", help="profile floor vs RA instead")
    p.add_argument("--profile-model", default="smollm2")
    p.add_argument("--profile-batch", type=int, default=1)
    p.add_argument("--profile-len", type=int, default=1024)
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    cpu_clock = device == "cpu" and torch.get_num_threads() == 1 and not args.wall
    TIME_BASIS["name"] = "cpu" if cpu_clock else "wall"

    if args.profile:
        result = {
            "profile": profile(
                args.profile_model,
                args.profile_batch,
                args.profile_len,
                device,
                args.profile_top,
                log,
            )
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        return result

    plan = tiny_plan() if args.tiny else full_plan(args.quick, args.all_scaling)
    if args.models:
        keep = set(args.models.split(","))
        plan.models = [m for m in plan.models if m.key in keep]
    memory = PeakMemory(device)
    started = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    res: dict[str, Any] = {
        "meta": {
            "mode": "tiny" if args.tiny else ("quick" if args.quick else "full"),
            "tiny": args.tiny,
            "device": device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": load_start,
            "memory_method": memory.method,
            "memory_calibration": calibrate(memory, device),
            "time_basis": TIME_BASIS["name"],
            "timing": "median of repetitions (interleaved round-robin) after a warm-up that is "
            "also the memory run; time_basis 'cpu' = process CPU time (1 thread), else wall",
            "plan": asdict(plan),
        },
        "models": {},
    }
    log(
        f"bench_ra: {res['meta']['mode']} mode, device {device}, {res['meta']['threads']} "
        f"threads, time basis {TIME_BASIS['name']}"
    )
    log(f"memory: {memory.method}; calibration {res['meta']['memory_calibration']}")
    for mp in plan.models:
        log(f"\n>> {mp.key}")
        res["models"][mp.key] = measure_model(mp, plan, device, memory, log)
    res["ratios"], res["goals"] = compute_ratios(res, plan)
    res["meta"]["wall_s"] = time.perf_counter() - started
    res["meta"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print_table(res, log)
    print_goals(res, log)
    log(
        f"\nwall time {res['meta']['wall_s']:.0f} s; load average {load_start} -> "
        f"{res['meta']['loadavg_end']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=float))
        log(f"JSON: {args.json}")
    return res


if __name__ == "__main__":
    main()
