"""The head-ranking study: every ranking, on several ICL tasks and shot counts, under zero and mean
ablation, with bootstrap intervals, timings and ablation-curve plots, in one JSON file.

    python -m ra_lens.experiments.ranking_study --quick                 # tiny model, seconds
    python -m ra_lens.experiments.ranking_study --json docs/results/ranking_study.json \\
        --plots docs/figures/ranking --cells antonym:5,capitalize:0 --n-prompts 12

Each (task, shots) cell computes the protocol-independent rankings once and reuses them for the
second protocol (`head_ranking(..., reuse=...)`); causal mediation and its first-order estimate are
recomputed per protocol because they ablate the way the curves do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from ra_lens import ranking as rk
from ra_lens import tasks
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.experiments.head_ranking import (
    RANKINGS,
    HeadRankingResult,
    check_rankings,
    head_ranking,
)
from ra_lens.files import load_json, write_file
from ra_lens.progress import tqdm
from ra_lens.record import Recorded
from ra_lens.tasks import Task
from ra_lens.timing import timed

#: The study's tasks and shot counts (issue 14).
STUDY_TASKS: tuple[str, ...] = ("antonym", "capitalize", "country-capital", "present-past")
STUDY_SHOTS: tuple[int, ...] = (0, 5)
ABLATIONS: tuple[str, ...] = ("zero", "mean")
#: The speed claim: the causal-mediation scan must stay at least this many times slower than RA.
SPEED_GOAL = 50.0

# A toy task for --quick on `toy_models.tiny_model`: inputs and answers that are one token (with
# their leading space) for the tiny tokenizer, so every n-shot prompt has the same length.
QUICK_TASK = Task(
    name="toy",
    pairs=[
        ("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"), ("s", "the"),
        ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "Ital"), ("is", "Fran"), ("to", "Jo"),
        ("an", "b"), ("and", "c"), ("the", "d"), ("cap", "l"), ("Par", "o"), ("Mar", "s"),
        ("Ital", "t"), ("Fran", "F"),
    ],
)  # fmt: skip
#: --quick's cells and settings: the fewest prompts, resamples and fractions that still run every
#: path (a fraction inside (0, 1) with unequal trapezoid widths, both protocols, labels or none).
QUICK_CELLS: tuple[tuple[Task, int], ...] = ((QUICK_TASK, 0), (QUICK_TASK, 2))
QUICK_SETTINGS: dict[str, Any] = {
    "n_prompts": 4,
    "n_boot": 50,
    "n_means": 20,
    "fractions": (0.0, 0.25, 1.0),
}


@dataclass
class StudyResult(Recorded):
    """Every cell of the study (one `HeadRankingResult` per task x shots x ablation).

    Attributes:
        cells: the results, in the order they ran.
        config: the settings that ran (tasks, shots, ablations, rankings, prompts, ...).
        runtime_seconds: wall-clock seconds of the whole study, model loading excluded.
        skipped: "task k-shot: why" for cells that could not run (e.g. too few usable pairs).
    """

    cells: list[HeadRankingResult]
    config: dict[str, Any]
    runtime_seconds: float
    skipped: list[str] = field(default_factory=list)

    def speed_ratios(self) -> dict[str, float]:
        """ "task k-shot ablation" -> seconds(causal mediation) / seconds(RA), where both ran."""
        return {
            _label(c.task, c.shots, c.ablation): c.speedup()
            for c in self.cells
            if "causal_mediation" in c.seconds and "ra" in c.seconds
        }

    def goals(self) -> dict[str, Any]:
        """The speed claim, checked on the measured seconds (never asserted in tests)."""
        return _speed_goal(self.speed_ratios())

    def summary(self) -> list[dict[str, Any]]:
        """One row per cell and ranking: AUCs with intervals, the paired difference to RA,
        Spearman with RA, seconds and the number of test prompts."""
        rows = []
        for cell in self.cells:
            for name in cell.scores:
                ci = cell.intervals.get(name, {})
                rows.append(
                    {
                        "task": cell.task,
                        "shots": cell.shots,
                        "ablation": cell.ablation,
                        "ranking": name,
                        "n_test": cell.n_test,
                        "n_prompts": cell.n_prompts,
                        "auc": ci["auc"].to_dict() if "auc" in ci else None,
                        "auc_top3": ci["auc_top3"].to_dict() if "auc_top3" in ci else None,
                        "reverse_auc": ci["reverse_auc"].to_dict() if "reverse_auc" in ci else None,
                        "ra_minus_ranking_auc": (
                            ci["paired_vs_ra"].to_dict() if "paired_vs_ra" in ci else None
                        ),
                        "spearman_with_ra": ci["spearman"].to_dict() if "spearman" in ci else None,
                        "seconds": cell.seconds.get(name),
                    }
                )
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "runtime_seconds": self.runtime_seconds,
            "goals": self.goals(),
            "skipped": list(self.skipped),
            "summary": self.summary(),
            "cells": [cell.to_dict() for cell in self.cells],
        }

    def table(self) -> str:
        """Every cell's table, then the runtime and the speed goal."""
        parts = [cell.table() for cell in self.cells]
        goals = self.goals()
        worst = goals["cm_over_ra_speed_ratio_min"]
        parts.append(
            f"study runtime {self.runtime_seconds:.0f} s; causal mediation / RA seconds >= "
            f"{SPEED_GOAL:.0f}: "
            + ("n/a" if worst is None else f"min {worst:.0f}x, met: {worst >= SPEED_GOAL}")
        )
        parts += [f"skipped: {why}" for why in self.skipped]
        return "\n\n".join(parts)

    def plots(self, out_dir: str | Path) -> list[Path]:
        """One figure per cell, `{task}_{shots}shot_{ablation}.png`: top-1 accuracy against the
        fraction of heads kept, top heads kept (left) and bottom heads kept (right)."""
        from matplotlib.figure import Figure

        from ra_lens.viz import save_figure

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for cell in self.cells:
            fig = Figure(figsize=(12, 4.4), layout="constrained")
            axes = fig.subplots(1, 2, sharey=True)
            for ax, curves, title in (
                (axes[0], cell.curves, "keeping the top-ranked heads"),
                (axes[1], cell.reverse_curves, "keeping the bottom-ranked heads"),
            ):
                for i, (name, curve) in enumerate(curves.items()):
                    ax.plot(
                        curve.fractions,
                        curve.top1,
                        label=f"{name} ({curve.auc:.3f})",
                        linestyle=("-", "--", ":", "-.")[i % 4],
                        marker="os^vD<>ph*x"[i % 11],
                        markersize=3.5,
                        linewidth=2.2 if name in ("ra", "causal_mediation") else 1.2,
                    )
                ax.set_title(title)
                ax.set_xlabel("fraction of heads kept")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7, loc="upper left", title="ranking (AUC top-1)")
            axes[0].set_ylabel("top-1 accuracy")
            fig.suptitle(
                f"{cell.task}, {cell.shots}-shot, {cell.ablation} ablation "
                f"({cell.n_test} test prompts, rankings from {cell.n_prompts})"
            )
            path = out / f"{cell.task}_{cell.shots}shot_{cell.ablation}.png"
            save_figure(fig, path)
            paths.append(path)
        return paths


def _speed_goal(ratios: dict[str, float]) -> dict[str, Any]:
    worst = min(ratios.values()) if ratios else None
    return {
        "cm_over_ra_speed_ratio_min": worst,
        "cm_over_ra_speed_ratio_goal": SPEED_GOAL,
        "cm_over_ra_speed_ratio_met": None if worst is None else worst >= SPEED_GOAL,
        "cm_over_ra_speed_ratio": ratios,
    }


def merge_saved(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One study from saved studies that ran side by side (e.g. one process per cell).

    The settings must agree except for the cells; the speed goal is recomputed from every cell's
    seconds; `runtime_seconds` is the longest part's (they ran at the same time) and
    `runtime_seconds_parts` keeps each part's.
    """
    if not parts:
        raise ValueError("merge_saved needs at least one saved study")
    base = {k: v for k, v in parts[0]["config"].items() if k != "cells"}
    for part in parts[1:]:
        other = {k: v for k, v in part["config"].items() if k != "cells"}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise ValueError(f"saved studies ran with different settings ({', '.join(diff)})")
    cells = [cell for part in parts for cell in part["cells"]]
    labels = [_label(c["task"], c["shots"], c["ablation"]) for c in cells]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"saved studies repeat the cells {', '.join(repeated)}: merge each cell once"
        )
    ratios = {
        _label(c["task"], c["shots"], c["ablation"]): c["seconds"]["causal_mediation"]
        / max(c["seconds"]["ra"], 1e-12)
        for c in cells
        if "causal_mediation" in c["seconds"] and "ra" in c["seconds"]
    }
    return {
        "config": {**base, "cells": [cell for part in parts for cell in part["config"]["cells"]]},
        "runtime_seconds": max(part["runtime_seconds"] for part in parts),
        "runtime_seconds_parts": [part["runtime_seconds"] for part in parts],
        "goals": _speed_goal(ratios),
        "skipped": [why for part in parts for why in part["skipped"]],
        "summary": [row for part in parts for row in part["summary"]],
        "cells": cells,
    }


def markdown_summary(data: dict[str, Any]) -> str:
    """A markdown table from a saved study (`StudyResult.to_dict()` or its JSON): one row per
    task x shots x ablation x ranking with the top-1 AUC and its 95% interval, the reverse AUC,
    AUC(RA) - AUC(ranking) with its paired interval, Spearman with RA and seconds."""

    def ci(entry: dict[str, Any] | None) -> str:
        if not entry or entry["estimate"] is None:
            return "-"
        return f"{entry['estimate']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    lines = [
        "| task | shots | ablation | n test | ranking | AUC top-1 [95% CI] | reverse AUC | "
        "AUC(RA) - AUC(it) [95% CI] | Spearman with RA [95% CI] | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["summary"]:
        reverse = row["reverse_auc"]["estimate"] if row["reverse_auc"] else float("nan")
        lines.append(
            f"| {row['task']} | {row['shots']} | {row['ablation']} | {row['n_test']} | "
            f"{row['ranking']} | {ci(row['auc'])} | {reverse:.3f} | "
            f"{ci(row['ra_minus_ranking_auc'])} | {ci(row['spearman_with_ra'])} | "
            f"{row['seconds']:.1f} |"
        )
    return "\n".join(lines)


def _label(task: str, shots: int, ablation: str) -> str:
    return f"{task} {shots}-shot {ablation}"


def ranking_study(
    model: HookedModel,
    *,
    cells: Sequence[tuple[str | Task, int]] | None = None,
    ablations: Sequence[str] = ABLATIONS,
    rankings: Sequence[str] = tuple(RANKINGS),
    n_prompts: Validated[int] = 25,
    n_test: Validated[int] | None = None,
    fractions: Sequence[float] = rk.DENSE_FRACTIONS,
    n_boot: Validated[int] = 1000,
    batch_size: Validated[int] = 8,
    eval_batch_size: Validated[int] = 16,
    n_means: Validated[int] = 100,
    seed: int = 42,
    progress: bool = True,
    on_cell: Callable[[StudyResult], None] | None = None,
) -> StudyResult:
    """Run `head_ranking` on every (task, shots) cell under every ablation protocol.

    Args:
        model: a TransformerLens model.
        cells: (task, shots) pairs; default every STUDY_TASKS x STUDY_SHOTS.
        ablations: "zero" and/or "mean".
        rankings: names in `experiments.head_ranking.RANKINGS`.
        n_prompts, n_test, fractions, n_boot, batch_size, eval_batch_size, n_means, seed: as in
            `head_ranking` (batch_size also batches causal mediation's prompts).
        on_cell: called with the partial result after every cell (e.g. to save it as it goes).

    Returns:
        StudyResult (`.to_dict()`, `.save(path)`, `.table()`, `.plots(out_dir)`).
    """
    names = check_rankings(rankings)
    # head_ranking's settings, the same for every cell (and recorded in that order)
    options: dict[str, Any] = {
        "n_prompts": n_prompts,
        "n_test": n_test,
        "fractions": list(fractions),
        "n_boot": n_boot,
        "batch_size": batch_size,
        "eval_batch_size": eval_batch_size,
        "n_means": n_means,
        "seed": seed,
    }
    for what in ("n_prompts", "n_boot", "batch_size", "eval_batch_size", "n_means"):
        check_count(options[what], what)
    if n_test is not None:
        check_count(n_test, "n_test")
    bad = [a for a in ablations if a not in ABLATIONS]
    if bad or not ablations:
        raise ValueError(f"unknown ablation {bad[0] if bad else None!r}: choose from {ABLATIONS}")
    cells = [(t, s) for t in STUDY_TASKS for s in STUDY_SHOTS] if cells is None else list(cells)
    config = {
        "cells": [[t if isinstance(t, str) else t.name, s] for t, s in cells],
        "ablations": list(ablations),
        "rankings": names,
        **options,
    }
    result = StudyResult([], config, 0.0)
    seconds: dict[str, float] = {"runtime": 0.0}
    for task, shots in tqdm(cells, desc="ranking study", disable=not progress):
        reuse = None
        for ablation in ablations:
            # The study's runtime: its cells, not the caller's on_cell (which writes files).
            with timed(seconds, "runtime"):
                try:
                    cell = head_ranking(
                        model, task, shots, rankings=names, reuse=reuse, progress=progress,
                        ablation=ablation,  # type: ignore[arg-type]
                        **options,
                    )  # fmt: skip
                except ValueError as error:  # too few usable pairs for this tokenizer, and so on
                    name = task if isinstance(task, str) else task.name
                    result.skipped.append(f"{name} {shots}-shot {ablation}: {error}")
                    cell = None
            result.runtime_seconds = seconds["runtime"]
            if cell is None:
                break
            reuse = reuse or cell
            result.cells.append(cell)
            if on_cell is not None:
                on_cell(result)
    return result


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _cells(text: str, quick: bool = False) -> list[tuple[str | Task, int]]:
    """TASK:SHOTS,... as (task, shots); under --quick the toy task is called "toy"."""
    known: dict[str, str | Task] = {name: name for name in tasks.available()}
    if quick:
        known = {QUICK_TASK.name: QUICK_TASK, **known}
    out: list[tuple[str | Task, int]] = []
    for part in text.split(","):
        name, _, shots = part.strip().partition(":")
        if name not in known or not shots.strip().isdigit():
            raise ValueError(
                f"bad cell {part!r}: write TASK:SHOTS, e.g. antonym:5, with TASK one of "
                f"{', '.join(known)}"
            )
        out.append((known[name], int(shots)))
    return out


def _load_saved(path: Path) -> dict[str, Any]:
    """A saved study, or a ValueError naming the file and what is wrong with it."""
    data = load_json(path, "a saved study (a file ranking_study --json wrote)")
    needed = ("config", "runtime_seconds", "skipped", "summary", "cells")
    missing = [key for key in needed if not isinstance(data, dict) or key not in data]
    if missing:
        raise ValueError(
            f"{path} is not a saved ranking study (no {', '.join(missing)}): pass a file "
            "ranking_study --json wrote"
        )
    return cast("dict[str, Any]", data)  # a dict: checked above


def _check_device(device: str) -> None:
    """A device torch knows, and CUDA only where it is available."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here, use --device cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ranking_study", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model and toy task (cell toy:SHOTS), few prompts and resamples: seconds; "
        "flags given explicitly win over its settings",
    )
    parser.add_argument("--model", default="smollm2-135m", help="model for load_model")
    parser.add_argument(
        "--cells",
        default=None,
        help="TASK:SHOTS,... (default: antonym, capitalize, country-capital, present-past x 0, 5)",
    )
    parser.add_argument("--ablations", default="zero,mean", help="zero,mean (both)")
    parser.add_argument("--rankings", default=",".join(RANKINGS), help="comma-separated names")
    parser.add_argument("--n-prompts", type=int, default=None, help="ranking prompts per cell (25)")
    parser.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    parser.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples (1000)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per ranking pass (8)")
    parser.add_argument(
        "--eval-batch-size", type=int, default=16, help="test prompts per forward pass (16)"
    )
    parser.add_argument(
        "--n-means", type=int, default=None, help="held-out prompts for mean ablation (100)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write plots here")
    parser.add_argument(
        "--markdown", type=Path, default=None, metavar="JSON", help="print a saved study's table"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge saved studies (run side by side) into --json",
    )
    args = parser.parse_args(argv)
    try:
        if args.markdown is not None:
            print(_markdown(_load_saved(args.markdown), args.markdown))
            return 0
        if args.merge is not None:
            return _merge(args.merge, args.json)
        result, save = _run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ranking_study: error: {error}", file=sys.stderr)
        return 2
    save(result)
    print(result.table())
    if args.plots is not None:
        for path in result.plots(args.plots):
            print(f"wrote {path}")
    if not result.cells:
        print(f"ranking_study: error: no cell ran ({len(result.skipped)} failed)", file=sys.stderr)
        return 1
    return 0


def _markdown(data: dict[str, Any], path: Path) -> str:
    try:
        return markdown_summary(data)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: a summary row lacks {error}: not a ranking study") from None


def _merge(paths: list[Path], json_path: str | None) -> int:
    if not json_path:
        raise ValueError("--merge needs --json FILE for the merged study")
    if Path(json_path).is_dir():
        raise ValueError(f"--json {json_path} is a folder: give the merged study's file name")
    resolved = [path.resolve() for path in paths]
    repeated = sorted({str(p) for p in paths if resolved.count(p.resolve()) > 1})
    if repeated:
        raise ValueError(f"--merge lists {', '.join(repeated)} more than once: give each once")
    merged = merge_saved([_load_saved(path) for path in paths])
    text = _markdown(merged, Path(json_path))
    write_file(json_path, json.dumps(merged, indent=1, allow_nan=False), make_folders=True)
    print(text)
    return 0


def _run(args: argparse.Namespace) -> tuple[StudyResult, Callable[[StudyResult], None]]:
    """The study the flags ask for; explicit flags win over --quick's settings."""
    _check_device(args.device)
    rankings = [n.strip() for n in args.rankings.split(",") if n.strip()]
    ablations = [a.strip() for a in args.ablations.split(",") if a.strip()]
    settings: dict[str, Any] = dict(QUICK_SETTINGS) if args.quick else {}
    given = {"n_prompts": args.n_prompts, "n_boot": args.n_boot, "n_means": args.n_means}
    settings.update({key: value for key, value in given.items() if value is not None})
    # Refuse bad settings before loading the model (minutes for the real one), not after.
    for key in ("n_prompts", "n_boot", "n_means"):
        if key in settings:
            check_count(settings[key], key)
    check_count(args.batch_size, "batch_size")
    check_count(args.eval_batch_size, "eval_batch_size")
    if args.n_test is not None:
        check_count(args.n_test, "n_test")
    check_rankings(rankings)
    cells: list[tuple[str | Task, int]] | None = (
        _cells(args.cells, args.quick) if args.cells else None
    )
    if args.quick:
        from ra_lens.models import bridge_available
        from ra_lens.toy_models import tiny_model

        arch: Literal["llama", "hooked"] = "llama" if bridge_available() else "hooked"  # TL 2.x
        model, model_name = tiny_model(arch, n_layers=2), f"tiny-{arch} (random weights)"
        model = model.to(args.device)
        cells = cells or list(QUICK_CELLS)
    else:
        from ra_lens.models import load_model

        model, model_name = load_model(args.model, device=args.device), args.model

    def save(partial: StudyResult) -> None:
        partial.config["model"] = model_name
        partial.config["device"] = _device_name(args.device)
        if args.json:
            partial.save(args.json)

    result = ranking_study(
        model,
        cells=cells,
        ablations=ablations,
        rankings=rankings,
        n_test=args.n_test,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        on_cell=save,
        **settings,
    )
    return result, save


if __name__ == "__main__":
    sys.exit(main())
