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
(its outgoing edges summed), Pearson r. The statistics, goals and tables are computed in
`circuit_study_report`; this module builds the pairs, runs the methods and saves the metrics.

    python -m ra_lens.experiments.circuit_study --quick                      # tiny model, seconds
    python -m ra_lens.experiments.circuit_study --json docs/results/circuit_study.json \\
        --markdown docs/results/circuit_study.md
    python -m ra_lens.experiments.circuit_study --merge a.json b.json --json all.json  # parts
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture, circuits, timing
from ra_lens.circuits.faithfulness import BASELINE
from ra_lens.circuits.mib import MIB_FRACTIONS

# The statistics live in circuit_study_report; fraction_columns, paired_difference re-exported.
from ra_lens.experiments.circuit_study_report import fraction_columns as fraction_columns
from ra_lens.experiments.circuit_study_report import goals, markdown, summarise
from ra_lens.experiments.circuit_study_report import paired_difference as paired_difference
from ra_lens.files import check_writable, load_json, write_file
from ra_lens.progress import tqdm
from ra_lens.ranking.node_patching import Job, patching_effects
from ra_lens.ranking.statistics import pearson
from ra_lens.tasks import format_prompt, ioi, load
from ra_lens.tasks.ioi import PromptPair
from ra_lens.types import HookedModel

if TYPE_CHECKING:
    from ra_lens.circuits.faithfulness import Ablation

_MethodName = Literal["eap", "eap-ig", "exact", "exact-ig", "random", "ensemble", "mask"]

#: method label -> (circuits.attribute's method, IG steps, direction); "random" draws uniform
#: scores. "-noise": the gradient on the clean run (EAP-IG's own choice), scores in MIB's sign.
#: label -> (attribute's method, or "random" / "ensemble"; IG steps; direction)
METHODS: dict[str, tuple[_MethodName, int, Literal["denoise", "noise"]]] = {
    "eap": ("eap", 1, "denoise"),
    "eap-noise": ("eap", 1, "noise"),
    "eap-ig-5": ("eap-ig", 5, "denoise"),
    "eap-ig-5-noise": ("eap-ig", 5, "noise"),
    "eap-ig-20": ("eap-ig", 20, "denoise"),
    "exact": ("exact", 1, "denoise"),
    "exact-ig-5": ("exact-ig", 5, "denoise"),
    "exact-ig-5-noise": ("exact-ig", 5, "noise"),
    "random": ("random", 1, "denoise"),
    "ens-ig": ("ensemble", 5, "denoise"),
    "ens-eap-ig-exact": ("ensemble", 5, "denoise"),
    # circuits.learn_mask warm-started from eap-ig (5 steps), default budget; its objective
    # "metric", or "faithful" for the label ending so
    "mask": ("mask", 5, "denoise"),
    "mask-faithful": ("mask", 5, "denoise"),
}
#: The label of `circuits.attribute`'s default (eap-ig, 5 steps, denoise): the goals are its.
DEFAULT_METHOD = "eap-ig-5"
#: ensemble label -> the methods it averages (`circuits.ensemble`: normalised, in MIB's sign);
#: their scores are computed once per task, and the ensemble's seconds are the sum of theirs.
ENSEMBLES: dict[str, tuple[str, ...]] = {
    "ens-ig": ("eap-ig-5", "eap-ig-5-noise"),
    "ens-eap-ig-exact": ("eap", "eap-ig-5", "exact"),
}
TASKS: tuple[str, ...] = ("ioi", "country-capital", "antonym")
ABLATIONS: tuple[str, ...] = ("patching", "mean")
#: Edge counts reported beside the fractions, to compare with EAP-IG's own numbers (issue 22).
EDGE_COUNTS: tuple[int, ...] = (100, 500, 2000)
#: What `merge_saved` reads of a saved study's config and of each of its tasks.
SAVED_CONFIG_KEYS: tuple[str, ...] = ("ablations", "fractions", "n_boot")
SAVED_TASK_KEYS: tuple[str, ...] = ("n_pairs", "pairs", "sizes", "edge_counts", "reference", "methods")  # fmt: skip
#: Antonym pairs: one fixed 3-shot context, the query swapped between clean and corrupted.
ANTONYM_SHOTS = 3

# --quick: a tiny random model and pairs its tokenizer writes with one-token words; its graph
# (about 300 edges) is small, so the fractions are coarse and the edge counts small.
QUICK_WORDS = ("b", "c", "d", "l", "o", "s", "t", "F", "I")
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
# tasks


def antonym_pairs(model: HookedModel, n: int, *, seed: int = 0) -> list[PromptPair]:
    """Antonym prompts with one fixed 3-shot context; the corrupted prompt asks about another word
    whose prompt has the same token length, and whose (one-token) antonym is the wrong answer."""
    rows = list(cast("tuple[tuple[str, str], ...]", load("antonym").pairs))  # a Task's pairs
    random.Random(seed).shuffle(rows)
    demos, rest = rows[:ANTONYM_SHOTS], rows[ANTONYM_SHOTS:]

    def one_token(text: str) -> bool:
        return model.to_tokens(text, prepend_bos=False).shape[1] == 1

    by_length: dict[int, list[tuple[str, str]]] = {}
    for x, y in rest:
        if one_token(f" {y}"):
            length = int(model.to_tokens(format_prompt(demos, x)).shape[1])
            by_length.setdefault(length, []).append((x, y))
    pairs = []
    for group in by_length.values():
        for (x, y), (x2, y2) in zip(group, group[1:] + group[:1]):
            if y != y2 and x != x2:
                clean, corrupted = format_prompt(demos, x), format_prompt(demos, x2)
                pairs.append(PromptPair(clean, corrupted, f" {y}", f" {y2}", task="antonym"))
    return pairs[:n]


def toy_pairs(model: HookedModel, n: int) -> list[PromptPair]:
    """--quick's pairs for the tiny tokenizer: "I like {x} and" against another word."""
    pairs = [
        PromptPair(f"I like {x} and", f"I like {y} and", " the", " of", task="toy")
        for x, y in zip(QUICK_WORDS, QUICK_WORDS[1:] + QUICK_WORDS[:1])
    ]
    return ioi.usable(model, pairs)[:n]


def task_pairs(model: HookedModel, task: str, n: int) -> list[PromptPair]:
    """Up to n usable pairs of a task (fewer where the tokenizer leaves fewer)."""
    if task == "ioi":
        return ioi.usable(model, ioi.ioi_pairs(4 * n))[:n]
    if task == "country-capital":
        return ioi.capital_pairs(model, n)
    if task == "antonym":
        return antonym_pairs(model, n)
    if task == "toy":
        return toy_pairs(model, n)
    raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")


# --------------------------------------------------------------------------------------------
# running


def random_scores(graph: circuits.Graph, seed: int = 0) -> circuits.EdgeScores:
    """Uniform random scores on the graph's edges (the floor every method must beat)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(graph.real.shape, generator=generator, dtype=torch.float64)
    return circuits.EdgeScores(graph, scores * graph.real, method="random", direction="denoise")


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
    """
    clean, corrupted, metric = ioi.paired_batch(model, list(pairs))
    scored_on = list(train) or list(pairs)
    train_clean, train_corrupted, train_metric = ioi.paired_batch(model, scored_on)
    graph = circuits.Graph.from_model(model)
    sizes = edge_sizes(graph.n_edges_ungrouped, fractions, edge_counts)  # MIB's units
    measured: dict[tuple[bytes, str], list[float]] = {}  # a circuit two methods share runs once
    evaluators: dict[str, circuits.FaithfulnessEvaluator] = {}

    def measure(circuit: circuits.Circuit, ablation: str) -> list[float]:
        key = (circuit.edges.numpy().tobytes(), ablation)
        if key not in measured:
            if ablation not in evaluators:
                evaluators[ablation] = circuits.FaithfulnessEvaluator(
                    model, clean, corrupted, metric, batch_size=batch_size,
                    ablation=cast("Ablation", ablation),  # the evaluator checks it
                )  # fmt: skip
            result = evaluators[ablation](circuit)
            measured[key] = result.circuit_per_pair.tolist()
            if circuit.n_edges == 0:
                reference[ablation] = {
                    "clean": result.clean_per_pair.tolist(),
                    "corrupted": result.corrupted_per_pair.tolist(),
                    "empty": measured[key],
                }
        return measured[key]

    reference: dict[str, dict[str, list[float]]] = {}
    start = timing.now()
    for ablation in ablations:
        measure(circuits.Circuit.empty(graph), ablation)
    out: dict[str, Any] = {
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
    truth = None
    if truth_pairs > 0:
        spans: dict[str, float] = {}
        with timing.timed(spans, "truth"):
            truth = head_patching(model, pairs[:truth_pairs])
        out["truth"] = {
            "pairs": min(truth_pairs, len(pairs)),
            "heads": truth.tolist(),
            "seconds": spans["truth"],
            "pearson": {},
        }
    scored: dict[str, tuple[circuits.EdgeScores, dict[str, float]]] = {}

    def score(label: str) -> tuple[circuits.EdgeScores, dict[str, float]]:
        """A method's scores on the training pairs and their seconds (wall, CPU), once."""
        if label in scored:
            return scored[label]
        method, steps, direction = METHODS[label]
        spent: dict[str, float] = {}
        result: circuits.EdgeScores
        if method == "ensemble":
            parts = [score(part) for part in ENSEMBLES[label]]
            result = circuits.ensemble([part for part, _ in parts])
            for key in ("attribute", "attribute_cpu"):
                spent[key] = sum(times[key] for _, times in parts)
        else:
            with (
                timing.timed(spent, "attribute"),
                timing.timed(spent, "attribute_cpu", clock=time.process_time),
            ):
                if method == "random":
                    result = random_scores(graph)
                elif method == "mask":
                    result = circuits.learn_mask(
                        model, train_clean, train_corrupted, train_metric, ig_steps=steps,
                        batch_size=batch_size,
                        objective="faithful" if label.endswith("faithful") else "metric",
                    ).scores  # fmt: skip
                else:
                    result = circuits.attribute(
                        model, train_clean, train_corrupted, train_metric, method=method,
                        steps=steps, direction=direction, batch_size=batch_size,
                    )  # fmt: skip
        scored[label] = (result, spent)
        return scored[label]

    for label in tqdm(methods, desc="methods", disable=not progress):
        method, steps, direction = METHODS[label]
        scores, times = score(label)
        spent = dict(times)
        if truth is not None and method not in ("ensemble", "mask"):
            subset = scores
            if truth_pairs < len(pairs) and method != "random":
                sub_clean, sub_corrupted, sub_metric = ioi.paired_batch(model, pairs[:truth_pairs])
                subset = circuits.attribute(
                    model, sub_clean, sub_corrupted, sub_metric, method=method, steps=steps,
                    direction=direction, batch_size=batch_size,
                )  # fmt: skip
            heads = head_node_scores(subset)
            out["truth"]["pearson"][label] = pearson(heads, truth)
            out["truth"].setdefault("head_scores", {})[label] = heads.tolist()
        pick = scores.top if selection == "top" else scores.greedy
        by_abs = [pick(n, absolute=True, units="ungrouped") for n in sizes]
        signed = [pick(n, absolute=False, units="ungrouped") for n in sizes]
        with timing.timed(spent, "eval"):
            out["methods"][label] = {
                "seconds": spent["attribute"],
                "cpu_seconds": spent["attribute_cpu"],
                "n_edges": [c.n_edges_ungrouped for c in by_abs],
                "circuit": {a: [measure(c, a) for c in by_abs] for a in ablations},
                "signed_n_edges": [c.n_edges_ungrouped for c in signed],
                "signed_circuit": {a: [measure(c, a) for c in signed] for a in ablations},
            }
        out["methods"][label]["eval_seconds"] = spent["eval"]
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
) -> dict[str, Any]:
    """Run every task; `on_task(study)` after each method of each task (to save partial
    results). Each task's first `train_pairs` pairs are scored and the next `n_pairs` (held out)
    measured, as MIB attributes on its train split and evaluates on another; a task with fewer
    pairs keeps n_pairs held out and trains on what is left (at least 4), train_pairs=0 scores
    the measured pairs themselves. Head activation patching (ground truth for head scores) on the first
    `truth_pairs` pairs of the tasks in `truth_tasks`."""
    study: dict[str, Any] = {
        "config": {
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
            "units": "ungrouped",
            "faithfulness_baseline": BASELINE,
            "cpr_from": "signed ranking (largest score)",
            "cmd_from": "|score| ranking",
            "direction": "per method (METHODS)",
            "default_method": DEFAULT_METHOD,
            "truth_tasks": list(truth_tasks),
            "truth_pairs": truth_pairs,
        },
        "tasks": {},
    }
    start = timing.now()
    for name in tasks:
        every = task_pairs(model, name, train_pairs + n_pairs)
        if not every:
            raise ValueError(f"task {name!r} has no usable pairs for this model's tokenizer")
        n_train = min(train_pairs, len(every) - n_pairs)
        if train_pairs and n_train < min(train_pairs, 4):
            raise ValueError(
                f"task {name!r} has {len(every)} usable pairs: too few for {n_pairs} held-out "
                f"pairs and at least {min(train_pairs, 4)} to score on; lower --n-pairs"
            )
        train, pairs = every[:n_train], every[n_train:]

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
            )
        )
    study["runtime_seconds"] = timing.now() - start
    study["goals"] = goals(study)
    return study


def merge_saved(studies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Studies that ran side by side (other methods, tasks or ablations, same settings) as one: a
    task in several must have the same pairs and sizes; its methods (and a method's ablations)
    are pooled, summaries and goals recomputed from the per-pair metrics. Runtime: the sum of the
    parts' (they may have run one after another)."""
    if not studies:
        raise ValueError("merge needs at least one saved study")
    keys = ("model", "n_pairs", "train_pairs", "batch_size", "n_boot", "fractions", "edge_counts", "selection")  # fmt: skip
    configs = [dict(s["config"], selection=_selection(s["config"])) for s in studies]
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
                _merge_method(have["methods"], label, result, name)
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


def _selection(config: dict[str, Any]) -> str:
    """ "top" or "greedy"; files written before `--selection` existed say "top (by |score|), ..."."""
    return "greedy" if config.get("selection") == "greedy" else "top"


def _merge_method(have: dict[str, Any], label: str, result: dict[str, Any], task: str) -> None:
    """Pool one method's results into `have`: a method measured under other ablations in another
    part adds those ablations (its circuits must be the same; the attribution seconds stay the
    first part's)."""
    if label not in have:
        have[label] = json.loads(json.dumps(result))
        return
    if have[label]["n_edges"] != result["n_edges"] or have[label].get(
        "signed_n_edges"
    ) != result.get("signed_n_edges"):
        raise ValueError(f"task {task!r}, method {label!r}: the parts chose different circuits")
    for key in ("circuit", "signed_circuit"):
        for ablation, values in result.get(key, {}).items():
            have[label].setdefault(key, {}).setdefault(ablation, values)


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed)}")  # fmt: skip
    return names


def _save(study: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    if json_path is not None:
        write_file(json_path, json.dumps(study, indent=1), make_folders=True)
    if markdown_path is not None:
        write_file(markdown_path, markdown(study) + "\n", make_folders=True)


def _load_saved(path: Path) -> dict[str, Any]:
    """A study `--json` wrote, or a ValueError naming the file and what is wrong with it."""
    what = "a saved study (a file circuit_study --json wrote)"
    data = load_json(path, what)
    if not (
        isinstance(data, dict)
        and isinstance(data.get("config"), dict)
        and isinstance(data.get("tasks"), dict)
    ):
        raise ValueError(f"{path} is not {what}: it has no objects 'config' and 'tasks'")
    lacking = [key for key in SAVED_CONFIG_KEYS if key not in data["config"]]
    if lacking:
        raise ValueError(f"{path} is not {what}: its config lacks {', '.join(lacking)}")
    for name, task in data["tasks"].items():
        if not isinstance(task, dict):
            raise ValueError(f"{path} is not {what}: task {name!r} is not an object")
        lacking = [key for key in SAVED_TASK_KEYS if key not in task]
        if lacking:
            raise ValueError(f"{path} is not {what}: task {name!r} lacks {', '.join(lacking)}")
    return data


def _merge(paths: list[Path]) -> dict[str, Any]:
    """The saved studies at `paths` merged (`merge_saved`); damage deeper in the files than
    `_load_saved` checks is a ValueError too."""
    studies = [_load_saved(path) for path in paths]
    try:
        return merge_saved(studies)
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(
            f"the saved studies do not have the layout circuit_study --json writes "
            f"({type(error).__name__}: {error}): merge files it wrote"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="circuit_study", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and toy pairs: seconds")
    parser.add_argument("--model", default="smollm2-135m", help="model for load_model")
    parser.add_argument("--tasks", default=None, help=f"comma-separated ({','.join(TASKS)})")
    parser.add_argument("--n-pairs", type=int, default=None, help="held-out pairs per task (32)")
    parser.add_argument(
        "--train-pairs", type=int, default=None,
        help="pairs per task to score on, before the held-out ones (16; 0: score the held-out)",
    )  # fmt: skip
    parser.add_argument("--methods", default=None, help=f"comma-separated ({','.join(METHODS)})")
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    settings = dict(QUICK_SETTINGS if args.quick else FULL_SETTINGS)
    try:
        # Refuse outputs that cannot be written now, not after the first method has run.
        for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
            if path is not None:
                check_writable(path, flag)
        if args.merge is not None:
            study = _merge(args.merge)
            _save(study, args.json, args.markdown)
            print(markdown(study))
            return 0
        # explicit flags win over --quick
        if args.tasks is not None:
            settings["tasks"] = _names(args.tasks, (*TASKS, "toy"), "task")
        if args.methods is not None:
            settings["methods"] = _names(args.methods, tuple(METHODS), "method")
        if args.ablations is not None:
            settings["ablations"] = _names(args.ablations, ("patching", "mean", "zero"), "ablation")  # fmt: skip
        if args.truth_tasks is not None:
            settings["truth_tasks"] = (
                _names(args.truth_tasks, (*TASKS, "toy"), "task") if args.truth_tasks else []
            )
        if args.selection is not None:
            settings["selection"] = args.selection
        for flag in ("n_pairs", "batch_size", "n_boot", "truth_pairs", "train_pairs"):
            value = getattr(args, flag)
            if value is not None:
                if value < (0 if flag == "train_pairs" else 1):
                    least = 0 if flag == "train_pairs" else 1
                    raise ValueError(
                        f"--{flag.replace('_', '-')} must be at least {least}, got {value}"
                    )
                settings[flag] = value
        if args.quick:
            from ra_lens.models import bridge_available
            from ra_lens.toy_models import tiny_model

            arch: Literal["llama", "hooked"] = "llama" if bridge_available() else "hooked"
            model = tiny_model(arch, n_layers=2)
            model_name = f"tiny-{arch} (random weights)"
        else:
            from ra_lens.models import load_model

            model, model_name = load_model(args.model), args.model

        def save(study: dict[str, Any]) -> None:
            _save(study, args.json, args.markdown)

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
