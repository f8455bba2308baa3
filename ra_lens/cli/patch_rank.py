"""`ra-lens patch` and `ra-lens rank`: the paper's ICL experiments (attention patching, head
ranking) on one or several tasks."""

from __future__ import annotations

import argparse
from typing import Any

from ra_lens.cli._shared import emit_json, floats, load_model_of, say

#: What the columns of `ra-lens rank`'s table mean: printed under it and in `ra-lens rank --help`.
RANK_LEGEND = """\
columns: AUC@1 / AUC@3 = area under top-1 / top-3 accuracy against the fraction of heads kept,
  keeping the heads the ranking puts first and ablating the rest (higher: the ranking finds the
  heads the task needs); rev@1 = the same top-1 area keeping the heads it puts LAST (lower:
  better); RA - it [95 % CI] = RA's AUC@1 minus this ranking's, with a paired bootstrap
  interval over the test prompts (> 0: RA better); seconds = time to compute the ranking;
  rho(RA) [95 % CI] = Spearman correlation of its head scores with RA's; top10 = share of its
  10 first heads that RA's 10 first heads share."""

#: How long `ra-lens rank` takes, for its --help.
RANK_TIME = """\
time: SmolLM2-135M on a CPU with the defaults (all rankings, 25 prompts, every test prompt):
  over 15 minutes per task (measured once, not on every machine); --rankings ra,... and
  --n-test shorten it; a tiny-* model takes seconds."""


def run_patch(args: argparse.Namespace) -> int:
    from ra_lens.experiments import DEFAULT_SCALES, attention_patching

    scales = DEFAULT_SCALES if args.scales is None else floats(args.scales)
    model = load_model_of(args)
    result = attention_patching(
        model,
        args.task,
        shots=args.shots,
        n_prompts=args.n_prompts,
        scales=scales,
        n_test=args.n_test,
    )
    say(args, result.table())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / patch_out_files(args)[0]
        result.plot(save=path)
        say(args, f"wrote {path}")
    emit_json(args.json, result.to_dict())
    return 0


def run_rank(args: argparse.Namespace) -> int:
    from ra_lens.experiments import head_ranking
    from ra_lens.experiments.head_ranking import check_rankings

    extra: dict[str, Any] = {} if args.fractions is None else {"fractions": floats(args.fractions)}
    if args.rankings is not None:
        extra["rankings"] = check_rankings(
            [n.strip() for n in args.rankings.split(",") if n.strip()]
        )
    model = load_model_of(args)
    results = []
    for task in args.task:
        result = head_ranking(
            model,
            task,
            shots=args.shots,
            n_prompts=args.n_prompts,
            n_test=args.n_test,
            ablation=args.ablation,
            **extra,
        )
        results.append(result)
        say(args, result.table())
        say(args, RANK_LEGEND)
        if args.out is not None:
            out = args.out if len(args.task) == 1 else args.out / task  # as rank_out_files
            for path in result.plots(out):
                say(args, f"wrote {path}")
    # One task: its result as before; several: {"results": [one per task]}.
    dicts = [r.to_dict() for r in results]
    emit_json(args.json, dicts[0] if len(dicts) == 1 else {"results": dicts})
    return 0


def patch_out_files(args: argparse.Namespace) -> tuple[str, ...]:
    """The file `ra-lens patch` writes under --out."""
    return (f"patching_{args.task}_{args.shots}shot.png",)


def rank_out_files(args: argparse.Namespace) -> tuple[str, ...]:
    """The files `ra-lens rank` writes under --out: one task's plots in it, several tasks' each
    in a folder of its own."""
    from ra_lens.experiments.head_ranking import PLOT_FILES

    if len(args.task) == 1:
        return PLOT_FILES
    return tuple(f"{task}/{name}" for task in args.task for name in PLOT_FILES)
