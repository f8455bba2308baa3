"""`ra-lens attribute`: query/key/pattern attribution of every head for one clean/corrupted pair
(from the flags) or many (--task / --pairs)."""

from __future__ import annotations

import argparse
from typing import Any

from ra_lens.cli._shared import emit_json, load_model_of, say
from ra_lens.cli.pairs import circuit_pairs, read_pairs
from ra_lens.types import HookedModel

#: What `ra-lens attribute --out DIR` writes into DIR.
OUT_FILES = ("attribution_heatmaps.png", "top_edges.png", "edges.html")


def _first_token(model: HookedModel, text: str, flag: str) -> int:
    ids = model.to_tokens(text, prepend_bos=False)[0].tolist()
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens: give a one-token answer")
    return int(ids[0])


def _run_attribute(args: argparse.Namespace) -> int:
    from ra_lens import attention_attribution
    from ra_lens.timing import timed

    file_pairs = _attribute_source(args)
    seconds: dict[str, float] = {}
    with timed(seconds, "load_model"):
        model = load_model_of(args)
    clean, corrupted, metric, metric_name = _attribute_inputs(args, model, file_pairs)
    with timed(seconds, "attention_attribution"):
        att = attention_attribution(
            model, clean, corrupted, metric, method=args.method, direction=args.direction
        )
    att = _with_clean_labels(att, model, clean)

    report = att.to_dict(k=args.top)
    say(args, f"model: {args.model}   metric: {metric_name}   {args.method}, {args.direction}")
    clean_value, corrupted_value = (
        float(att.clean_metric.mean()),
        float(att.corrupted_metric.mean()),
    )
    n_pairs = len(att.clean_metric)
    say(
        args,
        f"{metric_name}: clean {clean_value:.3f}, corrupted {corrupted_value:.3f}"
        + (f" (means over {n_pairs} pairs)" if n_pairs > 1 else ""),
    )
    say(args, "\n" + att.table(args.top))
    say(args, f"\nall heads in {seconds['attention_attribution']:.2f} s")

    files = []
    if args.out is not None:
        from ra_lens import viz

        args.out.mkdir(parents=True, exist_ok=True)
        files = [args.out / n for n in OUT_FILES]
        viz.attribution_heatmaps(att, save=files[0])
        viz.top_edges_on_tokens(att, k=min(8, args.top), save=files[1])
        heads = list(dict.fromkeys((e["layer"], e["head"]) for e in report["top_edges"]))[:8]
        viz.attribution_edges_page(att, heads, save=files[2])
        for f in files:
            say(args, f"wrote {f}")
    emit_json(
        args.json,
        {
            "model": args.model,
            "clean": args.clean,
            "corrupted": args.corrupted,
            "target": args.target,
            "wrong": args.wrong,
            "task": args.task,
            "pairs_file": None if args.pairs is None else str(args.pairs),
            "n_pairs": n_pairs,
            "metric": metric_name,
            **report,
            # Means over the pairs: the run that was patched (denoise: the corrupted one) and
            # the other one.
            "metric_patched_run": corrupted_value if att.direction == "denoise" else clean_value,
            "metric_other_run": clean_value if att.direction == "denoise" else corrupted_value,
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0


def _attribute_source(args: argparse.Namespace) -> list[Any]:
    """Check that `attribute` got one pair (--clean/--corrupted/--target) or many (--task or
    --pairs), not both; returns the pairs of --pairs (read before the model loads)."""
    one = [flag for flag in ("clean", "corrupted", "target", "wrong") if getattr(args, flag)]
    if args.task is not None or args.pairs is not None:
        if one:
            raise ValueError(
                f"--{one[0]} with --task/--pairs: give one pair (--clean, --corrupted, --target) "
                "or many (--task or --pairs), not both"
            )
        return [] if args.pairs is None else read_pairs(args.pairs)
    missing = [f"--{flag}" for flag in ("clean", "corrupted", "target") if not getattr(args, flag)]
    if missing:
        raise ValueError(
            f"missing {', '.join(missing)}: give --clean, --corrupted and --target (one pair), "
            "or --task / --pairs FILE.jsonl (many pairs)"
        )
    return []


def _attribute_inputs(
    args: argparse.Namespace, model: HookedModel, file_pairs: list[Any]
) -> tuple[Any, Any, Any, str]:
    """(clean, corrupted, metric, metric name) for `attribute`: one pair from the flags, or the
    pairs of --task / --pairs with logit(answer) - logit(wrong) per pair."""
    from ra_lens import metrics, to_batch
    from ra_lens.tasks import ioi

    metric: metrics.Metric
    if args.clean is None:
        clean, corrupted, metric = ioi.paired_batch(model, circuit_pairs(args, model, file_pairs))
        return clean, corrupted, metric, "logit(answer) - logit(wrong)"
    target = _first_token(model, args.target, "--target")
    if args.wrong is None:
        metric, metric_name = metrics.target_prob([target]), f"p({args.target!r})"
    else:
        wrong = _first_token(model, args.wrong, "--wrong")
        metric = metrics.logit_diff([target], [wrong])
        metric_name = f"logit({args.target!r}) - logit({args.wrong!r})"
    return to_batch(model, args.clean), to_batch(model, args.corrupted), metric, metric_name


def _with_clean_labels(att: Any, model: HookedModel, clean: Any) -> Any:
    """The attribution with the CLEAN prompts' tokens as labels: under "denoise" the patched run
    is the corrupted one, whose tokens (" Bob" where the clean prompt has " John") would name
    the edges of an analysis of the clean behaviour."""
    import dataclasses

    from ra_lens import capture

    return dataclasses.replace(att, str_tokens=capture.str_tokens(model, clean))
