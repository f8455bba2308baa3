"""The circuit study: which edge scores give the most faithful circuits, per second (issue 22).

For each task (IOI, country-capital, antonym word pairs with a swapped query), every method scores
all edges of the model's graph (`circuits.attribute`; "random" draws uniform scores), circuits of
MIB's sizes (and of 100, 500, 2,000 edges) are taken from the scores as MIB takes them
(`circuits.mib_circuits`): n counts edges of EAP-IG's ungrouped graph, twice, once from the
signed ranking (the largest scores) and once from the |score| ranking (top-n, pruned;
`--selection greedy`: grown from the logits, `EdgeScores.greedy`), and measured by edge patching
(`circuits.faithfulness`) under each ablation. Faithfulness at a size is (m(circuit) - m(empty)) /
(m(clean) - m(empty)), m the metric's mean over pairs and "empty" the empty circuit under that
ablation (ra-lens's one definition, MIB's), so every curve runs from 0 (no edge) to 1 (every
edge). CPR is MIB's trapezoid area over the fraction of edges of the signed ranking's curve, CMD
the area of |1 - f| of the |score| ranking's curve (as MIB's print_results.py reports them). Intervals: 95 % percentile bootstrap over
pairs, the same resamples for every method, so paired differences between methods come with
their own interval. The per-pair metrics are saved, so every number recomputes from the JSON.
Ground truth for head scores: each head's output patched from clean into the corrupted run
(`head_patching`) on the first pairs of the `--truth-tasks`, against each method's head scores
(its outgoing edges summed), Pearson r. The pairs are built in `circuit_study_pairs`, the
statistics, goals and tables computed in `circuit_study_report`, the flags read in
`circuit_study_args`, the files written and checked in `circuit_study_saved`, the methods
(`METHODS`, `ENSEMBLES`, `MASK_OPTIONS`) scored and timed in `circuit_study_methods`; this module
runs them, measures their circuits and merges saved studies.

    python -m ra_lens.experiments.circuit_study --quick                      # tiny model, seconds
    python -m ra_lens.experiments.circuit_study --json docs/results/circuit_study.json \\
        --markdown docs/results/circuit_study.md
    python -m ra_lens.experiments.circuit_study --merge a.json b.json --json all.json  # parts
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture, circuits, timing
from ra_lens.circuits.faithfulness import BASELINE
from ra_lens.circuits.mib import MIB_FRACTIONS
from ra_lens.experiments import circuit_study_args as study_args
from ra_lens.experiments.circuit_study_measure import Measured, measure_method
from ra_lens.experiments.circuit_study_methods import DEFAULT_METHOD, METHODS, Refits, Scored

# The pairs live in circuit_study_pairs, the statistics in circuit_study_report; antonym_pairs,
# fraction_columns, paired_difference re-exported.
from ra_lens.experiments.circuit_study_pairs import TASKS, task_pairs
from ra_lens.experiments.circuit_study_pairs import antonym_pairs as antonym_pairs
from ra_lens.experiments.circuit_study_report import fraction_columns as fraction_columns
from ra_lens.experiments.circuit_study_report import goals, markdown, summarise
from ra_lens.experiments.circuit_study_report import paired_difference as paired_difference
from ra_lens.experiments.circuit_study_saved import (
    load_saved,
    merge_method,
    save_study,
    saved_selection,
)
from ra_lens.files import check_writable
from ra_lens.progress import tqdm
from ra_lens.ranking.node_patching import Job, patching_effects
from ra_lens.ranking.statistics import pearson
from ra_lens.tasks import ioi
from ra_lens.tasks.ioi import PromptPair
from ra_lens.types import HookedModel

ABLATIONS: tuple[str, ...] = ("patching", "mean")
#: Edge counts reported beside the fractions, to compare with EAP-IG's own numbers (issue 22).
EDGE_COUNTS: tuple[int, ...] = (100, 500, 2000)

# --quick: a tiny random model and pairs its tokenizer writes with one-token words; its graph
# (about 300 edges) is small, so the fractions are coarse and the edge counts small.
QUICK_SETTINGS: dict[str, Any] = {
    "tasks": ["toy"],
    "n_pairs": 6,
    "train_pairs": 3,
    "methods": list(METHODS),
    "ablations": list(ABLATIONS),
    "batch_size": 4,
    "n_boot": 200,
    "fractions": (0.01, 0.1, 0.5, 1.0),
    "edge_counts": (10, 50),
    "truth_tasks": ["toy"],
    "truth_pairs": 2,
    "selection": "top",
}
FULL_SETTINGS: dict[str, Any] = {
    "tasks": list(TASKS),
    "n_pairs": 32,
    "train_pairs": 16,
    "methods": ["eap", "eap-ig-5", "exact-ig-5", "random"],
    "ablations": list(ABLATIONS),
    "batch_size": 8,
    "n_boot": 1000,
    "fractions": MIB_FRACTIONS,
    "edge_counts": EDGE_COUNTS,
    "truth_tasks": ["ioi"],
    "truth_pairs": 8,
    "selection": "top",
}


# --------------------------------------------------------------------------------------------
# running


def head_patching(model: HookedModel, pairs: Sequence[PromptPair]) -> Float[Tensor, "layer head"]:
    """Ground truth for head (node) scores: m(corrupted run with head h's output patched to
    clean) - m(corrupted), mean over pairs (denoise, as the edge scores), every position patched
    (`ranking.node_patching`, kind "output")."""
    clean, corrupted, metric = ioi.paired_batch(model, list(pairs))
    shape = capture.model_shape(model)
    jobs: list[Job] = [
        ("output", layer, head, None)
        for layer in range(shape.n_layers)
        for head in range(shape.n_heads)
    ]
    max_rows = shape.n_heads * clean.tokens.shape[0]  # one layer's heads per forward pass
    effects = patching_effects(
        model, clean, corrupted, metric, jobs, max_rows=max_rows, progress=False
    )
    return effects.mean(1).reshape(shape.n_layers, shape.n_heads)


def head_node_scores(
    scores: circuits.EdgeScores,
) -> Float[Tensor, "layer head"]:
    """Each head's node score from its edge scores: the sum over its outgoing edges, the first-
    order effect of patching its output into every reader (as `attribute_nodes`), in
    MIB's sign (`EdgeScores.helps`: noise scores negated, so they compare with denoise truth)."""
    g = scores.graph
    writers = scores.helps.detach().sum(1)  # under TL 2 attribute returns scores with grad
    index = [[g.writer_index[f"a{la}.h{h}"] for h in range(g.n_heads)] for la in range(g.n_layers)]
    return writers[torch.tensor(index)]


def edge_sizes(n_edges: int, fractions: Sequence[float], counts: Sequence[int]) -> list[int]:
    """Edges asked for: int(k * n_edges) for MIB's fractions (rounded down, as MIB) and the
    fixed counts that fit, sorted, without repeats.

    >>> edge_sizes(1000, (0.001, 0.01, 1.0), (100, 500, 2000))
    [1, 10, 100, 500, 1000]
    """
    asked = {int(k * n_edges) for k in fractions} | {c for c in counts if c <= n_edges}
    return sorted(asked)


def _task_record(
    pairs: Sequence[PromptPair],
    train: Sequence[PromptPair],
    graph: circuits.Graph,
    sizes: list[int],
    edge_counts: Sequence[int],
    reference: dict[str, dict[str, list[float]]],
) -> dict[str, Any]:
    """The start of one task's JSON: its pairs, the graph's edges, the sizes asked for."""
    return {
        "n_pairs": len(pairs),
        "pairs": [[p.clean, p.corrupted, p.answer, p.wrong] for p in pairs],
        "train_pairs": [[p.clean, p.corrupted, p.answer, p.wrong] for p in train],
        "n_edges_total": graph.n_edges_ungrouped,
        "n_edges_grouped": graph.n_edges,
        "units": "ungrouped",
        "sizes": sizes,
        "edge_counts": [c for c in edge_counts if c in sizes],
        "reference": reference,
        "methods": {},
    }


def _truth(
    model: HookedModel, pairs: Sequence[PromptPair], truth_pairs: int
) -> tuple[Float[Tensor, "layer head"], dict[str, Any]]:
    """Head activation patching on the first `truth_pairs` pairs, and its record with its
    seconds (each method's Pearson r to it is added by `_compare_heads`)."""
    spans: dict[str, float] = {}
    with timing.timed(spans, "truth"):
        truth = head_patching(model, pairs[:truth_pairs])
    record = {
        "pairs": min(truth_pairs, len(pairs)),
        "heads": truth.tolist(),
        "seconds": spans["truth"],
        "pearson": {},
    }
    return truth, record


def _compare_heads(
    model: HookedModel,
    pairs: Sequence[PromptPair],
    truth_pairs: int,
    truth: Float[Tensor, "layer head"],
    label: str,
    scores: circuits.EdgeScores,
    record: dict[str, Any],
    batch_size: int,
) -> None:
    """The method's head node scores on the truth's pairs (an extra attribution when those are
    fewer than the pairs) and their Pearson r to the truth, into `record` (the task's "truth").
    An ensemble is left out (its scores are its members', compared on their own), and so is a
    learned mask, calibrated or not (its scores are a mask, not an attribution of the truth's
    pairs)."""
    method, steps, direction = METHODS[label]
    if method == "ensemble" or method == "mask" or method == "calibrated":
        return
    subset = scores
    if truth_pairs < len(pairs) and method != "random":
        sub_clean, sub_corrupted, sub_metric = ioi.paired_batch(model, pairs[:truth_pairs])
        subset = circuits.attribute(
            model, sub_clean, sub_corrupted, sub_metric, method=method, steps=steps,
            direction=direction, batch_size=batch_size,
        )  # fmt: skip
    heads = head_node_scores(subset)
    record["pearson"][label] = pearson(heads, truth)
    record.setdefault("head_scores", {})[label] = heads.tolist()


def run_task(
    model: HookedModel,
    pairs: Sequence[PromptPair],
    *,
    train: Sequence[PromptPair] = (),
    methods: Sequence[str],
    ablations: Sequence[str],
    fractions: Sequence[float],
    edge_counts: Sequence[int],
    batch_size: int,
    progress: bool = True,
    on_method: Any = None,
    truth_pairs: int = 0,
    selection: str = "top",
    own_copies: bool = False,
    refits: int = 0,
) -> dict[str, Any]:
    """Score on `train` (the held-out `pairs` themselves when empty), choose, and measure on
    `pairs`: the raw per-pair metrics of one task, JSON-ready.

    Returns a dict with "sizes" (ungrouped edges asked for), per ablation the reference metrics
    per pair ("clean", "corrupted", "empty"), and per method its attribution seconds (wall,
    "seconds"; CPU of this process, "cpu_seconds") and, for
    the |score| ranking ("n_edges", "circuit") and the signed one ("signed_n_edges",
    "signed_circuit"), the ungrouped edges kept at each size after pruning and, per ablation,
    the circuit metric per size and pair.
    `on_method(partial result)` runs after each method (to save partial results). With
    truth_pairs > 0, head activation patching on the first truth_pairs pairs ("truth") and each
    method's head node scores on the same pairs ("head_scores", summed from their edge scores:
    an extra attribution when truth_pairs < the number of pairs) and Pearson r to the truth.
    With refits > 0, each method also runs on that many bootstrap resamples of the training
    pairs ("jaccard": its circuits' bootstrap Jaccard at MIB's submission sizes, `_Refits`).
    """
    measure = Measured(model, pairs, batch_size)
    graph = circuits.Graph.from_model(model)
    score = Scored(model, list(train) or list(pairs), graph, batch_size, own_copies)
    refit = Refits(score, list(train) or list(pairs), refits) if refits else None
    sizes = edge_sizes(graph.n_edges_ungrouped, fractions, edge_counts)  # MIB's units
    start = timing.now()
    for ablation in ablations:
        measure(circuits.Circuit.empty(graph), ablation)
    out = _task_record(pairs, train, graph, sizes, edge_counts, measure.reference)
    truth = None
    if truth_pairs > 0:
        truth, out["truth"] = _truth(model, pairs, truth_pairs)
    for label in tqdm(methods, desc="methods", disable=not progress):
        scores, times = score(label)
        if truth is not None:
            _compare_heads(
                model, pairs, truth_pairs, truth, label, scores, out["truth"], batch_size
            )
        spent = dict(times)
        out["methods"][label] = measure_method(
            scores,
            measure,
            sizes,
            ablations,
            selection,
            spent,
            own_copies=own_copies,
        )
        if label in score.calibrations:
            out["methods"][label]["negative_scale"] = score.calibrations[label]
        if refit is not None:
            out["methods"][label]["jaccard"] = refit(label)
        out["seconds"] = timing.now() - start
        if on_method is not None:
            on_method(out)
    return out


# --------------------------------------------------------------------------------------------
# the study


def circuit_study(
    model: HookedModel,
    *,
    tasks: Sequence[str],
    n_pairs: int,
    methods: Sequence[str],
    ablations: Sequence[str],
    batch_size: int,
    n_boot: int,
    train_pairs: int = 0,
    fractions: Sequence[float] = MIB_FRACTIONS,
    edge_counts: Sequence[int] = EDGE_COUNTS,
    model_name: str = "",
    progress: bool = True,
    on_task: Any = None,
    truth_tasks: Sequence[str] = (),
    truth_pairs: int = 8,
    selection: str = "top",
    own_copies: bool = False,
    refits: int = 0,
    pair_seed: int = 0,
) -> dict[str, Any]:
    """Run every task; `on_task(study)` after each method of each task (to save partial
    results). Each task's first `train_pairs` pairs are scored and the next `n_pairs` (held out)
    measured, as MIB attributes on its train split and evaluates on another; a task with fewer
    pairs keeps n_pairs held out and trains on what is left (at least 4), train_pairs=0 scores
    the measured pairs themselves. Head activation patching (ground truth for head scores) on the first
    `truth_pairs` pairs of the tasks in `truth_tasks`. refits > 0: each method's bootstrap
    Jaccard from that many resamples of the training pairs (`run_task`). pair_seed: draw the
    IOI pairs with another seed (recorded in the config where not 0)."""
    config = {
        "model": model_name,
        "device": str(next(model.parameters()).device),
        "torch_threads": torch.get_num_threads(),
        "tasks": list(tasks),
        "n_pairs": n_pairs,
        "train_pairs": train_pairs,
        "methods": {m: list(METHODS[m]) for m in methods},
        "ablations": list(ablations),
        "batch_size": batch_size,
        "n_boot": n_boot,
        "fractions": list(fractions),
        "edge_counts": list(edge_counts),
        "selection": selection,
        "own_copies": own_copies,
        "refits": refits,
        **_RECORDED,
        "truth_tasks": list(truth_tasks),
        "truth_pairs": truth_pairs,
        **({"pair_seed": pair_seed} if pair_seed else {}),
    }
    study: dict[str, Any] = {"config": config, "tasks": {}}
    start = timing.now()
    for name in tasks:
        train, pairs = _split(model, name, n_pairs, train_pairs, pair_seed)

        def keep(task: dict[str, Any], name: str = name) -> None:
            task["summary"] = summarise(task, fractions, n_boot)
            study["tasks"][name] = task
            study["runtime_seconds"] = timing.now() - start
            study["goals"] = goals(study)
            if on_task is not None:
                on_task(study)

        keep(
            run_task(
                model,
                pairs,
                train=train,
                methods=methods,
                ablations=ablations,
                fractions=fractions,
                edge_counts=edge_counts,
                batch_size=batch_size,
                progress=progress,
                on_method=keep,
                truth_pairs=truth_pairs if name in truth_tasks else 0,
                selection=selection,
                own_copies=own_copies,
                refits=refits,
            )
        )
    study["runtime_seconds"] = timing.now() - start
    study["goals"] = goals(study)
    return study


#: What every study records of how it measures (the config's fixed part).
_RECORDED: dict[str, str] = {
    "units": "ungrouped",
    "faithfulness_baseline": BASELINE,
    "cpr_from": "signed ranking (largest score)",
    "cmd_from": "|score| ranking",
    "direction": "per method (METHODS)",
    "default_method": DEFAULT_METHOD,
}


def _split(
    model: HookedModel, name: str, n_pairs: int, train_pairs: int, seed: int = 0
) -> tuple[list[PromptPair], list[PromptPair]]:
    """The task's training pairs (the first train_pairs, or fewer but at least 4 where the task
    has too few) and its n_pairs held-out ones (`seed`: `task_pairs`'s)."""
    every = task_pairs(model, name, train_pairs + n_pairs, seed)
    if not every:
        raise ValueError(f"task {name!r} has no usable pairs for this model's tokenizer")
    n_train = min(train_pairs, len(every) - n_pairs)
    if train_pairs and n_train < min(train_pairs, 4):
        raise ValueError(
            f"task {name!r} has {len(every)} usable pairs: too few for {n_pairs} held-out "
            f"pairs and at least {min(train_pairs, 4)} to score on; lower --n-pairs"
        )
    return every[:n_train], every[n_train:]


def merge_saved(studies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Studies that ran side by side (other methods, tasks or ablations, same settings) as one: a
    task in several must have the same pairs and sizes; its methods (and a method's ablations)
    are pooled, summaries and goals recomputed from the per-pair metrics. Runtime: the sum of the
    parts' (they may have run one after another)."""
    if not studies:
        raise ValueError("merge needs at least one saved study")
    keys = ("model", "n_pairs", "train_pairs", "batch_size", "n_boot", "fractions", "edge_counts", "selection", "own_copies", "pair_seed")  # fmt: skip
    configs = [
        dict(s["config"], selection=saved_selection(s["config"]), own_copies=bool(s["config"].get("own_copies")))
        for s in studies
    ]  # fmt: skip
    for other in configs[1:]:
        bad = [k for k in keys if other.get(k) != configs[0].get(k)]
        if bad:
            raise ValueError(f"studies with different settings ({', '.join(bad)}) cannot merge")
    merged: dict[str, Any] = {"config": json.loads(json.dumps(configs[0])), "tasks": {}}
    for study in studies:
        for name, task in study["tasks"].items():
            if name not in merged["tasks"]:
                merged["tasks"][name] = json.loads(json.dumps(task))
                continue
            have = merged["tasks"][name]
            if (have["pairs"], have.get("train_pairs")) != (task["pairs"], task.get("train_pairs")) or have["sizes"] != task["sizes"]:  # fmt: skip
                raise ValueError(f"task {name!r}: the studies used different pairs or sizes")
            for ablation, ref in task["reference"].items():
                have["reference"].setdefault(ablation, ref)
            for label, result in task["methods"].items():
                merge_method(have["methods"], label, result, name)
            if "truth" in task and "truth" not in have:
                have["truth"] = task["truth"]
    config = merged["config"]
    config["methods"] = {m: list(METHODS[m]) for m in METHODS if any(m in t["methods"] for t in merged["tasks"].values())}  # fmt: skip
    config["tasks"] = list(merged["tasks"])
    config["ablations"] = [a for a in ABLATIONS + ("zero",) if any(a in s["config"]["ablations"] for s in studies)]  # fmt: skip
    for task in merged["tasks"].values():
        task["methods"] = {m: task["methods"][m] for m in METHODS if m in task["methods"]}
        task["summary"] = summarise(task, config["fractions"], config["n_boot"])
    merged["runtime_seconds"] = sum(s.get("runtime_seconds", 0.0) for s in studies)
    merged["merged_from"] = len(studies)
    merged["goals"] = goals(merged)
    return merged


def _merge(paths: list[Path]) -> dict[str, Any]:
    """The saved studies at `paths` merged (`merge_saved`); damage deeper in the files than
    `load_saved` checks is a ValueError too."""
    studies = [load_saved(path) for path in paths]
    try:
        return merge_saved(studies)
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(
            f"the saved studies do not have the layout circuit_study --json writes "
            f"({type(error).__name__}: {error}): merge files it wrote"
        ) from None


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0] if __doc__ else None
    args = study_args.parser(tuple(METHODS), description).parse_args(argv)
    try:
        # Refuse outputs that cannot be written now, not after the first method has run.
        for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
            if path is not None:
                check_writable(path, flag)
        if args.merge is not None:
            study = _merge(args.merge)
            save_study(study, args.json, args.markdown)
            print(markdown(study))
            return 0
        base = QUICK_SETTINGS if args.quick else FULL_SETTINGS
        settings = study_args.settings(args, base, tuple(METHODS))
        model, model_name = study_args.study_model(args)

        def save(study: dict[str, Any]) -> None:
            save_study(study, args.json, args.markdown)

        study = circuit_study(
            model, model_name=model_name, progress=not args.no_progress, on_task=save, **settings
        )
        save(study)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"circuit_study: error: {error}", file=sys.stderr)
        return 2
    print(markdown(study))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
