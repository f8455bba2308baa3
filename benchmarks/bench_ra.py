"""Speed and memory of `reversed_attention`, as ratios to the forward+backward floor and to baselines.

    python benchmarks/bench_ra.py [--quick] [--json FILE] [--device cpu|cuda] [--threads N]
    python benchmarks/bench_ra.py --tiny --json out.json     # seconds: tiny models, for the smoke test
    python benchmarks/bench_ra.py --profile                  # torch.profiler: floor vs RA, op by op

This file holds the plan (which models and settings), runs it and reports ratios and goals. The
harness (clocks, memory meters, run groups) is in harness.py, the references that are not library
methods (floor, the official-style per-head loop) in baselines.py; causal mediation and attribution
patching are the library's own `ra_lens.ranking` functions. What is measured and how: README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from baselines import OfficialStyleLoop, bare_forward, floor, plain_hf_copy
from harness import (
    WALL_CLOCK,
    Clock,
    Config,
    Log,
    PeakMemory,
    calibrate,
    choose_clock,
    make_tokens,
    run_group,
)
from torch import Tensor

from ra_lens import capture, ranking, reversed_attention
from ra_lens.files import write_file
from ra_lens.metrics import target_nll
from ra_lens.timing import sync, timed

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
    tiny: bool = False

    def reps(self, tokens: int, goal: bool = False) -> int:
        """Timed repetitions of a configuration of `tokens` = batch x length tokens."""
        if tokens >= self.heavy_tokens:
            return self.reps_goal if goal else self.reps_heavy
        return self.reps_medium if tokens >= self.medium_tokens else self.reps_light


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
        reps_goal=3 if quick else 5,
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
# What is timed at one setting
# ---------------------------------------------------------------------------------------------


def ra(model: Any, tokens: Tensor, targets: Tensor, keep: str) -> Any:
    return reversed_attention(model, tokens, target_nll(targets), keep=keep)  # type: ignore[arg-type]


def setting_configs(
    model: Any,
    mp: ModelPlan,
    batch: int,
    length: int,
    reps: int,
    *,
    norms_only: bool = False,
    heavy: bool = False,
    official: OfficialStyleLoop | None = None,
) -> list[Config]:
    """The configurations timed side by side at (batch, length): forward, floor, RA (norms, maps),
    and where the plan says so attribution patching (the library's) and the official-style loop
    with its plain-HF floors. Tokens are seeded random ids (1: prompts, 2: targets, 3: corrupted).
    Memory runs cost a full run each: heavy settings skip them for the bare forward and for
    keep="maps" above batch 1."""
    vocab = int(model.cfg.d_vocab)
    device = str(next(model.parameters()).device)
    tokens = make_tokens(vocab, batch, length, 1, device)
    targets = make_tokens(vocab, 1, batch, 2, device)[0]
    configs = []
    if not norms_only:
        configs.append(Config("forward", lambda: bare_forward(model, tokens), reps, not heavy))
    configs.append(Config("floor", lambda: floor(model, tokens, targets), reps))
    configs.append(Config("ra_norms", lambda: ra(model, tokens, targets, "norms"), reps))
    if not norms_only:
        configs.append(
            Config(
                "ra_maps", lambda: ra(model, tokens, targets, "maps"), reps, not heavy or batch == 1
            )
        )
    if mp.attribution_at == (batch, length):
        corrupted = make_tokens(vocab, batch, length, 3, device)
        configs.append(
            Config(
                "attribution",
                lambda: ranking.attribution_patching(model, tokens, corrupted, targets),
                reps,
            )
        )
    if official is not None and mp.official_at == (batch, length):
        configs.append(Config("official_loop", lambda: official(tokens, targets), reps))
        if mp.official_breakdown:
            configs.append(
                Config(
                    "hf_floor_per_prompt",
                    lambda: official.floor(tokens, targets, per_prompt=True),
                    reps,
                )
            )
            configs.append(
                Config("hf_floor", lambda: official.floor(tokens, targets, per_prompt=False), reps)
            )
    return configs


def measure_causal_mediation(
    model: Any, batch: int, length: int, clock: Clock, device: str, log: Log
) -> dict[str, Any]:
    """One timed run of `ra_lens.ranking.causal_mediation` over every head (one forward pass per
    head); no memory run (the meter slows small ops, and the scan's memory is one forward's)."""
    vocab = int(model.cfg.d_vocab)
    tokens = make_tokens(vocab, batch, length, 1, device)
    targets = make_tokens(vocab, 1, batch, 2, device)[0]
    gc.collect()
    spans: dict[str, float] = {}
    with timed(spans, "causal_mediation", clock=clock.read):
        scores = ranking.causal_mediation(model, tokens, targets)
    seconds = spans["causal_mediation"]
    n_heads = scores.numel()
    log(f"    causal_mediation    all {n_heads} heads in {seconds:.1f} s ({clock.name})")
    return {"median_s": seconds, "reps": 1, "heads": n_heads}


def measure_model(
    mp: ModelPlan, plan: Plan, device: str, clock: Clock, memory: PeakMemory, log: Log
) -> dict[str, Any]:
    max_len = max(n for _, n in mp.settings + mp.norms_only)
    spans: dict[str, float] = {}
    with timed(spans, "load", clock=WALL_CLOCK.read):
        model = load(mp.key, device, max_len)
    load_s = spans["load"]
    shape = capture.model_shape(model)
    log(f"  loaded in {load_s:.1f} s: {mp.label}")
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
    warm = make_tokens(int(model.cfg.d_vocab), 1, 8, 0, device)
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
        n_tok = batch * length
        goal = mp.key == plan.default_key and (batch, length) == (1, plan.goal_len)
        configs = setting_configs(
            model,
            mp,
            batch,
            length,
            plan.reps(n_tok, goal),
            norms_only=norms_only,
            heavy=n_tok >= plan.heavy_tokens,
            official=official,
        )
        name = f"b{batch}_n{length}"
        log(f"  [{mp.key}] batch {batch}, length {length}: {[c.name for c in configs]}")
        results = run_group(configs, clock=clock, device=device, memory=memory, log=log)
        out["settings"][name] = {"batch": batch, "length": length, "measurements": results}
        if mp.causal_mediation_at == (batch, length):
            out["causal_mediation"] = measure_causal_mediation(
                model, batch, length, clock, device, log
            )
            out["causal_mediation"]["setting"] = name
    gc.unfreeze()
    del model, official
    gc.collect()
    return out


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
            log(
                f"{cm['setting']:<11} {'causal_mediation':<20} {cm['median_s']:9.3f} "
                f"{cm['reps']:4d} {'':>8} {'':>6} {'':>9} {'':>11}  = "
                f"{cm['median_s'] / ra_s:.1f}x RA norms; all {cm['heads']} heads"
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
    key: str, batch: int, length: int, device: str, clock: Clock, top: int, log: Log
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
        start = clock.read()
        with torch_profile(activities=activities) as prof:
            fn()
            sync()
        totals[name] = clock.read() - start
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
    clock = choose_clock(device, torch.get_num_threads(), args.wall)

    if args.profile:
        result = {
            "profile": profile(
                args.profile_model,
                args.profile_batch,
                args.profile_len,
                device,
                clock,
                args.profile_top,
                log,
            )
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_file(args.json, json.dumps(result, indent=1))
        return result

    plan = tiny_plan() if args.tiny else full_plan(args.quick, args.all_scaling)
    if args.models:
        keep = set(args.models.split(","))
        plan.models = [m for m in plan.models if m.key in keep]
    memory = PeakMemory(device)
    started = WALL_CLOCK.read()
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
            "time_basis": clock.name,
            "timing": "median of repetitions (interleaved round-robin) after a warm-up that is "
            "also the memory run; time_basis 'cpu' = process CPU time (1 thread), else wall",
            "plan": asdict(plan),
        },
        "models": {},
    }
    log(
        f"bench_ra: {res['meta']['mode']} mode, device {device}, {res['meta']['threads']} "
        f"threads, time basis {clock.name}"
    )
    log(f"memory: {memory.method}; calibration {res['meta']['memory_calibration']}")
    for mp in plan.models:
        log(f"\n>> {mp.key}")
        res["models"][mp.key] = measure_model(mp, plan, device, clock, memory, log)
    res["ratios"], res["goals"] = compute_ratios(res, plan)
    res["meta"]["wall_s"] = WALL_CLOCK.read() - started
    res["meta"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print_table(res, log)
    print_goals(res, log)
    log(
        f"\nwall time {res['meta']['wall_s']:.0f} s; load average {load_start} -> "
        f"{res['meta']['loadavg_end']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(res, indent=1, default=float))
        log(f"JSON: {args.json}")
    return res


if __name__ == "__main__":
    main()
