"""Circuit discovery per second: what each edge-scoring method of `ra_lens.circuits.attribute`
and `circuits.discover` cost on one set of IOI pairs, and what `FaithfulnessEvaluator` saves
over one `faithfulness` call per circuit along a faithfulness curve.

    python benchmarks/bench_circuits.py [--pairs 8] [--threads 1] [--json FILE]
    python benchmarks/bench_circuits.py --tiny --json out.json   # seconds: tiny model, smoke test

Ratios are measured in one run (never against numbers from another run): each method's seconds
over eap's, the exact methods' over eap-ig-5's and eap-ig-20's, discover's over eap-ig-5's (its
goal: at most 10x, issue 39's budget against EAP-IG-inputs), and the per-call faithfulness
seconds over the evaluator's for the same circuits (whose values must agree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from harness import choose_clock

from ra_lens import circuits
from ra_lens.files import write_file
from ra_lens.timing import timed

#: label -> (circuits.attribute method, IG steps)
METHODS: dict[str, tuple[str, int]] = {
    "eap": ("eap", 1),
    "eap-ig-5": ("eap-ig", 5),
    "eap-ig-20": ("eap-ig", 20),
    "exact": ("exact", 1),
    "exact-ig-5": ("exact-ig", 5),
}
#: Circuit sizes along the curve (fractions of the graph's edges).
FRACTIONS: tuple[float, ...] = (0.001, 0.01, 0.05, 0.2, 0.5)


def setting(tiny: bool, n_pairs: int) -> tuple[Any, str, list[Any]]:
    """(model, its name, the pairs): SmolLM2 and IOI pairs, or a tiny Llama and toy pairs."""
    from ra_lens.experiments.circuit_study import task_pairs

    if tiny:
        from ra_lens.models import bridge_available
        from ra_lens.toy_models import tiny_model

        arch = "llama" if bridge_available() else "hooked"
        model = tiny_model(arch, n_layers=2)
        return model, f"tiny-{arch}", task_pairs(model, "toy", n_pairs)
    from ra_lens.models import load_model

    model = load_model(device="cpu")
    return model, "smollm2-135m", task_pairs(model, "ioi", n_pairs)


def run(tiny: bool, n_pairs: int, threads: int, log: Any = print) -> dict[str, Any]:
    torch.set_num_threads(threads)
    clock = choose_clock("cpu", threads)
    from ra_lens.tasks import ioi

    model, name, pairs = setting(tiny, n_pairs)
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    seconds: dict[str, float] = {}
    scores = {}
    for label, (method, steps) in METHODS.items():
        with timed(seconds, label, clock=clock.read):
            scores[label] = circuits.attribute(
                model, clean, corrupted, metric, method=method, steps=steps, batch_size=n_pairs
            )
        log(f"attribute {label}: {seconds[label]:.2f} s ({clock.name})")
    with timed(seconds, "discover", clock=clock.read):
        circuits.discover(model, clean, corrupted, metric, batch_size=n_pairs)
    log(f"discover: {seconds['discover']:.2f} s ({clock.name})")
    graph = scores["exact"].graph
    chosen = [scores["exact"].top(int(k * graph.n_edges)) for k in FRACTIONS]
    per_call, evaluated = [], []
    with timed(seconds, "faithfulness_per_call", clock=clock.read):
        for circuit in chosen:
            result = circuits.faithfulness(
                model, circuit, clean, corrupted, metric, batch_size=n_pairs
            )
            per_call.append(result.value)
    with timed(seconds, "faithfulness_evaluator", clock=clock.read):
        evaluate = circuits.FaithfulnessEvaluator(
            model, clean, corrupted, metric, batch_size=n_pairs
        )
        evaluated = [evaluate(circuit).value for circuit in chosen]
    largest = max(abs(a - b) for a, b in zip(per_call, evaluated, strict=True))
    if largest > 1e-5:
        raise AssertionError(f"the evaluator differs from faithfulness by {largest:.2g}")
    ratios = {
        **{f"{m}/eap": seconds[m] / seconds["eap"] for m in METHODS if m != "eap"},
        **{
            f"{m}/eap-ig-5": seconds[m] / seconds["eap-ig-5"]
            for m in ("exact", "exact-ig-5", "discover")
        },
        # EAP-IG with 20 steps is the study's reference for "no more than EAP-IG's time".
        **{f"{m}/eap-ig-20": seconds[m] / seconds["eap-ig-20"] for m in ("exact", "exact-ig-5")},
        "faithfulness per call / evaluator": seconds["faithfulness_per_call"]
        / seconds["faithfulness_evaluator"],
    }
    for key, value in ratios.items():
        log(f"{key}: {value:.2f}x")
    return {
        "model": name,
        "n_pairs": len(pairs),
        "n_edges": graph.n_edges,
        "threads": threads,
        "clock": clock.name,
        "seconds": seconds,
        "ratios": ratios,
        "curve": {"fractions": list(FRACTIONS), "faithfulness": evaluated},
        "evaluator_max_difference": largest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and toy pairs: seconds")
    parser.add_argument("--pairs", type=int, default=8, help="IOI pairs, one batch (8)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: CPU clock)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    result = run(args.tiny, args.pairs if not args.tiny else min(args.pairs, 4), args.threads)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
