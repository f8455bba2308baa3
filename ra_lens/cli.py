"""The `ra-lens` command: RA maps of a prompt, attention patching and head ranking on ICL tasks.

ra-lens maps --prompt "I like Italy and France. I visited the city of" --target " Florence"
ra-lens patch --task antonym --shots 0
ra-lens rank --task antonym --shots 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

MODEL_HELP = (
    "model: 'smollm2-135m' (default, embedded, offline), a hub name for users with a network, "
    "or 'tiny-gpt2' / 'tiny-llama' (random weights, for trying the tool in seconds)"
)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ra-lens {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ra-lens",
        description="Reversed Attention (dL/d(QK^T), Katz & Wolf 2025) for TransformerLens models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    maps = sub.add_parser(
        "maps",
        help="RA of every head for one prompt and target: table, heat maps, circuitsvis page",
        description="Compute Reversed Attention of every head for -log p(target | prompt), print "
        "the heads with the largest RA norm, and write plots and an HTML view.",
    )
    maps.add_argument("--prompt", required=True, help="the prompt text")
    maps.add_argument("--target", required=True, help="the target text, e.g. ' Florence'")
    maps.add_argument(
        "--completion",
        action="store_true",
        help="teacher-force the whole target (mean NLL of all its tokens) instead of its first token",
    )
    maps.add_argument("--convention", default="qk", choices=["qk", "scores", "pattern"])
    maps.add_argument("--top", type=int, default=10, metavar="K", help="heads in the table (10)")
    _common(maps)
    maps.set_defaults(run=_run_maps)

    patch = sub.add_parser(
        "patch",
        help="attention patching on an ICL task: accuracy against patching scale",
        description="Average RA over training prompts of an ICL task, add scale x mean RA to the "
        "attention of held-out prompts, and report top-1/3 accuracy per scale against the "
        "forward-pattern baseline.",
    )
    _task_args(patch)
    patch.add_argument("--shots", type=int, default=0, help="demonstrations per prompt (0)")
    patch.add_argument("--n-train", type=int, default=25, help="prompts whose RA is averaged (25)")
    patch.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    patch.add_argument(
        "--scales",
        default=None,
        help="comma-separated scales (default: the paper's grid, extended)",
    )
    _common(patch)
    patch.set_defaults(run=_run_patch)

    rank = sub.add_parser(
        "rank",
        help="rank heads by RA against causal mediation, activation and attribution patching",
        description="Rank attention heads for an ICL task by RA norm and by the baselines, then "
        "keep the top p% of heads (ablating the rest) and measure accuracy.",
    )
    rank.add_argument(
        "--task",
        required=True,
        action="append",
        help="ICL task (repeat for several), one of: " + ", ".join(_task_names()),
    )
    rank.add_argument(
        "--rankings",
        default=None,
        help="comma-separated rankings (default all): " + ", ".join(_ranking_names()),
    )
    rank.add_argument("--shots", type=int, default=5, help="demonstrations per prompt (5)")
    rank.add_argument("--n-prompts", type=int, default=25, help="prompts per ranking (25)")
    rank.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    rank.add_argument(
        "--ablation", default="zero", choices=["zero", "mean"], help="how heads are removed (zero)"
    )
    rank.add_argument(
        "--fractions", default=None, help="comma-separated fractions of heads kept (0,0.1,...,1)"
    )
    _common(rank)
    rank.set_defaults(run=_run_rank)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write plots here")
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="write machine-readable results ('-': stdout)"
    )


def _task_args(parser: argparse.ArgumentParser) -> None:
    from ra_lens import tasks

    parser.add_argument(
        "--task", required=True, help=f"ICL task, one of: {', '.join(tasks.available())}"
    )


def _load(name: str) -> Any:
    if name.startswith("tiny-"):
        from ra_lens.toy_models import tiny_model

        return tiny_model(name.removeprefix("tiny-"))  # type: ignore[arg-type]
    from ra_lens.models import load_model

    return load_model(name, device="cpu")


def _emit_json(target: str | None, payload: dict[str, Any]) -> None:
    if target is None:
        return
    text = json.dumps(payload, indent=2)
    if target == "-":
        print(text)
    else:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(text)


def _say(args: argparse.Namespace, message: str) -> None:
    # With --json - the JSON owns stdout; everything else goes to stderr.
    print(message, file=sys.stderr if args.json == "-" else sys.stdout)


def _run_maps(args: argparse.Namespace) -> int:
    import torch

    from ra_lens import metrics, reversed_attention

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    model = _load(args.model)
    seconds["load_model"] = time.perf_counter() - start

    prompt_tokens = model.to_tokens(args.prompt)
    target_ids = model.to_tokens(args.target, prepend_bos=False)[0].tolist()
    if not target_ids:
        raise ValueError("--target is empty: give the text the model should produce")
    if args.completion:
        tokens, metric = metrics.completion(model, args.prompt, args.target)
    else:
        tokens, metric = prompt_tokens, metrics.target_nll([target_ids[0]])
    start = time.perf_counter()
    ra = reversed_attention(model, tokens, metric, convention=args.convention)
    seconds["reversed_attention"] = time.perf_counter() - start

    with torch.no_grad():
        probs = model(prompt_tokens)[0, -1].float().softmax(-1)
    top_p, top_ids = probs.topk(5)
    predictions = [
        {"token": model.tokenizer.decode([i]), "id": i, "prob": p}
        for i, p in zip(top_ids.tolist(), top_p.tolist())
    ]
    target_prob = float(probs[target_ids[0]])
    forward = ra.forward_norms()
    top = [
        {
            "layer": la,
            "head": h,
            "ra_norm": n,
            "forward_norm": float(forward[ra.layers.index(la), h]),
        }
        for la, h, n in ra.top_heads(args.top)
    ]

    first = model.tokenizer.decode([target_ids[0]])
    _say(args, f"model: {args.model}   prompt: {args.prompt!r}   target: {args.target!r}")
    _say(
        args,
        f"metric: -log p({first!r}) = {float(ra.metric_values.sum()):.3f}"
        if not args.completion
        else f"metric: mean NLL of {args.target!r} = {float(ra.metric_values.sum()):.3f}",
    )
    _say(
        args,
        "top predictions: "
        + ", ".join(f"{p['token']!r} {p['prob']:.1%}" for p in predictions)
        + f"   (target {first!r}: {target_prob:.1%})",
    )
    _say(args, f"\n{'rank':>4}  {'layer':>5}  {'head':>4}  {'RA norm':>10}  {'forward norm':>12}")
    for i, row in enumerate(top, 1):
        _say(
            args,
            f"{i:>4}  {row['layer']:>5}  {row['head']:>4}  {row['ra_norm']:>10.5f}  "
            f"{row['forward_norm']:>12.4f}",
        )
    _say(
        args,
        f"\nRA of {ra.norms.shape[1] * ra.norms.shape[2]} heads in "
        f"{seconds['reversed_attention']:.2f} s (one forward + one backward pass)",
    )

    files = []
    if args.out is not None:
        from ra_lens import viz

        args.out.mkdir(parents=True, exist_ok=True)
        viz.head_norm_heatmaps(ra, save=args.out / "head_norms.png")
        viz.top_heads_grid(ra, k=min(4, args.top), save=args.out / "top_heads.png")
        viz.circuitsvis_heads(
            ra, ra.top_heads(min(8, args.top)), save=args.out / "reversed_attention.html"
        )
        files = [
            args.out / n for n in ("head_norms.png", "top_heads.png", "reversed_attention.html")
        ]
        for f in files:
            _say(args, f"wrote {f}")
    _emit_json(
        args.json,
        {
            "model": args.model,
            "prompt": args.prompt,
            "target": args.target,
            "convention": ra.convention,
            "metric": float(ra.metric_values.sum()),
            "target_prob": target_prob,
            "top_heads": top,
            "ra_norms": ra.head_norms().tolist(),
            "forward_norms": forward.tolist(),
            "layers": ra.layers,
            "predictions": predictions,
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0


def _run_patch(args: argparse.Namespace) -> int:
    from ra_lens.experiments import DEFAULT_SCALES, attention_patching

    scales = DEFAULT_SCALES if args.scales is None else _floats(args.scales)
    model = _load(args.model)
    result = attention_patching(
        model, args.task, shots=args.shots, n_train=args.n_train, scales=scales, n_test=args.n_test
    )
    _say(args, result.table())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"patching_{args.task}_{args.shots}shot.png"
        result.plot(save=path)
        _say(args, f"wrote {path}")
    _emit_json(args.json, result.to_dict())
    return 0


def _run_rank(args: argparse.Namespace) -> int:
    from ra_lens.experiments import head_ranking
    from ra_lens.experiments.ranking import check_rankings

    extra: dict[str, Any] = {} if args.fractions is None else {"fractions": _floats(args.fractions)}
    if args.rankings is not None:
        extra["rankings"] = check_rankings(
            [n.strip() for n in args.rankings.split(",") if n.strip()]
        )
    model = _load(args.model)
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
        _say(args, result.table())
        if args.out is not None:
            out = args.out if len(args.task) == 1 else args.out / task
            for path in result.plot(out):
                _say(args, f"wrote {path}")
    # One task: its result as before; several: {"results": [one per task]}.
    dicts = [r.to_dict() for r in results]
    _emit_json(args.json, dicts[0] if len(dicts) == 1 else {"results": dicts})
    return 0


def _task_names() -> list[str]:
    from ra_lens import tasks

    return tasks.available()


def _ranking_names() -> list[str]:
    from ra_lens.experiments.ranking import RANKINGS

    return list(RANKINGS)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
