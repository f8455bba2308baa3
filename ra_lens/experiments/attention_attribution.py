"""attention_attribution on a real model, against activation patching of every head.

For each task (IOI, country-capital; `ra_lens.tasks.ioi`), on the first `n_truth` pairs:

- ground truth: activation patching in a plain hook loop, direction "denoise": the corrupted run
  with one node taken from the clean run, metric logit_diff(answer, wrong). Per head, all
  positions at once: its queries (`hook_rot_q`/`hook_q`), the keys of each key/value head
  (`hook_rot_k`/`hook_k`), its whole pattern (`hook_pattern`). Per position, on a sample: the
  top heads of each kind, one position at a time, on the first `n_position_pairs` pairs.
  Patch jobs are stacked along the batch axis (several heads per forward pass);
- estimates: `attention_attribution(..., method="exact")` and `method="linear"`, summed over
  positions, and RA norms (`reversed_attention` of the same metric on the clean prompts);
- comparison per node kind: Pearson and Spearman correlation with the truth over all heads,
  top-20 recall (how many of the truth's 20 largest |effects| the estimate's top 20 holds), time.

    python -m ra_lens.experiments.attention_attribution --json docs/results/attribution.json

The head-level truth is most of the run (about 30 CPU minutes for both tasks on SmolLM2) and does
not depend on the estimates: `--truth-from FILE` takes it from an earlier run's JSON for a task
whose pairs are the same (checked on the first pair, their number and the clean and corrupted
metrics), and says so in the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture, timing
from ra_lens.attribution import AttentionAttribution, attention_attribution
from ra_lens.capture import Batch, HookedModel
from ra_lens.core import reversed_attention
from ra_lens.files import check_writable, load_json, write_file
from ra_lens.pairs import metric_rows
from ra_lens.ranking.node_patching import patching_effects
from ra_lens.ranking.statistics import pearson, spearman, top_recall
from ra_lens.record import Recorded
from ra_lens.tasks import ioi
from ra_lens.types import MetricFn

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KINDS: tuple[str, ...] = ("query", "key", "pattern")


def node_patching(
    model: HookedModel,
    clean: Batch,
    corrupted: Batch,
    metric: MetricFn,
    *,
    kinds: Sequence[str] = KINDS,
    max_rows: int = 64,
    progress: bool = True,
) -> dict[str, Float[Tensor, "layer head"]]:
    """The ground truth `attention_attribution`'s head scores estimate: for every head, patching
    its queries ("query"), its pattern ("pattern") or, per key/value head, its keys ("key") at
    all positions from clean into corrupted, M(patched) - M(corrupted), mean over pairs.

    Returns:
        kind -> Float[Tensor, "layer head"] (float64; "key": [layer, n_key_value_heads]).

    >>> from ra_lens import to_batch
    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = to_batch(model, ["I like Italy"]), to_batch(model, ["I like Paris"])
    >>> truth = node_patching(model, clean, corrupted, logit_diff([5], [7]), progress=False)
    >>> {kind: tuple(t.shape) for kind, t in truth.items()}
    {'query': (2, 4), 'key': (2, 4), 'pattern': (2, 4)}
    """
    shape = capture.model_shape(model)
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise ValueError(f"unknown node kind {unknown[0]!r}: choose from {KINDS}")
    width = {kind: shape.n_kv_heads if kind == "key" else shape.n_heads for kind in kinds}
    jobs: list[tuple[str, int, int, int | None]] = [
        (kind, layer, head, None)
        for kind in kinds
        for layer in range(shape.n_layers)
        for head in range(width[kind])
    ]
    effects = patching_effects(
        model, clean, corrupted, metric, jobs, max_rows=max_rows, progress=progress
    ).mean(1)
    out: dict[str, Tensor] = {}
    for kind in kinds:
        size = shape.n_layers * width[kind]
        out[kind], effects = effects[:size].reshape(shape.n_layers, width[kind]), effects[size:]
    return out


@dataclass
class TaskMeasurement(Recorded):
    """Everything measured on one task; `to_dict` is the JSON."""

    task: str
    n_pairs: int
    example: dict[str, str]
    metric_clean: float
    metric_corrupted: float
    truth: dict[str, Tensor]
    exact: dict[str, Tensor]
    linear: dict[str, Tensor]
    ra_norms: Tensor
    seconds: dict[str, float]
    n_forward_truth: int
    per_position: dict[str, dict[str, float]] = field(default_factory=dict)
    blind_spot: list[dict[str, Any]] = field(default_factory=list)
    exact_ig: dict[str, Tensor] = field(default_factory=dict)
    ig_steps: int = 0
    truth_reused: bool = False

    def stats(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        methods = [("exact", self.exact), ("linear", self.linear)]
        if self.exact_ig:
            methods.append(("exact_ig", self.exact_ig))
        for kind, truth in self.truth.items():
            out[kind] = {}
            for statistic, fn in (
                ("pearson", pearson), ("spearman", spearman), ("top20_recall", top_recall)
            ):  # fmt: skip
                for name, scores in methods:
                    out[kind][f"{statistic}_{name}"] = fn(scores[kind], truth)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "n_pairs": self.n_pairs,
            "example": self.example,
            "metric_clean": self.metric_clean,
            "metric_corrupted": self.metric_corrupted,
            "stats": self.stats(),
            "per_position": self.per_position,
            "seconds": self.seconds,
            # A reused truth was timed in another run: no ratio across runs.
            "speedup_exact": None
            if self.truth_reused
            else self.seconds["truth"] / self.seconds["exact"],
            "n_forward_truth": self.n_forward_truth,
            "truth_reused": self.truth_reused,
            "blind_spot": self.blind_spot,
            "scores": {
                name: {k: v.tolist() for k, v in table.items()}
                for name, table in (
                    ("truth", self.truth),
                    ("exact", self.exact),
                    ("linear", self.linear),
                    ("exact_ig", self.exact_ig),
                )
                if table
            },
            "ig_steps": self.ig_steps,
            "ra_norms": self.ra_norms.tolist(),
        }

    def table(self) -> str:
        """The README table's rows of this task (`markdown`)."""
        return markdown([self])

    def plot(self, save: str | Path | None = None) -> Figure:
        """Each estimate against the patching truth, one panel per node kind
        (`viz.estimate_scatter`); `save` also writes it."""
        from ra_lens.viz import estimate_scatter

        methods = {"exact": self.exact, "linear": self.linear, "exact-ig": self.exact_ig}
        return estimate_scatter(
            self.truth, {name: table for name, table in methods.items() if table}, save=save
        )


def measure(
    model: HookedModel,
    pairs: Sequence[ioi.PromptPair],
    task: str,
    *,
    n_position_pairs: int = 1,
    n_position_heads: int = 4,
    max_rows: int = 64,
    progress: bool = True,
    ig_steps: int = 5,
    stored: dict[str, Any] | None = None,
) -> TaskMeasurement:
    """Truth, estimates, their agreement and timings on `pairs` (see the module docstring).

    `stored`: an earlier `to_dict()` of this task; its head-level truth (and the seconds it took)
    is used instead of patching again, after checking that it was measured on the same pairs.

    On the real model (`python -m ra_lens.experiments.attention_attribution` runs both tasks):

    >>> pairs = ioi.usable(model, ioi.ioi_pairs(40))[:6]  # doctest: +SKIP
    >>> print(markdown([measure(model, pairs, "ioi")]))  # minutes  # doctest: +SKIP
    """
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    seconds: dict[str, float] = {}

    with timing.timed(seconds, "exact"):
        exact = attention_attribution(model, clean, corrupted, metric)
    with timing.timed(seconds, "linear"):
        linear = attention_attribution(model, clean, corrupted, metric, method="linear")
    with timing.timed(seconds, "exact_ig"):
        exact_ig = attention_attribution(
            model, clean, corrupted, metric, method="exact-ig", steps=ig_steps
        )
    with timing.timed(seconds, "ra_norms"):
        ra = reversed_attention(model, clean, metric, keep="norms")
    if stored is None:
        with timing.timed(seconds, "truth"):
            truth = node_patching(
                model, clean, corrupted, metric, max_rows=max_rows, progress=progress
            )
    else:
        truth, seconds["truth"] = _stored_truth(stored, pairs, exact)
    result = TaskMeasurement(
        task=task,
        n_pairs=len(pairs),
        example={
            "clean": pairs[0].clean,
            "corrupted": pairs[0].corrupted,
            "answer": pairs[0].answer,
            "wrong": pairs[0].wrong,
        },  # fmt: skip
        metric_clean=float(exact.clean_metric.mean()),
        metric_corrupted=float(exact.corrupted_metric.mean()),
        truth={k: v.float() for k, v in truth.items()},
        exact={k: exact.scores[k] for k in KINDS},
        linear={k: linear.scores[k] for k in KINDS},
        exact_ig={k: exact_ig.scores[k] for k in KINDS},
        ig_steps=ig_steps,
        ra_norms=ra.head_norms(),
        seconds=seconds,
        n_forward_truth=-(-sum(t.numel() for t in truth.values()) // max(1, max_rows // len(pairs)))
        + 2,
        truth_reused=stored is not None,
    )
    result.per_position = _per_position(
        model, clean, corrupted, metric, exact, linear, truth,
        n_position_pairs, n_position_heads, max_rows, progress,
    )  # fmt: skip
    result.blind_spot = _blind_spot(exact, truth, result.ra_norms, clean, model)
    return result


def _stored_truth(
    stored: Any, pairs: Sequence[ioi.PromptPair], exact: AttentionAttribution
) -> tuple[dict[str, Tensor], float]:
    """The head-level truth of an earlier run and the seconds it took, if it was measured on these
    pairs; an entry from other pairs, or a damaged one (`stored` is whatever the JSON file held),
    is refused naming the task and the fix."""
    first = pairs[0]
    example = {"clean": first.clean, "corrupted": first.corrupted, "answer": first.answer,
               "wrong": first.wrong}  # fmt: skip
    metrics = (float(exact.clean_metric.mean()), float(exact.corrupted_metric.mean()))
    task = stored.get("task") if isinstance(stored, dict) else None
    rerun = "run without --truth-from to measure it again"
    try:
        same = (
            stored.get("n_pairs") == len(pairs)
            and stored.get("example") == example
            and all(
                abs(now - float(stored[key])) <= 1e-4 * max(1.0, abs(now))
                for now, key in zip(metrics, ("metric_clean", "metric_corrupted"), strict=True)
            )
        )
        if same:
            truth = {kind: torch.tensor(stored["scores"]["truth"][kind]) for kind in KINDS}
            for kind, value in truth.items():
                if value.shape != exact.scores[kind].shape or not value.is_floating_point():
                    raise ValueError(
                        f"its {kind} truth has shape {tuple(value.shape)}, the model's heads "
                        f"{tuple(exact.scores[kind].shape)}"
                    )
            spent = float(stored["seconds"]["truth"])
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        what = f"{type(error).__name__}: {error}"
        raise ValueError(
            f"the stored truth of task {task!r} is damaged ({what}): {rerun}"
        ) from None
    if not same:
        raise ValueError(
            f"the stored truth of task {task!r} was measured on other pairs (or another model): "
            + rerun
        )
    return truth, spent


def _per_position(
    model: HookedModel,
    clean: Batch,
    corrupted: Batch,
    metric: MetricFn,
    exact: AttentionAttribution,
    linear: AttentionAttribution,
    truth: dict[str, Tensor],
    n_pairs: int,
    n_heads: int,
    max_rows: int,
    progress: bool,
) -> dict[str, dict[str, float]]:
    """Per-position truth for the top heads of each kind on the first pairs, against the
    per-position estimates."""
    n = clean.tokens.shape[0]
    rows = slice(0, min(n_pairs, n))
    clean_s, corrupted_s = clean.rows(rows), corrupted.rows(rows)
    sub_metric = metric_rows(metric, rows, n)
    jobs, where = [], []
    for kind in KINDS:
        order = truth[kind].flatten().abs().argsort(descending=True)[:n_heads].tolist()
        width = truth[kind].shape[1]
        for flat in order:
            layer, head = flat // width, flat % width
            for position in range(int(clean_s.lengths.max())):
                jobs.append((kind, layer, head, position))
                where.append((kind, layer, head, position))
    effects = patching_effects(
        model, clean_s, corrupted_s, sub_metric, jobs, max_rows=max_rows, progress=progress
    )
    out = {}
    for kind in KINDS:
        idx = [i for i, w in enumerate(where) if w[0] == kind]
        true = effects[idx].flatten()
        est = torch.stack(
            [exact.by_position[kind][rows, where[i][1], where[i][2], where[i][3]] for i in idx]
        ).flatten()
        lin = torch.stack(
            [linear.by_position[kind][rows, where[i][1], where[i][2], where[i][3]] for i in idx]
        ).flatten()
        out[kind] = {
            "n_nodes": len(true),
            "pearson_exact": pearson(est, true),
            "pearson_linear": pearson(lin, true),
            "max_abs_error_exact": float((est.double() - true).abs().max()),
            "max_abs_error_linear": float((lin.double() - true).abs().max()),
        }
    return out


def _blind_spot(
    exact: AttentionAttribution,
    truth: dict[str, Tensor],
    ra_norms: Tensor,
    clean: Batch,
    model: HookedModel,
    k: int = 20,
) -> list[dict[str, Any]]:
    """Heads among the truth's and the exact estimate's top k (query nodes, and key nodes mapped
    to the query heads reading them) that the RA-norm ranking's top k misses, with the attention
    row at the last position of the first pair's corrupted prompt (the run the estimate patches
    and differentiates)."""
    group = exact.n_heads // exact.n_kv_heads
    ra_top = set(ra_norms.flatten().argsort(descending=True)[:k].tolist())
    n_heads = exact.n_heads
    found = []
    for kind in ("query", "key"):
        width = exact.scores[kind].shape[1]
        est_top = set(exact.scores[kind].flatten().abs().argsort(descending=True)[:k].tolist())
        true_top = set(truth[kind].flatten().abs().argsort(descending=True)[:k].tolist())
        for flat in sorted(est_top & true_top):
            layer, head = flat // width, flat % width
            heads = [head] if kind == "query" else list(range(head * group, (head + 1) * group))
            if any(layer * n_heads + h in ra_top for h in heads):
                continue
            last = int(clean.lengths[0]) - 1
            rows = []
            for h in heads:
                row = exact.patterns[0, layer, h, last, : last + 1]
                weights, where = row.topk(min(3, row.numel()))
                tokens = exact.str_tokens[0] if exact.str_tokens else None
                rows.append({
                    "head": h,
                    "row_max": float(row.max()),
                    "ra_norm_rank": int((ra_norms.flatten() > ra_norms[layer, h]).sum()) + 1,
                    "top_keys": [
                        {"token": tokens[int(s)] if tokens else int(s), "position": int(s),
                         "weight": float(w)}
                        for w, s in zip(weights, where)
                    ],
                })  # fmt: skip
            found.append({
                "kind": kind, "layer": layer, "head": head,
                "exact": float(exact.scores[kind][layer, head]),
                "truth": float(truth[kind][layer, head]),
                "rows_at_last_position": rows,
            })  # fmt: skip
    return found


def markdown(results: Sequence[TaskMeasurement]) -> str:
    """The README table."""
    lines = [
        "| task | node | Pearson exact | Pearson linear | Pearson exact-ig | Spearman exact "
        "| Spearman linear | top-20 recall exact | top-20 recall linear |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for kind, s in r.stats().items():
            ig = f"{s['pearson_exact_ig']:.3f}" if "pearson_exact_ig" in s else "-"
            lines.append(
                f"| {r.task} | {kind} | {s['pearson_exact']:.3f} | {s['pearson_linear']:.3f} | "
                f"{ig} | {s['spearman_exact']:.3f} | {s['spearman_linear']:.3f} | "
                f"{s['top20_recall_exact']:.0%} | {s['top20_recall_linear']:.0%} |"
            )
    return "\n".join(lines)


#: The tasks of `main`, each a builder of its usable pairs for a model.
TASK_PAIRS: dict[str, Any] = {
    "ioi": lambda model: ioi.usable(model, ioi.ioi_pairs(40)),
    "country-capital": lambda model: ioi.usable(model, ioi.capital_pairs(model)),
}
_SAVED = "a results file (a file attention_attribution --json wrote)"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status: 0, or 2 after one line `attention_attribution:
    error: ...` on stderr for a bad flag or file (checked before the model loads)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-truth", type=int, default=6, help="pairs per task for the truth")
    parser.add_argument("--json", default="docs/results/attribution.json")
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--ig-steps", type=int, default=5, help="points of exact-ig's path (5)")
    parser.add_argument(
        "--truth-from", type=Path, default=None, metavar="FILE",
        help="reuse the head-level truth of an earlier run's JSON (same pairs, checked)",
    )  # fmt: skip
    parser.add_argument(
        "--tasks", default="ioi,country-capital",
        help="comma-separated; other tasks already in --json are kept",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        names, summary, earlier = _checked(args)
        from ra_lens.models import load_model

        model = load_model(device="cpu")
        summary.setdefault("n_usable_pairs", {})
        results = []
        for name in names:
            pairs = TASK_PAIRS[name](model)
            summary["n_usable_pairs"][name] = len(pairs)
            result = measure(
                model, pairs[: args.n_truth], name, max_rows=args.max_rows,
                ig_steps=args.ig_steps, stored=earlier.get(name),
            )  # fmt: skip
            results.append(result)
            summary[name] = result.to_dict()
            write_file(args.json, json.dumps(summary, indent=1), make_folders=True)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"attention_attribution: error: {error}", file=sys.stderr)
        return 2
    print(markdown(results))
    for r in results:
        reused = " (truth and its seconds from --truth-from)" if r.truth_reused else ""
        print(r.task, {k: round(v, 2) for k, v in r.seconds.items()}, r.per_position, reused)
    return 0


def _checked(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The flags checked before the model loads (minutes): (the tasks, the results already in
    --json, the --truth-from results)."""
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASK_PAIRS]
    if unknown or not names:
        given = repr(unknown[0]) if unknown else "(none)"
        raise ValueError(f"unknown task {given}: choose from {', '.join(TASK_PAIRS)}")
    counts = {"--n-truth": args.n_truth, "--max-rows": args.max_rows, "--ig-steps": args.ig_steps}
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    check_writable(args.json, "--json")
    summary = load_json(args.json, _SAVED) if Path(args.json).is_file() else {}
    if not isinstance(summary, dict):
        raise ValueError(f"--json {args.json} is not {_SAVED}: it holds no JSON object")
    earlier = {} if args.truth_from is None else load_json(args.truth_from, _SAVED)
    if not isinstance(earlier, dict):
        raise ValueError(f"--truth-from {args.truth_from} is not {_SAVED}: it holds no JSON object")
    return names, summary, earlier


if __name__ == "__main__":
    raise SystemExit(main())
