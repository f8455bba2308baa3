"""The paper's head-ranking experiment (section 4b) on an ICL task: rank heads by RA and by the
baselines, then keep only the top (or bottom) p% of heads, ablate the rest (zero, or Todd et al.'s
mean aligned at the last token), and measure held-out accuracy, with bootstrap intervals.

Rankings live in a registry, `RANKINGS` (name -> `RankingSpec`, in `ranking_registry`): RA
norm, its loss row, RA's inverse-temperature score, forward-pattern norm, random, layer index,
causal mediation, its first-order estimate, Todd et al.'s indirect effect, activation patching
with TransformerLens and attribution patching.

    >>> from ra_lens.experiments import head_ranking
    >>> result = head_ranking(model, "antonym", shots=5, n_prompts=25)     # doctest: +SKIP
    >>> print(result.table())                                              # doctest: +SKIP
    >>> result.save("ranking.json"); result.plots("figures/")          # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count

# The registry lives in ranking_registry; its names stay importable from here.
from ra_lens.experiments.ranking_registry import PAIRED as PAIRED
from ra_lens.experiments.ranking_registry import RANKINGS as RANKINGS
from ra_lens.experiments.ranking_registry import Inputs as Inputs
from ra_lens.experiments.ranking_registry import RankingInputs as RankingInputs
from ra_lens.experiments.ranking_registry import RankingSpec as RankingSpec
from ra_lens.experiments.ranking_registry import check_rankings as check_rankings
from ra_lens.experiments.ranking_registry import register as register
from ra_lens.patching import last_token_means
from ra_lens.progress import tqdm
from ra_lens.ranking import AblationCurve, Interval
from ra_lens.record import Recorded
from ra_lens.tasks import Accuracy, Prompt, Task, shuffled_label_prompts, task_prompts
from ra_lens.timing import timed
from ra_lens.types import Scores


@dataclass
class HeadRankingResult(Recorded):
    """Rankings, ablation curves, agreement with RA and the time each ranking took.

    Attributes:
        scores: ranking name -> Float[Tensor, "layer head"] (larger = more important).
        curves: name -> AblationCurve keeping the top fraction of heads (the rest zeroed).
        reverse_curves: name -> AblationCurve keeping the bottom fraction.
        seconds: name -> wall-clock seconds to compute that ranking ("ablation_curves" too).
        spearman, top10_overlap: name -> agreement of RA's ranking with that ranking.
        unablated: accuracy of the test prompts with no head ablated.
        n_prompts: prompts the rankings were computed on; n_patching: those of them that have a
            corrupted twin of the same token length (activation and attribution patching).
        n_test: test prompts every accuracy (and every bootstrap) is over.
        ablation: "zero" or "mean" (Todd et al.'s mean over held-out prompts, aligned at the last
            token); n_means: the held-out prompts that mean was taken over.
        intervals: name -> {"auc", "auc_top3", "reverse_auc", "paired_vs_ra", "spearman"}:
            `ranking.Interval`s (95% percentile bootstrap over test prompts for AUCs, paired for
            the difference AUC(RA) - AUC(name), over ranking prompts for Spearman with RA).

    >>> from ra_lens.tasks import Task
    >>> toy = Task("toy", [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"),
    ...                    ("s", "the"), ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")])
    >>> result = head_ranking(model, toy, shots=1, n_prompts=4, rankings=["random"],
    ...                       fractions=[0, 1], n_boot=20, progress=False)
    >>> data = result.to_dict()
    >>> data["rankings"]["random"]["auc"] == result.curves["random"].auc, list(data["spearman"])
    (True, ['random'])
    >>> print(result.table())  # doctest: +ELLIPSIS
    toy, 1-shot, 2x4 heads: rankings from 4 prompts (...), accuracy on 2 test prompts, ...
    """

    task: str
    shots: int
    n_prompts: int
    n_test: int
    n_patching: int
    fractions: list[float]
    scores: dict[str, Scores]
    curves: dict[str, AblationCurve]
    reverse_curves: dict[str, AblationCurve]
    seconds: dict[str, float]
    spearman: dict[str, float]
    top10_overlap: dict[str, float]
    unablated: Accuracy
    n_layers: int
    n_heads: int
    ablation: str = "zero"
    notes: list[str] = field(default_factory=list)
    intervals: dict[str, dict[str, Interval]] = field(default_factory=dict)
    n_means: int = 0
    per_prompt: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def speedup(self, baseline: str = "causal_mediation", reference: str = "ra") -> float:
        """seconds[baseline] / seconds[reference]: how many times faster `reference` ran."""
        return self.seconds[baseline] / max(self.seconds[reference], 1e-12)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: {"rankings": {name: {"auc", "curve", "auc_top3", "curve_top3",
        "reverse_auc", "reverse_curve", ..., "seconds", "scores"}}, "spearman", "top10_overlap",
        ...}. "auc"/"curve" are top-1; "curve" values are aligned with "fractions"."""
        rankings = {}
        for name, scores in self.scores.items():
            fwd, rev = self.curves[name], self.reverse_curves[name]
            rankings[name] = {
                "auc": fwd.auc,
                "curve": fwd.top1,
                "auc_top3": fwd.auc_top3,
                "curve_top3": fwd.top3,
                "reverse_auc": rev.auc,
                "reverse_curve": rev.top1,
                "reverse_auc_top3": rev.auc_top3,
                "reverse_curve_top3": rev.top3,
                "n_kept": fwd.n_kept,
                "seconds": self.seconds.get(name),
                "scores": scores.tolist(),
                "intervals": {k: v.to_dict() for k, v in self.intervals.get(name, {}).items()},
            }
        speedups = {
            name: self.speedup(name)
            for name in self.scores
            if name != "ra" and name in self.seconds and "ra" in self.seconds
        }
        return {
            "task": self.task,
            "shots": self.shots,
            "n_prompts": self.n_prompts,
            "n_test": self.n_test,
            "n_patching": self.n_patching,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "fractions": list(self.fractions),
            "ablation": self.ablation,
            "n_means": self.n_means,
            "unablated": self.unablated.to_dict(),
            "rankings": rankings,
            "spearman": {n: _json_float(v) for n, v in self.spearman.items()},
            "top10_overlap": dict(self.top10_overlap),
            "seconds_ratio_to_ra": speedups,
            "seconds": dict(self.seconds),
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """One row per ranking: ablation AUCs with 95% bootstrap intervals (top-1 keeping the top
        heads, top-3, top-1 keeping the bottom heads), AUC(RA) - AUC(ranking) with its paired
        interval, seconds, and Spearman with RA (interval) / top-10 overlap."""
        u = self.unablated
        lines = [
            f"{self.task}, {self.shots}-shot, {self.n_layers}x{self.n_heads} heads: rankings from "
            f"{self.n_prompts} prompts ({self.n_patching} with equal-length shuffled-label twins), "
            f"accuracy on {self.n_test} test prompts, {self.ablation}-ablating the heads not kept"
            + (f" (means over {self.n_means} held-out prompts)" if self.ablation == "mean" else "")
            + f"; no ablation: top-1 {u.top1:.0%}, top-3 {u.top3:.0%}",
            f"{'ranking':<21} | {'AUC@1 [95% CI]':>21} {'AUC@3':>6} | {'rev@1':>6} | "
            f"{'RA - it [95% CI]':>23} | {'seconds':>8} | {'rho(RA) [95% CI]':>20} {'top10':>5}",
        ]
        for name in self.scores:
            fwd, rev = self.curves[name], self.reverse_curves[name]
            ci = self.intervals.get(name, {})
            auc = f"{ci['auc']}" if "auc" in ci else f"{fwd.auc:.3f}"
            diff = f"{ci['paired_vs_ra']}" if "paired_vs_ra" in ci else "-"
            rho = f"{ci['spearman']}" if "spearman" in ci else "-"
            overlap = self.top10_overlap.get(name)
            lines.append(
                f"{name:<21} | {auc:>21} {fwd.auc_top3:>6.3f} | {rev.auc:>6.3f} | {diff:>23} | "
                f"{self.seconds.get(name, float('nan')):>8.2f} | {rho:>20} "
                + (f"{overlap:>5.0%}" if overlap is not None else f"{'-':>5}")
            )
        if "causal_mediation" in self.seconds and "ra" in self.seconds:
            lines.append(
                f"RA ranking {self.speedup():.0f}x faster than causal mediation "
                f"({self.seconds['ra']:.2f} s vs {self.seconds['causal_mediation']:.2f} s)"
            )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def plots(self, out_dir: str | Path) -> list[Path]:
        """Write ablation_curves.png (top-1, top heads kept), ablation_curves_top3.png,
        ablation_curves_reverse.png (bottom heads kept) and ranking_maps.png (`PLOT_FILES`);
        returns the paths."""
        from ra_lens import viz

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        where = f"{self.task} {self.shots}-shot"
        paths = []
        top1, top3, reverse, maps = PLOT_FILES
        for file, curves, k, title in (
            (top1, self.curves, 1, "Keeping only the top-ranked heads"),
            (top3, self.curves, 3, "Keeping only the top-ranked heads"),
            (reverse, self.reverse_curves, 1, "Keeping the bottom-ranked heads"),
        ):
            path = out / file
            viz.ablation_curves(
                self.fractions,
                {name: curve.curve(k) for name, curve in curves.items()},
                ylabel=f"top-{k} accuracy",
                title=f"{title}, {where}",
                save=path,
            )
            paths.append(path)
        path = out / maps
        viz.ranking_maps(self.scores, save=path)
        paths.append(path)
        return paths


#: The files `HeadRankingResult.plots` writes into its folder (the CLI's --json must not name one).
PLOT_FILES: tuple[str, ...] = (
    "ablation_curves.png",
    "ablation_curves_top3.png",
    "ablation_curves_reverse.png",
    "ranking_maps.png",
)


def _json_float(value: float) -> float | None:
    """NaN (e.g. Spearman with a constant ranking) as null, so the file stays strict JSON."""
    return None if math.isnan(value) else value


def head_ranking(
    model: HookedModel,
    task: str | Task,
    shots: Validated[int] = 5,
    n_prompts: Validated[int] = 25,
    *,
    fractions: Sequence[float] = rk.DEFAULT_FRACTIONS,
    rankings: Sequence[str] = tuple(RANKINGS),
    n_test: Validated[int] | None = None,
    seed: int = 42,
    batch_size: Validated[int] = 8,
    eval_batch_size: Validated[int] = 16,
    ablation: Validated[Literal["zero", "mean"]] = "zero",
    n_means: Validated[int] = 100,
    n_boot: Validated[int] = 1000,
    reuse: HeadRankingResult | None = None,
    progress: bool = True,
) -> HeadRankingResult:
    """Rank every head by RA and by each baseline, then ablate all but the top/bottom p%.

    Rankings are computed on `n_prompts` training prompts of one token length (targets: the first
    answer token at the last position); see `RANKINGS` for what each one is. The label-shuffling
    rankings (indirect effect, activation and attribution patching) are skipped zero-shot.
    Ablation curves are measured on held-out test prompts (`n_test` caps them); each distinct
    set of ablated heads is evaluated once and shared between curves. Every AUC gets a 95%
    percentile bootstrap interval over the test prompts, each ranking's difference to RA a paired
    one, and each Spearman with RA one over the ranking prompts (`n_boot` resamples, seeded).

    Args:
        model: a TransformerLens model (TransformerBridge or HookedTransformer), in eval mode.
        task: a task name from `ra_lens.tasks.available()` or a Task.
        shots: demonstrations per prompt.
        n_prompts: training prompts the rankings are averaged over.
        fractions: fractions of heads kept, each in [0, 1] (default 0, 0.1, ..., 1;
            `ranking.DENSE_FRACTIONS` is dense where curves move).
        rankings: names in RANKINGS ("ra" is always computed).
        batch_size: prompts per pass when ranking; eval_batch_size: when evaluating.
        ablation: "zero" (the paper) zeroes the heads not kept; "mean" replaces each one's hook_z
            output by its mean over up to `n_means` held-out training prompts (all token lengths,
            the ranking prompts among them, never a test prompt), position by position counted
            back from the last token (`ranking.last_token_means`). Causal mediation and its first
            order estimate ablate the same way.
        n_boot: bootstrap resamples for every interval.
        reuse: a result of the same task, shots, prompts and seed (e.g. the other protocol):
            its protocol-independent rankings are taken over, with their seconds, not recomputed.

    Returns:
        HeadRankingResult (`.table()`, `.to_dict()`, `.save(path)`, `.plots(out_dir)`).

    >>> import torch
    >>> from ra_lens.tasks import Task
    >>> toy = Task("toy", [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"),
    ...                    ("s", "the"), ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")])
    >>> result = head_ranking(model, toy, shots=1, n_prompts=4, rankings=["forward", "layer"],
    ...                       fractions=[0, 0.5, 1], n_boot=50, progress=False)
    >>> list(result.scores), result.curves["ra"].n_kept
    (['ra', 'forward', 'layer'], [0, 4, 8])
    >>> torch.equal(result.curves["ra"].accuracies[-1].ranks, result.unablated.ranks)  # p = 1
    True
    >>> train = tasks.task_prompts(model, toy, shots=1)[0][:4]  # the ranking prompts
    >>> targets = [tasks.answer_token(model, p.answer) for p in train]
    >>> torch.allclose(result.scores["ra"], rk.ra_ranking(model, [p.text for p in train], targets))
    True
    """
    names, fractions = _checked(
        rankings, fractions, n_prompts, n_means, n_boot, batch_size, eval_batch_size, shots,
        n_test, ablation,
    )  # fmt: skip
    shape = capture.model_shape(model)
    task = tasks.load(task) if isinstance(task, str) else task
    train_all, test = task_prompts(model, task, shots, seed=seed)
    train, test = train_all[:n_prompts], test if n_test is None else test[:n_test]
    _check_reuse(reuse, task.name, shots, len(train))
    notes: list[str] = []
    targets = [tasks.answer_token(model, p.answer) for p in train]
    inputs = RankingInputs(model, [p.text for p in train], targets, seed, batch_size, progress)
    names = _label_inputs(inputs, names, train, shots, notes)

    # Todd et al.'s means: training prompts of every token length (the ranking prompts are
    # their equal-length subset), never a test prompt.
    means_from = (
        task_prompts(model, task, shots, seed=seed, equal_length=False)[0][:n_means]
        if ablation == "mean"
        else []
    )
    if ablation == "mean":
        inputs.means = last_token_means(model, [p.text for p in means_from])
    evaluate = rk.AblationEvaluator(model, test, means=inputs.means, batch_size=eval_batch_size)

    seconds: dict[str, float] = {}
    with timed(seconds, "unablated"):  # also warms the model up before anything is timed
        unablated = evaluate([])
    scores, per_prompt = _rank(names, inputs, reuse, seconds)

    with timed(seconds, "ablation_curves"):
        curves, reverse_curves = _curves(model, test, scores, fractions, evaluate, task.name, progress)  # fmt: skip

    others = {name: s for name, s in scores.items() if name != "ra"}
    k = min(10, shape.n_layers * shape.n_heads)
    with timed(seconds, "bootstrap"):
        intervals = _intervals(curves, reverse_curves, scores, per_prompt, n_boot, seed)
    return HeadRankingResult(
        task=task.name,
        shots=shots,
        n_prompts=len(train),
        n_test=len(test),
        n_patching=len(inputs.pairs[0]) if inputs.pairs else 0,
        fractions=fractions,
        scores=scores,
        curves=curves,
        reverse_curves=reverse_curves,
        seconds=seconds,
        spearman={name: rk.spearman(scores["ra"], s) for name, s in others.items()},
        top10_overlap={name: rk.top_k_overlap(scores["ra"], s, k) for name, s in others.items()},
        unablated=unablated,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        ablation=ablation,
        notes=notes,
        intervals=intervals,
        n_means=len(means_from),
        per_prompt=per_prompt,
    )


def _check_reuse(reuse: HeadRankingResult | None, task: str, shots: int, n_train: int) -> None:
    if reuse is not None and (reuse.task, reuse.shots, reuse.n_prompts) != (task, shots, n_train):
        raise ValueError(
            f"reuse holds {reuse.task} {reuse.shots}-shot from {reuse.n_prompts} prompts, not "
            f"{task} {shots}-shot from {n_train}: reuse a result of the same cell"
        )


def _curves(
    model: HookedModel,
    test: Sequence[Prompt],
    scores: dict[str, Scores],
    fractions: list[float],
    evaluate: rk.AblationEvaluator,
    task: str,
    progress: bool,
) -> tuple[dict[str, AblationCurve], dict[str, AblationCurve]]:
    """Each ranking's ablation curve keeping its top heads and (reverse) its bottom ones."""
    curves: dict[str, AblationCurve] = {}
    reverse_curves: dict[str, AblationCurve] = {}
    for name in tqdm(scores, desc=f"{task} ablation curves", disable=not progress):
        for reverse, store in ((False, curves), (True, reverse_curves)):
            store[name] = rk.ablation_curve(
                model, test, scores[name], fractions, reverse=reverse, evaluate=evaluate
            )
    return curves, reverse_curves


def _checked(
    rankings: Sequence[str],
    fractions: Sequence[float],
    n_prompts: int,
    n_means: int,
    n_boot: int,
    batch_size: int,
    eval_batch_size: int,
    shots: int,
    n_test: int | None,
    ablation: str,
) -> tuple[list[str], list[float]]:
    """`head_ranking`'s arguments checked: the rankings to compute (`check_rankings`) and the
    fractions (`ranking.check_fractions`); a ValueError naming the first bad one."""
    names = check_rankings(rankings)
    checked_fractions = rk.check_fractions(fractions)
    for value, what in ((n_prompts, "n_prompts"), (n_means, "n_means"), (n_boot, "n_boot")):
        check_count(value, what)
    check_count(batch_size, "batch_size")
    check_count(eval_batch_size, "eval_batch_size")
    check_count(shots, "shots", minimum=0)
    if n_test is not None:
        check_count(n_test, "n_test")
    if ablation not in ("zero", "mean"):
        raise ValueError(f"unknown ablation {ablation!r}: choose 'zero' or 'mean'")
    return names, checked_fractions


def _label_inputs(
    inputs: RankingInputs, names: list[str], train: list[Prompt], shots: int, notes: list[str]
) -> list[str]:
    """The rankings that can run: zero-shot drops those that shuffle labels (with a note);
    the others get the shuffled-label twins into `inputs`, and the paired ones the twins of equal
    token length (a note says how many prompts changed length). Returns the names kept."""
    if shots == 0 and any(RANKINGS[n].needs_labels for n in names):
        names = [n for n in names if not RANKINGS[n].needs_labels]
        notes.append(
            "zero-shot: no labels to shuffle, indirect effect and activation/attribution "
            "patching skipped"
        )
    if any(RANKINGS[n].needs_labels for n in names):
        inputs.shuffled = [p.text for p in shuffled_label_prompts(train, seed=inputs.seed)]
        if PAIRED & set(names):
            inputs.pairs = _patching_pairs(inputs.model, train, inputs.targets, inputs.seed)
            if len(inputs.pairs[0]) < len(train):
                notes.append(
                    f"{len(train) - len(inputs.pairs[0])} of {len(train)} prompts changed token "
                    "length when their labels were shuffled; activation/attribution patching "
                    "use the rest"
                )
    return names


def _rank(
    names: list[str],
    inputs: RankingInputs,
    reuse: HeadRankingResult | None,
    seconds: dict[str, float],
) -> tuple[dict[str, Scores], dict[str, Tensor]]:
    """Every ranking's scores (the per-prompt mean where it gives one per prompt) and its
    per-prompt scores, each timed into `seconds`; a protocol-independent ranking of `reuse` is
    taken over with its seconds."""
    scores: dict[str, Scores] = {}
    per_prompt: dict[str, Tensor] = {}
    for name in names:
        if reuse is not None and not RANKINGS[name].protocol and name in reuse.scores:
            scores[name] = reuse.scores[name]
            if name in reuse.per_prompt:
                per_prompt[name] = reuse.per_prompt[name]
            seconds[name] = reuse.seconds[name]
            continue
        with timed(seconds, name):
            values = RANKINGS[name].compute(inputs)
        if values.ndim == 3:
            per_prompt[name] = values
            values = values.double().mean(0).float()
        scores[name] = values
    return scores, per_prompt


def _intervals(
    curves: dict[str, AblationCurve],
    reverse_curves: dict[str, AblationCurve],
    scores: dict[str, Scores],
    per_prompt: dict[str, Tensor],
    n_boot: int,
    seed: int,
) -> dict[str, dict[str, Interval]]:
    """Bootstrap intervals of every ranking's AUCs, of AUC(RA) - AUC(it), and of its Spearman
    with RA. The same seed everywhere: every AUC of a cell is resampled on the same prompts."""
    out: dict[str, dict[str, Interval]] = {}
    for name in curves:
        entry = {
            "auc": rk.auc_interval(curves[name], 1, n_boot=n_boot, seed=seed),
            "auc_top3": rk.auc_interval(curves[name], 3, n_boot=n_boot, seed=seed),
            "reverse_auc": rk.auc_interval(reverse_curves[name], 1, n_boot=n_boot, seed=seed),
        }
        if name != "ra":
            entry["paired_vs_ra"] = rk.paired_auc_difference(
                curves["ra"], curves[name], 1, n_boot=n_boot, seed=seed
            )
            entry["spearman"] = rk.spearman_interval(
                per_prompt.get("ra", scores["ra"]),
                per_prompt.get(name, scores[name]),
                n_boot=n_boot,
                seed=seed,
            )
        out[name] = entry
    return out


def _patching_pairs(
    model: HookedModel, prompts: list[Prompt], targets: list[int], seed: int
) -> tuple[list[str], list[str], list[int]]:
    """(clean texts, corrupted texts, targets) of `tasks.shuffled_label_pairs`."""
    kept = tasks.shuffled_label_pairs(model, prompts, seed=seed)
    rows, j = [], 0  # kept is an ordered subsequence of prompts: find each pair's row
    for i, prompt in enumerate(prompts):
        if j < len(kept) and kept[j][0] is prompt:
            rows.append(i)
            j += 1
    return (
        [clean.text for clean, _ in kept],
        [corrupted.text for _, corrupted in kept],
        [targets[i] for i in rows],
    )
