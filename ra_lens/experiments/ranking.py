"""The paper's head-ranking experiment (section 4b) on an ICL task: rank heads by RA and by the
baselines (forward-pattern norm, random, layer index, causal mediation, activation patching with
TransformerLens, attribution patching), then keep only the top (or bottom) p% of heads, zero the
rest, and measure held-out accuracy.

    >>> from ra_lens.experiments import head_ranking
    >>> result = head_ranking(model, "antonym", shots=5, n_prompts=25)     # doctest: +SKIP
    >>> print(result.table())                                              # doctest: +SKIP
    >>> result.save_json("ranking.json"); result.plot("figures/")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens.experiments.patching import task_prompts
from ra_lens.experiments.timing import timed
from ra_lens.patching import head_ablation_hooks, mean_head_outputs
from ra_lens.ranking import AblationCurve, Scores
from ra_lens.tasks import Accuracy, Prompt, Task

#: Every ranking head_ranking knows, in the order it computes them ("ra" is the reference).
RANKINGS: tuple[str, ...] = (
    "ra",
    "ra_loss_row",
    "forward",
    "random",
    "layer",
    "causal_mediation",
    "activation_patching",
    "attribution_patching",
    "exact_qk_attribution",
)
#: Rankings that need clean/corrupted prompt pairs (corrupted = demonstration labels shuffled).
PAIRED: frozenset[str] = frozenset(
    {"activation_patching", "attribution_patching", "exact_qk_attribution"}
)


@dataclass
class HeadRankingResult:
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
            "unablated": self.unablated.to_dict(),
            "rankings": rankings,
            "spearman": {n: _json_float(v) for n, v in self.spearman.items()},
            "top10_overlap": dict(self.top10_overlap),
            "seconds_ratio_to_ra": speedups,
            "seconds": dict(self.seconds),
            "notes": list(self.notes),
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    def table(self) -> str:
        """One row per ranking: ablation AUCs (top-1/top-3, keeping the top and the bottom
        heads), seconds, and Spearman / top-10 overlap with RA."""
        u = self.unablated
        lines = [
            f"{self.task}, {self.shots}-shot, {self.n_layers}x{self.n_heads} heads: rankings from "
            f"{self.n_prompts} prompts ({self.n_patching} with shuffled-label twins), accuracy on "
            f"{self.n_test} test prompts, {self.ablation}-ablating the heads not kept; "
            f"no ablation: top-1 {u.top1:.0%}, top-3 {u.top3:.0%}",
            f"{'ranking':<21} | {'AUC@1':>6} {'AUC@3':>6} | {'rev@1':>6} {'rev@3':>6} | "
            f"{'seconds':>8} | {'rho(RA)':>7} {'top10':>5}",
        ]
        for name in self.scores:
            fwd, rev = self.curves[name], self.reverse_curves[name]
            rho = self.spearman.get(name)
            overlap = self.top10_overlap.get(name)
            lines.append(
                f"{name:<21} | {fwd.auc:>6.3f} {fwd.auc_top3:>6.3f} | {rev.auc:>6.3f} "
                f"{rev.auc_top3:>6.3f} | {self.seconds.get(name, float('nan')):>8.2f} | "
                + (f"{rho:>7.2f} {overlap:>5.0%}" if rho is not None else f"{'-':>7} {'-':>5}")
            )
        if "causal_mediation" in self.seconds and "ra" in self.seconds:
            lines.append(
                f"RA ranking {self.speedup():.0f}x faster than causal mediation "
                f"({self.seconds['ra']:.2f} s vs {self.seconds['causal_mediation']:.2f} s)"
            )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def plot(self, out_dir: str | Path) -> list[Path]:
        """Write ablation_curves.png (top-1, top heads kept), ablation_curves_top3.png,
        ablation_curves_reverse.png (bottom heads kept) and ranking_maps.png; returns the paths."""
        from ra_lens import viz

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        where = f"{self.task} {self.shots}-shot"
        paths = []
        for file, curves, k, title in (
            ("ablation_curves.png", self.curves, 1, "Keeping only the top-ranked heads"),
            ("ablation_curves_top3.png", self.curves, 3, "Keeping only the top-ranked heads"),
            (
                "ablation_curves_reverse.png",
                self.reverse_curves,
                1,
                "Keeping the bottom-ranked heads",
            ),
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
        path = out / "ranking_maps.png"
        viz.ranking_maps(self.scores, save=path)
        paths.append(path)
        return paths


def _json_float(value: float) -> float | None:
    """NaN (e.g. Spearman with a constant ranking) as null, so the file stays strict JSON."""
    return None if math.isnan(value) else value


def shuffled_label_prompts(prompts: Sequence[Prompt], *, seed: int = 0) -> list[Prompt]:
    """The same prompts with their demonstrations' labels shuffled (Todd et al.'s corruption).

    With two or more demonstrations, the labels of each prompt are permuted so that none stays
    with its own input (a random cycle); with one, each prompt takes the label of the next
    prompt's demonstration whose label differs. The query and the answer are unchanged.

    Raises:
        ValueError: zero-shot prompts (nothing to shuffle) or prompts without demonstrations.
    """
    prompts = list(prompts)
    if not prompts or any(p.shots == 0 for p in prompts):
        raise ValueError(
            "shuffled-label corruption needs demonstrations in every prompt (shots >= 1)"
        )
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts):
        xs = [x for x, _ in prompt.demos]
        ys = [y for _, y in prompt.demos]
        if len(ys) >= 2:
            cycle = list(range(len(ys)))
            rng.shuffle(cycle)
            new = list(ys)
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
                new[a] = ys[b]
        else:
            others = [
                q.demos[0][1]
                for q in prompts[i + 1 :] + prompts[:i]
                if q.demos and q.demos[0][1] != ys[0]
            ]
            new = [others[0] if others else ys[0]]
        demos = tuple(zip(xs, new, strict=True))
        out.append(replace(prompt, text=tasks.format_prompt(demos, prompt.query), demos=demos))
    return out


def check_rankings(names: Sequence[str]) -> list[str]:
    """Known ranking names, de-duplicated in RANKINGS order, always with "ra"; or a ValueError."""
    unknown = [n for n in names if n not in RANKINGS]
    if unknown:
        raise ValueError(f"unknown ranking {unknown[0]!r}: choose from {', '.join(RANKINGS)}")
    chosen = set(names) | {"ra"}
    return [n for n in RANKINGS if n in chosen]


def head_ranking(
    model: Any,
    task: str | Task,
    shots: int = 5,
    n_prompts: int = 25,
    *,
    fractions: Sequence[float] = rk.DEFAULT_FRACTIONS,
    rankings: Sequence[str] = RANKINGS,
    n_test: int | None = None,
    seed: int = 42,
    batch_size: int = 8,
    eval_batch_size: int = 16,
    ablation: Literal["zero", "mean"] = "zero",
    progress: bool = True,
) -> HeadRankingResult:
    """Rank every head by RA and by each baseline, then ablate all but the top/bottom p%.

    Rankings are computed on `n_prompts` training prompts of one token length (targets: the first
    answer token at the last position): RA of -log p(target) (keep="norms", so it stays one cheap
    forward + backward pass), its loss-row variant, forward-pattern norms, random (seeded by
    `seed`), layer index, causal mediation (zero one head, drop in p(target)), activation
    patching via `transformer_lens.patching` and attribution patching, both from clean prompts
    against the same prompts with shuffled demonstration labels (skipped zero-shot).
    Ablation curves are measured on held-out test prompts (`n_test` caps them); each distinct
    set of ablated heads is evaluated once and shared between curves.

    Args:
        model: a TransformerLens model (TransformerBridge or HookedTransformer), in eval mode.
        task: a task name from `ra_lens.tasks.available()` or a Task.
        shots: demonstrations per prompt.
        n_prompts: training prompts the rankings are averaged over.
        fractions: fractions of heads kept, each in [0, 1] (default 0, 0.1, ..., 1).
        rankings: which rankings to compute (names in RANKINGS; "ra" is always computed).
        batch_size: prompts per pass when ranking; eval_batch_size: when evaluating.
        ablation: "zero" (the paper) zeroes the heads not kept; "mean" replaces their hook_z
            output by its mean over the ranking prompts (`patching.mean_head_outputs`).

    Returns:
        HeadRankingResult (`.table()`, `.to_dict()`, `.save_json(path)`, `.plot(out_dir)`).
    """
    names = check_rankings(rankings)
    fractions = rk.check_fractions(fractions)
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    if ablation not in ("zero", "mean"):
        raise ValueError(f"unknown ablation {ablation!r}: choose 'zero' or 'mean'")
    shape = capture.model_shape(model)
    task_name = task if isinstance(task, str) else task.name
    train, test = task_prompts(model, task, shots, seed=seed)
    train, test = train[:n_prompts], test[:n_test] if n_test else test
    notes: list[str] = []
    texts = [p.text for p in train]
    targets = [tasks.answer_token(model, p.answer) for p in train]

    pairs: tuple[list[str], list[str], list[int]] | None = None
    if PAIRED & set(names):
        if shots == 0:
            names = [n for n in names if n not in PAIRED]
            notes.append("zero-shot: no labels to shuffle, activation/attribution patching skipped")
        else:
            pairs = _patching_pairs(model, train, targets, seed)
            if len(pairs[0]) < len(train):
                notes.append(
                    f"{len(train) - len(pairs[0])} of {len(train)} prompts changed token length "
                    "when their labels were shuffled; activation/attribution patching use the rest"
                )

    means = mean_head_outputs(model, texts) if ablation == "mean" else None
    memo: dict[tuple[tuple[int, int], ...], Accuracy] = {}

    def evaluate(ablated: list[tuple[int, int]]) -> Accuracy:
        key = tuple(ablated)
        if key not in memo:
            hooks = head_ablation_hooks(ablated, mode=ablation, means=means) if ablated else []
            memo[key] = tasks.evaluate(model, test, fwd_hooks=hooks, batch_size=eval_batch_size)
        return memo[key]

    seconds: dict[str, float] = {}
    with timed(seconds, "unablated"):  # also warms the model up before anything is timed
        unablated = evaluate([])

    def compute(name: str) -> Scores:
        if name == "ra":
            return rk.ra_ranking(model, texts, targets, batch_size=batch_size)
        if name == "ra_loss_row":
            return rk.ra_ranking(model, texts, targets, loss_row=True, batch_size=batch_size)
        if name == "forward":
            return rk.forward_ranking(model, texts, batch_size=batch_size)
        if name == "random":
            return rk.random_ranking(shape.n_layers, shape.n_heads, seed=seed)
        if name == "layer":
            return rk.layer_ranking(shape.n_layers, shape.n_heads)
        if name == "causal_mediation":
            return rk.causal_mediation(
                model, texts, targets, batch_size=batch_size, progress=progress
            )
        assert pairs is not None
        clean, corrupted, paired_targets = pairs
        if name == "activation_patching":
            return rk.activation_patching(
                model, clean, corrupted, paired_targets, batch_size=batch_size, progress=progress
            )
        if name == "exact_qk_attribution":
            return rk.exact_qk_attribution(
                model, clean, corrupted, paired_targets, batch_size=batch_size
            )
        return rk.attribution_patching(
            model, clean, corrupted, paired_targets, batch_size=batch_size
        )

    scores: dict[str, Scores] = {}
    for name in names:
        with timed(seconds, name):
            scores[name] = compute(name)

    curves: dict[str, AblationCurve] = {}
    reverse_curves: dict[str, AblationCurve] = {}
    with timed(seconds, "ablation_curves"):
        for name in tqdm(names, desc=f"{task_name} ablation curves", disable=not progress):
            for reverse, store in ((False, curves), (True, reverse_curves)):
                store[name] = rk.ablation_curve(
                    model, test, scores[name], fractions, reverse=reverse, evaluate=evaluate
                )

    others = {name: s for name, s in scores.items() if name != "ra"}
    k = min(10, shape.n_layers * shape.n_heads)
    return HeadRankingResult(
        task=task_name,
        shots=shots,
        n_prompts=len(train),
        n_test=len(test),
        n_patching=len(pairs[0]) if pairs else 0,
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
    )


def _patching_pairs(
    model: Any, prompts: list[Prompt], targets: list[int], seed: int
) -> tuple[list[str], list[str], list[int]]:
    """(clean texts, corrupted texts, targets) for the prompts whose shuffled-label twin has the
    same token length."""
    corrupted = shuffled_label_prompts(prompts, seed=seed)
    clean_lengths = tasks.prompt_lengths(prompts, model)
    corrupted_lengths = tasks.prompt_lengths(corrupted, model)
    keep = [
        i for i, (a, b) in enumerate(zip(clean_lengths, corrupted_lengths, strict=True)) if a == b
    ]
    if not keep:
        raise ValueError(
            "no prompt keeps its token length once its labels are shuffled: activation and "
            "attribution patching need clean/corrupted pairs of equal length"
        )
    return (
        [prompts[i].text for i in keep],
        [corrupted[i].text for i in keep],
        [targets[i] for i in keep],
    )
