"""The `ra-lens` argument parser: every command, its options and the function that runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ra_lens.cli import attribute as attribute_command
from ra_lens.cli import circuit as circuit_command
from ra_lens.cli import maps as maps_command
from ra_lens.cli._shared import positive_float, positive_int
from ra_lens.cli.pairs import CIRCUIT_TASKS
from ra_lens.cli.patch_rank import (
    RANK_LEGEND,
    RANK_TIME,
    patch_out_files,
    rank_out_files,
    run_patch,
    run_rank,
)

MODEL_HELP = (
    "model: 'smollm2-135m' (default, embedded, offline), 'gemma3-270m' (embedded, offline; "
    "Gemma Terms of Use), a hub name for users with a network, "
    "or a tiny model with random weights, for trying the tool in seconds: 'tiny-gpt2', "
    "'tiny-llama', 'tiny-opt', 'tiny-native' (TransformerLens >= 3) or 'tiny-hooked' "
    "(TransformerLens 2)"
)


def build_parser() -> argparse.ArgumentParser:
    """The `ra-lens` argument parser (every command and its options)."""
    parser = argparse.ArgumentParser(
        prog="ra-lens",
        description="Reversed Attention (dL/d(QK^T), Katz & Wolf 2025) for TransformerLens models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_maps_command(sub)
    _add_patch_command(sub)
    _add_rank_command(sub)
    _add_attribute_command(sub)
    _add_circuit_command(sub)
    return parser


def _add_maps_command(sub: Any) -> None:
    """`ra-lens maps`: RA of every head for one prompt and target."""
    maps = sub.add_parser(
        "maps",
        help="RA of every head for one prompt and target: table, heat maps, circuitsvis page",
        description="Compute Reversed Attention of every head for -log p(target | prompt), print "
        "the heads with the largest RA norm, and write plots and an HTML view.",
    )
    maps.add_argument("--prompt", required=True, help="the prompt text")
    maps.add_argument("--target", required=True, help="the target text, e.g. ' Florence'")
    maps.add_argument(
        "--completion",
        action="store_true",
        help="teacher-force the whole target (mean NLL of all its tokens) instead of its first token",
    )
    maps.add_argument("--convention", default="qk", choices=["qk", "scores", "pattern"])
    maps.add_argument(
        "--top", type=positive_int, default=10, metavar="K", help="heads in the table (10)"
    )
    _common(maps)
    maps.set_defaults(run=maps_command._run_maps, out_files=maps_command.OUT_FILES)


def _add_patch_command(sub: Any) -> None:
    """`ra-lens patch`: attention patching on an ICL task."""
    patch = sub.add_parser(
        "patch",
        help="attention patching on an ICL task: accuracy against patching scale",
        description="Average RA over training prompts of an ICL task, add scale x mean RA to the "
        "attention of held-out prompts, and report top-1/3 accuracy per scale against the "
        "forward-pattern baseline. The headline scale is chosen on validation prompts (training "
        "prompts not averaged, or half of the held-out ones) and reported on the test prompts.",
    )
    _task_args(patch)
    patch.add_argument("--shots", type=int, default=0, help="demonstrations per prompt (0)")
    patch.add_argument(
        "--n-prompts", type=int, default=25, help="prompts whose RA is averaged (25)"
    )
    patch.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    patch.add_argument(
        "--scales",
        default=None,
        help="comma-separated scales (default: the paper's grid, extended)",
    )
    _common(patch)
    patch.set_defaults(run=run_patch, out_files=patch_out_files)


def _add_rank_command(sub: Any) -> None:
    """`ra-lens rank`: head rankings against the baselines."""
    rank = sub.add_parser(
        "rank",
        help="rank heads by RA against causal mediation, activation and attribution patching",
        description="Rank attention heads for an ICL task by RA norm and by the baselines, then "
        "keep the top p% of heads (ablating the rest) and measure accuracy.",
        epilog=f"{RANK_LEGEND}\n\n{RANK_TIME}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rank.add_argument(
        "--task",
        required=True,
        action="append",
        help="ICL task (repeat for several), one of: " + ", ".join(_task_names()),
    )
    rank.add_argument(
        "--rankings",
        default=None,
        help="comma-separated rankings (default all): " + ", ".join(_ranking_names()),
    )
    rank.add_argument("--shots", type=int, default=5, help="demonstrations per prompt (5)")
    rank.add_argument("--n-prompts", type=int, default=25, help="prompts per ranking (25)")
    rank.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    rank.add_argument(
        "--ablation", default="zero", choices=["zero", "mean"], help="how heads are removed (zero)"
    )
    rank.add_argument(
        "--fractions", default=None, help="comma-separated fractions of heads kept (0,0.1,...,1)"
    )
    _common(rank)
    rank.set_defaults(run=run_rank, out_files=rank_out_files)


def _add_attribute_command(sub: Any) -> None:
    """`ra-lens attribute`: query/key/pattern attribution of every head."""
    attribute = sub.add_parser(
        "attribute",
        help="query/key/pattern attribution of every head for a clean/corrupted pair",
        description="Estimate, for every head, what patching its queries, keys or pattern from "
        "the clean prompt into the corrupted one does to logit(target) - logit(wrong) (or to "
        "p(target) without --wrong), with an exact softmax for queries and keys (AtP*'s fix).",
    )
    attribute.add_argument("--clean", help="the clean prompt (or --task / --pairs)")
    attribute.add_argument("--corrupted", help="the corrupted prompt (same token length)")
    attribute.add_argument("--target", help="the clean answer, e.g. ' Mary'")
    _pair_source_args(attribute, required=False)
    attribute.add_argument(
        "--wrong", default=None, help="a wrong answer: metric = logit(target) - logit(wrong)"
    )
    attribute.add_argument("--method", default="exact", choices=["exact", "exact-ig", "linear"])
    attribute.add_argument("--direction", default="denoise", choices=["denoise", "noise"])
    attribute.add_argument(
        "--top", type=positive_int, default=10, metavar="K", help="rows per table (10)"
    )
    _common(attribute)
    attribute.set_defaults(
        run=attribute_command._run_attribute, out_files=attribute_command.OUT_FILES
    )


def _add_circuit_command(sub: Any) -> None:
    """`ra-lens circuit`: edge scores, a circuit and its faithfulness curve."""
    circuit = sub.add_parser(
        "circuit",
        help="edge scores over the component graph, a circuit and its faithfulness curve",
        description="Score every edge writer -> reader (input, head outputs, MLPs -> queries, "
        "keys, values, MLPs, logits) for logit(answer) - logit(wrong) over many clean/corrupted "
        "pairs, measure the faithfulness of circuits of increasing size by edge patching (with "
        "MIB's CPR and CMD), and write the curve, a picture and the EAP-IG/MIB JSON file of one "
        "circuit.",
    )
    _pair_source_args(circuit, required=True)
    circuit.add_argument(
        "--method",
        default="eap-ig",
        choices=["eap", "eap-ig", "exact", "exact-ig", "mask", "discover"],
        help="edge scores (default eap-ig: EAP-IG-inputs' algorithm; mask: circuits.learn_mask "
        "with the scaled rule from eap-ig; discover: circuits.discover, two such masks cross-fitted "
        "on the halves of the pairs with calibrated negatives, >= 4 pairs; both train on these "
        "pairs, so their curves here are not held-out measures: those are in the README)",
    )
    circuit.add_argument("--direction", default="denoise", choices=["denoise", "noise"])
    circuit.add_argument(
        "--steps",
        type=positive_int,
        default=5,
        help="IG steps (eap-ig, exact-ig; 5; mask and discover warm-start from eap-ig with 5)",
    )
    circuit.add_argument(
        "--sizes",
        default=None,
        help="comma-separated fractions of the graph's edges, increasing (default MIB's "
        "0.001,0.002,0.005,0.01,0.02,0.05,0.1,0.2,0.5,1), counted as MIB counts them (EAP-IG's "
        "ungrouped graph; see --units)",
    )
    circuit.add_argument(
        "--units",
        default="ungrouped",
        choices=["ungrouped", "grouped"],
        help="edge counts of the curve: ungrouped (MIB's: a grouped key/value edge once per "
        "query head of its group) or grouped (this graph's edges)",
    )
    circuit.add_argument("--selection", default="top", choices=["top", "greedy"])
    circuit.add_argument("--ablation", default="patching", choices=["patching", "mean", "zero"])
    _circuit_size_args(circuit)
    circuit.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="pairs per pass, for scoring and every faithfulness pass (8)",
    )
    _circuit_file_args(circuit)
    _common(circuit)
    circuit.set_defaults(run=circuit_command._run_circuit, out_files=circuit_command.OUT_FILES)


def _circuit_size_args(circuit: argparse.ArgumentParser) -> None:
    """`ra-lens circuit`'s choice of the circuit drawn and saved: --faithfulness or --edges."""
    size = circuit.add_mutually_exclusive_group()
    size.add_argument(
        "--faithfulness",
        type=positive_float,
        default=None,
        metavar="F",
        help="the circuit drawn and saved is the smallest (by |score|) whose faithfulness reaches "
        "F: the first size of the curve reaching it, narrowed by bisection (default 0.8 unless "
        "--edges is given; if no size reaches F, the most faithful circuit measured, said so)",
    )
    size.add_argument(
        "--edges",
        type=positive_int,
        default=None,
        metavar="N",
        help="instead of --faithfulness: the N edges with the largest |score|, counted as MIB "
        "counts them (ungrouped: a grouped key/value edge once per query head), fewer after "
        "pruning edges off every input-to-logits path",
    )


def _circuit_file_args(circuit: argparse.ArgumentParser) -> None:
    """`ra-lens circuit`'s extra outputs: the MIB folder and the offline page."""
    circuit.add_argument(
        "--mib",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write a MIB circuit-track folder for this task and model: DIR/importances.json "
        "(every edge's score, EAP-IG's ungrouped layout, what MIB's run_evaluation.py loads) and "
        "DIR/circuits/ (the nine binary circuits at 0.1-50 %% of the edges, signed ranking)",
    )
    circuit.add_argument(
        "--html",
        type=Path,
        default=None,
        metavar="PATH",
        help="write one self-contained offline HTML page: the circuits of the curve and the "
        "circuit saved, each head's attention pattern and RA on the first pairs",
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "bridge", "hooked"],
        help="TransformerBridge (TL >= 3), HookedTransformer (TL 2.x) or auto: the bridge where "
        "installed (auto)",
    )
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write plots here")
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="write machine-readable results ('-': stdout)"
    )


def _task_args(parser: argparse.ArgumentParser) -> None:
    from ra_lens import tasks

    parser.add_argument(
        "--task", required=True, help=f"ICL task, one of: {', '.join(tasks.available())}"
    )


def _pair_source_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--task", choices=CIRCUIT_TASKS, help="built-in paired prompts")
    source.add_argument(
        "--pairs",
        type=Path,
        metavar="FILE.jsonl",
        help='one pair a line: {"clean": ..., "corrupted": ..., "answer": ..., "wrong": ...} '
        "(answers one token; clean and corrupted the same token length)",
    )
    parser.add_argument(
        "--n-pairs", type=positive_int, default=16, metavar="N", help="pairs used (16)"
    )


def _task_names() -> list[str]:
    from ra_lens import tasks

    return tasks.available()


def _ranking_names() -> list[str]:
    from ra_lens.experiments.head_ranking import RANKINGS

    return list(RANKINGS)
