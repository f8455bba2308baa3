"""The paper's head-ranking experiment (section 4b) on an ICL task: rank heads by RA and by the
baselines, then keep only the top (or bottom) p% of heads, ablate the rest (zero, or Todd et al.'s
mean aligned at the last token), and measure held-out accuracy, with bootstrap intervals.

Rankings live in a registry, `RANKINGS` (name -> `RankingSpec`): RA norm, its loss row, RA's
inverse-temperature score, forward-pattern norm, random, layer index, causal mediation, its
first-order estimate, Todd et al.'s indirect effect, activation patching with TransformerLens and
attribution patching.

    >>> from ra_lens.experiments import head_ranking
    >>> result = head_ranking(model, "antonym", shots=5, n_prompts=25)     # doctest: +SKIP
    >>> print(result.table())                                              # doctest: +SKIP
    >>> result.save("ranking.json"); result.plots("figures/")          # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.patching import HeadMeans, last_token_means
from ra_lens.progress import tqdm
from ra_lens.ranking import AblationCurve, Interval
from ra_lens.record import Recorded
from ra_lens.tasks import Accuracy, Prompt, Task, shuffled_label_prompts, task_prompts
from ra_lens.timing import timed
from ra_lens.types import Scores


@dataclass
class RankingInputs:
    """What a ranking may read: the ranking prompts, their shuffled-label twins, the means of
    the ablation protocol (None = zero ablation) and run settings."""

    model: HookedModel
    texts: list[str]
    targets: list[int]
    seed: int
    batch_size: int
    progress: bool
    means: HeadMeans | None = None
    #: (clean, corrupted, targets) for the prompts whose shuffled twin has the same token length.
    pairs: tuple[list[str], list[str], list[int]] | None = None
    #: every ranking prompt's shuffled-label twin (any length), for the indirect effect.
    shuffled: list[str] | None = None


#: What a ranking reads: the ranking prompts; them and their shuffled-label twins; the clean /
#: shuffled pairs of equal token length; the model's shape; the shape and the seed.
Inputs = Literal["prompts", "shuffled", "pairs", "shape", "seeded"]


@dataclass(frozen=True)
class RankingSpec:
    """One ranking in the registry: a library function and how head_ranking calls it.

    Attributes:
        name: the registry key.
        function: a `ra_lens.ranking` function. "prompts": `f(model, texts, targets, *,
            batch_size, progress, per_prompt, **options)`; "shuffled" and "pairs":
            `f(model, clean, corrupted, targets, ...)`; "shape": `f(n_layers, n_heads)`;
            "seeded": `f(n_layers, n_heads, seed)`.
        description: one line for tables and help.
        inputs: what it reads (see `Inputs`).
        options: fixed keyword arguments (e.g. loss_row=True).
        protocol: takes the ablation protocol's `means` (causal mediation ablates the way the
            curves do).
        per_prompt: asked for each prompt's scores, so that its Spearman interval resamples
            its prompts; False keeps the ranking fixed in the interval.
    """

    name: str
    function: Callable[..., Tensor]
    description: str
    inputs: Inputs = "prompts"
    options: Mapping[str, Any] = field(default_factory=dict)
    protocol: bool = False
    per_prompt: bool = True

    @property
    def needs_labels(self) -> bool:
        """Needs demonstrations to shuffle (skipped zero-shot)."""
        return self.inputs in ("shuffled", "pairs")

    @property
    def paired(self) -> bool:
        """Needs clean/shuffled-label prompt pairs of equal token length."""
        return self.inputs == "pairs"

    def compute(self, inputs: RankingInputs) -> Tensor:
        """Float[Tensor, "batch layer head"] (per prompt) or Float[Tensor, "layer head"]."""
        if self.inputs in ("shape", "seeded"):
            shape = capture.model_shape(inputs.model)
            seed = (inputs.seed,) if self.inputs == "seeded" else ()
            return self.function(shape.n_layers, shape.n_heads, *seed, **self.options)
        if self.inputs == "prompts":
            data: tuple[Any, ...] = (inputs.texts, inputs.targets)
        elif self.inputs == "shuffled":
            data = (inputs.texts, inputs.shuffled, inputs.targets)
        else:
            assert inputs.pairs is not None, "a paired ranking ran without shuffled-label pairs"
            data = inputs.pairs
        options = dict(self.options, means=inputs.means) if self.protocol else self.options
        return self.function(
            inputs.model,
            *data,
            batch_size=inputs.batch_size,
            progress=inputs.progress,
            per_prompt=self.per_prompt,
            **options,
        )


def register(registry: dict[str, RankingSpec], spec: RankingSpec) -> None:
    """Add a ranking to a registry; a name already there is refused.

    >>> registry = {}
    >>> register(registry, RankingSpec("layer", rk.layer_ranking, "layer index", "shape"))
    >>> register(registry, RankingSpec("layer", rk.layer_ranking, "again", "shape"))
    Traceback (most recent call last):
    ValueError: a ranking named 'layer' is already registered: choose another name
    """
    if spec.name in registry:
        raise ValueError(
            f"a ranking named {spec.name!r} is already registered: choose another name"
        )
    registry[spec.name] = spec


#: Every ranking head_ranking knows, in the order it computes them ("ra" is the reference).
RANKINGS: dict[str, RankingSpec] = {}
for _spec in (
    RankingSpec("ra", rk.ra_ranking, "RA, mean Frobenius norm"),
    RankingSpec("ra_loss_row", rk.ra_ranking, "RA, loss row only", options={"loss_row": True}),
    RankingSpec("ra_temperature", rk.temperature_ranking, "RA x QK^T (|dL/d inverse temperature|)"),
    RankingSpec("forward", rk.forward_ranking, "forward-pattern norm"),
    RankingSpec("random", rk.random_ranking, "random (seeded)", "seeded"),
    RankingSpec("layer", rk.layer_ranking, "layer index", "shape"),
    RankingSpec(
        "causal_mediation",
        rk.causal_mediation,
        "causal mediation (ablate one head, p drop)",
        protocol=True,
    ),
    RankingSpec(
        "cm_first_order",
        rk.first_order_mediation,
        "causal mediation, first order (grad x (z - ablated))",
        protocol=True,
    ),
    RankingSpec("indirect_effect", rk.indirect_effect, "indirect effect (Todd et al.)", "shuffled"),
    # The two below stay fixed in their Spearman intervals, as in the published study.
    RankingSpec(
        "activation_patching",
        rk.activation_patching,
        "activation patching (transformer_lens.patching)",
        "pairs",
        per_prompt=False,
    ),
    RankingSpec("attribution_patching", rk.attribution_patching, "attribution patching", "pairs"),
    RankingSpec(
        "exact_qk_attribution",
        rk.exact_qk_attribution,
        "exact query/key attribution (AtP* QK fix)",
        "pairs",
        per_prompt=False,
    ),
):
    register(RANKINGS, _spec)
#: Rankings that need clean/corrupted prompt pairs of equal token length.
PAIRED: frozenset[str] = frozenset(name for name, spec in RANKINGS.items() if spec.paired)


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


def check_rankings(names: Sequence[str]) -> list[str]:
    """Known ranking names, de-duplicated in RANKINGS order, always with "ra"; or a ValueError
    listing the names the registry knows.

    >>> check_rankings(["forward", "random", "forward"])  # RANKINGS order, with "ra"
    ['ra', 'forward', 'random']
    >>> check_rankings(["nope"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown ranking 'nope': choose from ra, ra_loss_row, ...
    """
    unknown = [n for n in names if n not in RANKINGS]
    if unknown:
        raise ValueError(f"unknown ranking {unknown[0]!r}: choose from {', '.join(RANKINGS)}")
    chosen = set(names) | {"ra"}
    return [n for n in RANKINGS if n in chosen]


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
    names = check_rankings(rankings)
    fractions = rk.check_fractions(fractions)
    for value, what in ((n_prompts, "n_prompts"), (n_means, "n_means"), (n_boot, "n_boot")):
        check_count(value, what)
    check_count(batch_size, "batch_size")
    check_count(eval_batch_size, "eval_batch_size")
    check_count(shots, "shots", minimum=0)
    if n_test is not None:
        check_count(n_test, "n_test")
    if ablation not in ("zero", "mean"):
        raise ValueError(f"unknown ablation {ablation!r}: choose 'zero' or 'mean'")
    shape = capture.model_shape(model)
    task = tasks.load(task) if isinstance(task, str) else task
    train_all, test = task_prompts(model, task, shots, seed=seed)
    train, test = train_all[:n_prompts], test if n_test is None else test[:n_test]
    if reuse is not None and (reuse.task, reuse.shots, reuse.n_prompts) != (
        task.name,
        shots,
        len(train),
    ):
        raise ValueError(
            f"reuse holds {reuse.task} {reuse.shots}-shot from {reuse.n_prompts} prompts, not "
            f"{task.name} {shots}-shot from {len(train)}: reuse a result of the same cell"
        )
    notes: list[str] = []
    texts = [p.text for p in train]
    targets = [tasks.answer_token(model, p.answer) for p in train]
    inputs = RankingInputs(model, texts, targets, seed, batch_size, progress)

    if shots == 0 and any(RANKINGS[n].needs_labels for n in names):
        names = [n for n in names if not RANKINGS[n].needs_labels]
        notes.append(
            "zero-shot: no labels to shuffle, indirect effect and activation/attribution "
            "patching skipped"
        )
    if any(RANKINGS[n].needs_labels for n in names):
        inputs.shuffled = [p.text for p in shuffled_label_prompts(train, seed=seed)]
        if PAIRED & set(names):
            inputs.pairs = _patching_pairs(model, train, targets, seed)
            if len(inputs.pairs[0]) < len(train):
                notes.append(
                    f"{len(train) - len(inputs.pairs[0])} of {len(train)} prompts changed token "
                    "length when their labels were shuffled; activation/attribution patching "
                    "use the rest"
                )

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

    curves: dict[str, AblationCurve] = {}
    reverse_curves: dict[str, AblationCurve] = {}
    with timed(seconds, "ablation_curves"):
        for name in tqdm(names, desc=f"{task.name} ablation curves", disable=not progress):
            for reverse, store in ((False, curves), (True, reverse_curves)):
                store[name] = rk.ablation_curve(
                    model, test, scores[name], fractions, reverse=reverse, evaluate=evaluate
                )

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
