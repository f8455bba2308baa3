"""Score ensembles, bootstrap-stable scores and refinement against single methods, in MIB's units.

Pairs of one task on the real SmolLM2 (or --model): TRAIN = the first --train pairs (every score
and every choice: which candidate, its refinement), TEST = the next --test pairs (CPR and CMD
reported there only, by `faithfulness_curve` with patching ablation at MIB's ten fractions of the
ungrouped edges). Each method's attribution is timed in process CPU seconds (`time.process_time`,
one thread); scores are computed pair by pair (`circuits.pair_scores`), so bootstrap resamples are
available; their means are what one `attribute` call returns. Candidates are chosen by the
training curve (coarser sizes, `TRAIN_FRACTIONS`); the test curves then run in priority order
(the chosen one, its refinement, the references), each saved as it finishes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ensembles_study.py --task ioi \\
        --json docs/results/ensembles_ioi.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from ra_lens import circuits
from ra_lens.experiments.circuit_study import task_pairs
from ra_lens.files import write_file
from ra_lens.tasks import ioi

#: label -> (attribute method, direction, steps)
BASES: dict[str, tuple[str, str, int]] = {
    "eap": ("eap", "denoise", 1),
    "exact": ("exact", "denoise", 1),
    "eap-ig-5": ("eap-ig", "denoise", 5),
    "eap-ig-5-noise": ("eap-ig", "noise", 5),
    "exact-ig-5": ("exact-ig", "denoise", 5),
}
#: label -> members (equal weights, rms-normalised)
ENSEMBLES: dict[str, tuple[str, ...]] = {
    "ens(eap,exact)": ("eap", "exact"),
    "ens(eap,eap-ig-5,exact)": ("eap", "eap-ig-5", "exact"),
    "ens(eap-ig-5,eap-ig-5-noise)": ("eap-ig-5", "eap-ig-5-noise"),
    "ens(eap-ig-5,exact-ig-5)": ("eap-ig-5", "exact-ig-5"),
}
#: The training curve's sizes (cheaper than MIB's ten; only for choosing).
TRAIN_FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="ioi")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--train", type=int, default=16)
    parser.add_argument("--test", type=int, default=32)
    parser.add_argument("--bases", default="eap,exact,eap-ig-5")
    parser.add_argument("--refine-budget", type=int, default=24)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from ra_lens.models import load_model

    model = load_model(args.model, device="cpu")
    pairs = task_pairs(model, args.task, args.train + args.test)
    train, test = pairs[: args.train], pairs[args.train : args.train + args.test]
    tr, te = ioi.paired_batch(model, train), ioi.paired_batch(model, test)
    out: dict[str, Any] = {
        "model": args.model,
        "task": args.task,
        "train_pairs": len(train),
        "test_pairs": len(test),
        "units": "ungrouped",
        "ablation": "patching",
        "clock": "process CPU seconds, 1 thread",
        "methods": {},
    }
    train_eval = circuits.FaithfulnessEvaluator(model, *tr, batch_size=32)
    candidates: dict[str, circuits.EdgeScores] = {}

    def save() -> None:
        write_file(args.json, json.dumps(out, indent=1), make_folders=True)

    def on_train(label: str, scores: circuits.EdgeScores, seconds: float) -> None:
        candidates[label] = scores
        curve = circuits.faithfulness_curve(
            model, scores, *tr, sizes=TRAIN_FRACTIONS, evaluate=lambda m, c, *a, **k: train_eval(c)
        )
        out["methods"][label] = {
            "method": scores.method,
            "attribution_seconds": seconds,
            "train": {"cpr": curve.cpr, "cmd": curve.cmd, "fractions": list(TRAIN_FRACTIONS)},
        }
        save()
        print(f"{label:34s} s={seconds:7.1f} train CPR {curve.cpr:.3f} CMD {curve.cmd:.4f}", flush=True)  # fmt: skip

    base: dict[str, circuits.EdgeScores] = {}
    for label in args.bases.split(","):
        method, direction, steps = BASES[label]
        scores = circuits.pair_scores(model, *tr, method=method, direction=direction, steps=steps)
        base[label] = scores
        on_train(label, scores, float(scores.seconds or 0.0))
        for name, members in ENSEMBLES.items():
            if label in members and all(m in base for m in members):
                combined = circuits.ensemble([base[m] for m in members])
                on_train(name, combined, float(combined.seconds or 0.0))
        if label in ("eap", "eap-ig-5"):
            stable = circuits.stable(scores, statistic="agreement")
            on_train(f"stable({label})", stable, float(stable.seconds or 0.0))
    # chosen on TRAIN only: the best train CMD, then refined on the training pairs
    chosen = min(out["methods"], key=lambda k: out["methods"][k]["train"]["cmd"])
    out["chosen_on_train"] = chosen
    start = time.process_time()
    refined = circuits.refine(
        candidates[chosen], train_eval, fractions=(0.05, 0.2), absolute=True,
        budget=args.refine_budget,
    )  # fmt: skip
    label = f"refined({chosen})"
    on_train(label, refined.scores, time.process_time() - start + float(candidates[chosen].seconds or 0.0))  # fmt: skip
    out["methods"][label]["refine"] = {
        "evaluations": refined.evaluations, "start": refined.start_objective,
        "end": refined.objective, "kept": [(s.node, s.multiplier) for s in refined.steps if s.kept],
    }  # fmt: skip
    save()
    del train_eval  # its corrupted outputs: memory for the test evaluator
    test_eval = circuits.FaithfulnessEvaluator(model, *te, batch_size=32)
    # held-out pairs: the chosen, its refinement and the references first
    order = [chosen, label, "eap-ig-5", "eap", "exact", *out["methods"]]
    done: set[str] = set()
    for name in order:
        if name in done or name not in candidates:
            continue
        done.add(name)
        begin = time.process_time()
        curve = circuits.faithfulness_curve(
            model, candidates[name], *te, evaluate=lambda m, c, *a, **k: test_eval(c)
        )
        out["methods"][name]["test"] = {"cpr": curve.cpr, "cmd": curve.cmd}
        out["methods"][name]["test_curve"] = curve.to_dict()
        out["methods"][name]["test_eval_seconds"] = time.process_time() - begin
        save()
        print(f"{name:34s} TEST CPR {curve.cpr:.3f} CMD {curve.cmd:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
