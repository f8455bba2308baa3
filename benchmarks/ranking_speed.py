"""The head-ranking speed claim, timed on its own: RA's ranking (one forward + backward per batch)
against the causal-mediation scan (one forward per head), on the study's prompts.

    python benchmarks/ranking_speed.py                         # SmolLM2, CPU
    python benchmarks/ranking_speed.py --device cuda --json bench_out/ranking_speed.json
    python benchmarks/ranking_speed.py --device cuda --random-weights    # SmolLM2's shape only

`--random-weights` builds SmolLM2-135M's architecture (its config and tokenizer from the ra-lens
cache) with random weights: every timed operation is the same arithmetic whatever the weights, so
it times the same work on a machine the 98 MB model cannot reach. The cheap rankings take the
median of `--reps` runs after a warm-up; the scan runs once. The method: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from harness import choose_clock

from ra_lens import ranking as rk
from ra_lens import tasks
from ra_lens.experiments.ranking_study import SPEED_GOAL
from ra_lens.files import write_file
from ra_lens.models import hub_offline, load_model, smollm2_hf_dir
from ra_lens.tasks import task_prompts
from ra_lens.timing import timed


def random_smollm2(device: str) -> Any:
    """SmolLM2-135M's architecture and tokenizer with seeded random weights, as a bridge."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = smollm2_hf_dir()
    config = AutoConfig.from_pretrained(source)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    folder = tempfile.mkdtemp(prefix="ra_lens_random_smollm2_")
    hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with hub_offline():
        model = TransformerBridge.boot_transformers(folder, hf_model=hf_model, tokenizer=tokenizer)
    return model.to(device).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shape only")
    parser.add_argument("--task", default="antonym")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--n-prompts", type=int, default=25, help="prompts, one batch (25)")
    parser.add_argument("--reps", type=int, default=5, help="runs of each cheap ranking (5)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)

    model = random_smollm2(args.device) if args.random_weights else load_model(device=args.device)
    train, _ = task_prompts(model, tasks.load(args.task), args.shots, seed=42)
    texts = [p.text for p in train[: args.n_prompts]]
    targets = [tasks.answer_token(model, p.answer) for p in train[: args.n_prompts]]
    n = len(texts)
    clock = choose_clock(args.device, torch.get_num_threads(), wall=True)
    cheap = {
        "ra": lambda: rk.ra_ranking(model, texts, targets, batch_size=n),
        "ra_temperature": lambda: rk.temperature_ranking(model, texts, targets, batch_size=n),
        "cm_first_order": lambda: rk.first_order_mediation(model, texts, targets, batch_size=n),
        "forward": lambda: rk.forward_ranking(model, texts, batch_size=n),
    }
    seconds: dict[str, float] = {}
    for name, fn in cheap.items():
        fn()  # warm-up: the first backward on a GPU also loads its kernels
        runs: list[float] = []
        for _ in range(args.reps):
            span: dict[str, float] = {}
            with timed(span, name, clock=clock.read):
                fn()
            runs.append(span[name])
        seconds[name] = statistics.median(runs)
        print(f"{name:>16}: {seconds[name]:.3f} s (median of {args.reps})", flush=True)
    with timed(seconds, "causal_mediation", clock=clock.read):
        rk.causal_mediation(model, texts, targets, batch_size=n, progress=True)
    ratio = seconds["causal_mediation"] / seconds["ra"]
    print(f"causal_mediation: {seconds['causal_mediation']:.3f} s (one run)")
    print(f"causal mediation / RA: {ratio:.0f}x (goal >= {SPEED_GOAL:.0f}x: {ratio >= SPEED_GOAL})")
    report = {
        "device": args.device
        + (
            f" ({torch.cuda.get_device_name(args.device)})"
            if args.device.startswith("cuda")
            else ""
        ),
        "weights": "random (SmolLM2-135M shape)"
        if args.random_weights
        else "SmolLM2-135M-Instruct",
        "task": args.task,
        "shots": args.shots,
        "n_prompts": n,
        "reps": args.reps,
        "clock": clock.name,
        "seconds": seconds,
        "cm_over_ra": ratio,
        "goal": SPEED_GOAL,
        "met": ratio >= SPEED_GOAL,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
