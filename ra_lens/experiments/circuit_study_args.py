"""The circuit study's command line: its flags (`parser`), the settings they ask for over the
--quick or full ones (`settings`: explicit flags win) and the model they name (`study_model`).
`circuit_study.main` runs them."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from ra_lens.experiments.circuit_study_pairs import TASKS
from ra_lens.types import HookedModel


def parser(methods: Sequence[str], description: str | None) -> argparse.ArgumentParser:
    """The flags of ``python -m ra_lens.experiments.circuit_study``; `methods`: the labels."""
    parser = argparse.ArgumentParser(prog="circuit_study", description=description)
    parser.add_argument("--quick", action="store_true", help="tiny model and toy pairs: seconds")
    parser.add_argument("--model", default="smollm2-135m", help="model for load_model")
    parser.add_argument("--tasks", default=None, help=f"comma-separated ({','.join(TASKS)})")
    parser.add_argument("--n-pairs", type=int, default=None, help="held-out pairs per task (32)")
    parser.add_argument(
        "--train-pairs", type=int, default=None,
        help="pairs per task to score on, before the held-out ones (16; 0: score the held-out)",
    )  # fmt: skip
    parser.add_argument("--methods", default=None, help=f"comma-separated ({','.join(methods)})")
    parser.add_argument("--ablations", default=None, help="patching,mean (both)")
    parser.add_argument("--batch-size", type=int, default=None, help="pairs per pass (8)")
    parser.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples (1000)")
    parser.add_argument(
        "--truth-tasks", default=None, help="tasks with head activation patching (ioi); '' for none"
    )
    parser.add_argument("--truth-pairs", type=int, default=None, help="its pairs (8)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results")
    parser.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="write tables")
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=None, metavar="JSON",
        help="merge saved studies (run side by side) into --json / --markdown",
    )  # fmt: skip
    parser.add_argument(
        "--selection", choices=("top", "greedy"), default=None,
        help="circuits: top-n then pruned (top), or grown from the logits (greedy); both by "
        "score (CPR) and by |score| (CMD)",
    )  # fmt: skip
    parser.add_argument(
        "--own-copies", action="store_true",
        help="per-copy circuits: each query head's key/value copy chosen and patched on its own",
    )  # fmt: skip
    parser.add_argument(
        "--refits", type=int, default=None, metavar="N",
        help="each method's bootstrap Jaccard: run it again on N resamples of the training "
        "pairs (N + 1 runs per method; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--pair-seed", type=int, default=None, metavar="SEED",
        help="draw the IOI pairs with this seed (0, the default: the study's pairs; another "
        "seed: another sample, e.g. to check a method on pairs it was not developed on)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """The comma-separated names in `text`, each one of `allowed`; a ValueError naming them."""
    found = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in found if n not in allowed]
    if bad or not found:
        raise ValueError(f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed)}")  # fmt: skip
    return found


def settings(
    args: argparse.Namespace, base: dict[str, Any], methods: Sequence[str]
) -> dict[str, Any]:
    """`base` (the --quick or full settings) with the flags given on the command line over it;
    a ValueError naming a flag whose value is not allowed."""
    chosen = dict(base)
    if args.tasks is not None:
        chosen["tasks"] = names(args.tasks, (*TASKS, "toy"), "task")
    if args.methods is not None:
        chosen["methods"] = names(args.methods, tuple(methods), "method")
    if args.ablations is not None:
        chosen["ablations"] = names(args.ablations, ("patching", "mean", "zero"), "ablation")
    if args.truth_tasks is not None:
        chosen["truth_tasks"] = (
            names(args.truth_tasks, (*TASKS, "toy"), "task") if args.truth_tasks else []
        )
    if args.selection is not None:
        chosen["selection"] = args.selection
    if args.own_copies:
        chosen["own_copies"] = True
    for flag in ("n_pairs", "batch_size", "n_boot", "truth_pairs", "train_pairs", "refits", "pair_seed"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            least = {"train_pairs": 0, "refits": 0, "pair_seed": 0}.get(flag, 1)
            if flag == "refits" and value == 1:
                raise ValueError("--refits 1: a bootstrap Jaccard compares resamples, give 2 or more (0: none)")  # fmt: skip
            if value < least:
                raise ValueError(
                    f"--{flag.replace('_', '-')} must be at least {least}, got {value}"
                )
            chosen[flag] = value
    return chosen


def study_model(args: argparse.Namespace) -> tuple[HookedModel, str]:
    """The model the flags name and how the study records it: --quick's tiny random model (a
    TransformerBridge where one is installed), else `load_model(--model)`."""
    if args.quick:
        from ra_lens.models import bridge_available
        from ra_lens.toy_models import tiny_model

        arch: Literal["llama", "hooked"] = "llama" if bridge_available() else "hooked"
        return tiny_model(arch, n_layers=2), f"tiny-{arch} (random weights)"
    from ra_lens.models import load_model

    return load_model(args.model), args.model
