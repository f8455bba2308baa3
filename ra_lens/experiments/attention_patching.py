"""The paper's attention-patching experiment on an ICL task: mean RA of training prompts, added
to the forward attention of held-out prompts at a sweep of scales, against the forward baseline."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ra_lens import pairs, tasks
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.core import reversed_attention
from ra_lens.metrics import target_nll
from ra_lens.patching import attention_patch_hooks, forward_patch_hooks
from ra_lens.progress import tqdm
from ra_lens.record import Recorded
from ra_lens.result import ReversedAttention
from ra_lens.tasks import Accuracy, Prompt, Task, evaluate, task_prompts
from ra_lens.timing import timed

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The paper's grid, extended to stronger negative values (SmolLM2 peaks between -16 and -32).
PAPER_SCALES: tuple[float, ...] = (
    3, 2, 1, 0.5, 0.25, 0, -0.1, -0.5, -1, -2, -4, -6, -8, -10, -15, -20, -25, -30, -35, -40,
    -60, -80, -100, -120,
)  # fmt: skip
DEFAULT_SCALES: tuple[float, ...] = PAPER_SCALES + (-160, -240)


@dataclass
class PatchingResult(Recorded):
    """Accuracy on held-out prompts for each scale, with RA patching and the forward baseline.

    >>> import torch
    >>> from ra_lens.tasks import Accuracy
    >>> def acc(*ranks): return Accuracy.from_ranks(torch.tensor(ranks))
    >>> result = PatchingResult("toy", 0, scales=[1.0, -1.0], ra=[acc(0, 9), acc(0, 0)],
    ...                         forward=[acc(9, 9), acc(0, 9)], unpatched=acc(0, 9),
    ...                         n_prompts=4, n_test=2)
    >>> result.best(1), result.best(1, "forward"), result.to_dict()["best_ra_top3"]
    ((-1.0, 1.0), (-1.0, 0.5), {'scale': -1.0, 'top3': 1.0})
    """

    task: str
    shots: int
    scales: list[float]
    ra: list[Accuracy]
    forward: list[Accuracy]
    unpatched: Accuracy
    n_prompts: int
    n_test: int
    seconds: dict[str, float] = field(default_factory=dict)
    ra_maps: ReversedAttention | None = field(default=None, repr=False)
    #: Accuracy per scale on the validation prompts (training prompts not averaged, or half of
    #: the held-out ones: `validation_from`), where the scale is chosen; empty when not measured.
    ra_validation: list[Accuracy] = field(default_factory=list)
    forward_validation: list[Accuracy] = field(default_factory=list)
    n_validation: int = 0
    validation_from: str = ""

    def chosen(self, k: int = 3, method: str = "ra") -> tuple[float, float, float]:
        """(scale, validation top-k, test top-k): the scale with the best top-k accuracy on the
        validation prompts (ties: the smaller |scale|) and its accuracy on the test prompts, an
        honest estimate, unlike `best`, which picks the scale on the test prompts themselves."""
        validation = getattr(self, f"{method}_validation")
        if not validation:
            raise ValueError("no validation accuracies in this result: run attention_patching")
        accs = [a.top(k) for a in validation]
        i = max(range(len(accs)), key=lambda j: (accs[j], -abs(self.scales[j])))
        return self.scales[i], accs[i], getattr(self, method)[i].top(k)

    def best(self, k: int = 3, method: str = "ra") -> tuple[float, float]:
        """(scale, top-k accuracy) of the best scale on the TEST prompts for a method ("ra" or
        "forward"): an optimistic reference (the scale is chosen on the prompts it is scored on);
        `chosen` picks it on the validation prompts."""
        accs = [a.top(k) for a in getattr(self, method)]
        i = max(range(len(accs)), key=lambda j: (accs[j], -abs(self.scales[j])))
        return self.scales[i], accs[i]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: {"scales", "ra": {"top1", "top2", "top3"}, "forward": {...}, ...}."""

        def curves(accs: list[Accuracy]) -> dict[str, list[float]]:
            return {f"top{k}": [a.top(k) for a in accs] for k in (1, 2, 3)}

        return {
            "task": self.task,
            "shots": self.shots,
            "scales": list(self.scales),
            "ra": curves(self.ra),
            "forward": curves(self.forward),
            "unpatched": {f"top{k}": self.unpatched.top(k) for k in (1, 2, 3)},
            "best_ra_top3": dict(zip(("scale", "top3"), self.best(3, "ra"))),
            "best_forward_top3": dict(zip(("scale", "top3"), self.best(3, "forward"))),
            "n_prompts": self.n_prompts,
            "n_test": self.n_test,
            **self._validation_dict(curves),
            "seconds": self.seconds,
        }

    def _validation_dict(
        self, curves: Callable[[list[Accuracy]], dict[str, list[float]]]
    ) -> dict[str, Any]:
        if not self.ra_validation:
            return {}
        keys = ("scale", "validation_top3", "test_top3")
        return {
            "validation": {
                "ra": curves(self.ra_validation),
                "forward": curves(self.forward_validation),
            },  # fmt: skip
            "n_validation": self.n_validation,
            "validation_from": self.validation_from,
            "chosen_ra_top3": dict(zip(keys, self.chosen(3, "ra"))),
            "chosen_forward_top3": dict(zip(keys, self.chosen(3, "forward"))),
        }

    def table(self) -> str:
        """A plain-text table: one row per scale, top-1/top-3 for RA and forward patching."""
        u = self.unpatched
        lines = [
            f"{self.task}, {self.shots}-shot: RA averaged over {self.n_prompts} training prompts, "
            f"{self.n_test} test prompts; unpatched top-1 {u.top1:.0%}, top-3 {u.top3:.0%}",
            f"{'scale':>8} | {'RA top-1':>8} {'RA top-3':>8} | {'fwd top-1':>9} {'fwd top-3':>9}",
        ]
        for s, r, f in zip(self.scales, self.ra, self.forward):
            lines.append(f"{s:>8g} | {r.top1:>8.0%} {r.top3:>8.0%} | {f.top1:>9.0%} {f.top3:>9.0%}")
        scale, acc = self.best(3)
        if self.ra_validation:
            for method, label in (("ra", "RA"), ("forward", "forward")):
                chosen, val, test = self.chosen(3, method)
                lines.append(
                    f"{label} scale chosen on {self.n_validation} validation prompts "
                    f"({self.validation_from}): {chosen:g}, validation top-3 {val:.0%}; test "
                    f"top-3 {test:.0%} (unpatched {u.top3:.0%})"
                )
            lines.append(f"(best RA scale on the test prompts themselves, optimistic: {scale:g}, "
                         f"top-3 {acc:.0%})")  # fmt: skip
        else:
            lines.append(f"best RA scale {scale:g}: top-3 {acc:.0%} (unpatched {u.top3:.0%})")
        return "\n".join(lines)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Accuracy against scale for RA and forward patching (a matplotlib Figure)."""
        from ra_lens import viz

        curves = {
            "RA top-1": [a.top1 for a in self.ra],
            "RA top-3": [a.top3 for a in self.ra],
            "forward top-1": [a.top1 for a in self.forward],
            "forward top-3": [a.top3 for a in self.forward],
        }
        return viz.scale_sweep(
            self.scales,
            curves,
            ylabel="accuracy",
            baseline=self.unpatched.top3,
            title=f"Attention patching, {self.task} {self.shots}-shot (dashed: unpatched top-3)",
            save=save,
        )


def mean_reversed_attention(
    model: HookedModel, prompts: Sequence[Prompt], *, batch_size: int = 8
) -> ReversedAttention:
    """RA of each prompt's own -log p(first answer token), for equal-length prompts, in batches.

    >>> import torch
    >>> from ra_lens.tasks import Task
    >>> toy = Task("toy", [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"),
    ...                    ("s", "the"), ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")])
    >>> train, _ = tasks.task_prompts(model, toy, shots=1)
    >>> ra = mean_reversed_attention(model, train[:4], batch_size=3)  # batches of 3 and 1
    >>> ra.maps.shape[0], ra.maps.shape[1:3]  # [batch layer head query key]
    (4, torch.Size([2, 4]))
    """
    parts = []
    for rows in pairs.chunks(len(prompts), batch_size):
        chunk = prompts[rows]
        targets = [tasks.answer_token(model, p.answer) for p in chunk]
        parts.append(reversed_attention(model, [p.text for p in chunk], target_nll(targets)))
    return ReversedAttention.concat(parts)


def attention_patching(
    model: HookedModel,
    task: str | Task,
    shots: Validated[int] = 0,
    n_prompts: Validated[int] = 25,
    scales: Validated[Sequence[float]] = DEFAULT_SCALES,
    *,
    n_test: Validated[int] | None = None,
    seed: int = 42,
    progress: bool = True,
) -> PatchingResult:
    """Average RA over `n_prompts` training prompts, patch it into held-out prompts at each scale.

    Args:
        model: a TransformerLens model whose hook_pattern is live (checked).
        task: a task name from `ra_lens.tasks.available()` or a Task.
        shots: demonstrations per prompt (0 = zero-shot).
        n_prompts: training prompts whose maps are averaged (all of one token length).
        scales: patching scales; negative = the gradient-descent direction.
        n_test: cap on held-out prompts (default: the whole test split).

    The scale is chosen on validation prompts, not on the test prompts it is scored on: the
    training prompts not averaged (as many as the test prompts, at least `MIN_VALIDATION`), or,
    where too few are left, the first half of the held-out prompts, the second half testing.

    Returns:
        PatchingResult with top-1/2/3 accuracy per scale for RA and the forward baseline, on the
        test and the validation prompts; `.chosen(3)` the scale chosen on validation and its
        test accuracy.

    Raises:
        ValueError: shots < 0, n_prompts < 2, n_test < 1, no scales or a non-finite one.

    >>> import torch
    >>> from ra_lens.tasks import Task
    >>> toy = Task("toy", [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"),
    ...                    ("s", "the"), ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")])
    >>> result = attention_patching(model, toy, shots=1, n_prompts=4, scales=[0.0, -4.0],
    ...                             progress=False)
    >>> result.n_prompts, result.n_test, result.scales  # 2 held-out: 1 validates, 1 tests
    (4, 1, [0.0, -4.0])
    >>> result.n_validation, result.validation_from
    (1, 'held-out')
    >>> torch.equal(result.ra[0].ranks, result.unpatched.ranks)  # scale 0 adds nothing
    True
    >>> print(result.table())  # doctest: +ELLIPSIS
    toy, 1-shot: RA averaged over 4 training prompts, 1 test prompts; unpatched top-1 ...

    On the real model (minutes on a CPU; `DEFAULT_SCALES` has 26 scales):

    >>> result = attention_patching(ra_lens.load_model(), "antonym", shots=0)  # doctest: +SKIP
    """
    scales = _check_counts(shots, n_prompts, n_test, scales)
    seconds: dict[str, float] = {}
    name = task if isinstance(task, str) else task.name
    train, test = task_prompts(model, task, shots, seed=seed)
    train, unused = train[:n_prompts], train[n_prompts:]
    test = test if n_test is None else test[:n_test]
    if len(train) < 2:
        raise ValueError(f"only {len(train)} equal-length training prompts for {name!r}")
    validation, source = _validation_split(unused, test)
    if source == "held-out":
        validation, test = test[: len(test) // 2], test[len(test) // 2 :]
    with timed(seconds, "reversed_attention"):
        ra = mean_reversed_attention(model, train)
    hooks_for: dict[str, Callable[..., Any]] = {
        "ra": lambda s: attention_patch_hooks(ra, s, model=model),
        "forward": lambda s: forward_patch_hooks(ra, s, model=model),
    }
    with timed(seconds, "evaluate"):
        unpatched = evaluate(model, test, batch_size=32, by_length=True)
        results: dict[str, list[Accuracy]] = {}
        for scale in tqdm(list(scales), desc=f"{name} scales", disable=not progress):
            for method, make in hooks_for.items():
                hooks = make(float(scale))
                for split, prompts in (("", test), ("_validation", validation)):
                    accuracy = evaluate(
                        model, prompts, fwd_hooks=hooks, batch_size=32, by_length=True
                    )
                    results.setdefault(method + split, []).append(accuracy)
    return PatchingResult(
        task=name,
        shots=shots,
        scales=[float(s) for s in scales],
        ra=results["ra"],
        forward=results["forward"],
        unpatched=unpatched,
        n_prompts=len(train),
        n_test=len(test),
        seconds=seconds,
        ra_maps=ra,
        ra_validation=results["ra_validation"],
        forward_validation=results["forward_validation"],
        n_validation=len(validation),
        validation_from=source,
    )


#: Fewest training prompts left over (not averaged) that make the validation split; with fewer,
#: half of the held-out prompts validate and the other half test.
MIN_VALIDATION = 8


def _validation_split(unused: Sequence[Prompt], test: Sequence[Prompt]) -> tuple[list[Prompt], str]:
    """Where the patching scale is chosen: the training prompts not averaged into the RA (as
    many as the test prompts), or, with fewer than `MIN_VALIDATION` of those, the first half of
    the held-out prompts ("held-out": the caller keeps the second half as the test split)."""
    if len(unused) >= MIN_VALIDATION:
        return list(unused[: max(len(test), MIN_VALIDATION)]), "unused training prompts"
    if len(test) < 2:
        raise ValueError(
            f"{len(unused)} training prompts left for validation and {len(test)} held-out: "
            "lower n_prompts or raise n_test, so that the scale is chosen on other prompts "
            "than those it is scored on"
        )
    return [], "held-out"


def _check_counts(shots: Any, n_prompts: Any, n_test: Any, scales: Any) -> list[float]:
    """The scales as floats, after refusing counts that would silently use fewer prompts
    (a negative slice end drops prompts from the end) and an empty or non-finite sweep."""
    check_count(shots, "shots", minimum=0)
    check_count(n_prompts, "n_prompts", 2, why="RA is averaged over the training prompts")
    if n_test is not None:
        check_count(n_test, "n_test", why="or None: all")
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence):
        raise ValueError(f"scales must be a sequence of numbers, e.g. [-4.0, 0.0], got {scales!r}")
    bad = [s for s in scales if isinstance(s, bool) or not isinstance(s, (int, float))]
    if not scales or bad or not all(math.isfinite(s) for s in scales):
        raise ValueError(
            f"scales must be a non-empty sequence of finite numbers, e.g. [-4.0, 0.0], got "
            f"{list(scales)!r}"
        )
    return [float(s) for s in scales]
