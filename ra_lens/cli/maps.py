"""`ra-lens maps`: Reversed Attention of every head for one prompt and target, as a table, plots
and a circuitsvis page."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ra_lens.cli._shared import emit_json, load_model_of, say

if TYPE_CHECKING:
    from torch import Tensor

    from ra_lens.capture import Batch
    from ra_lens.metrics import Metric

#: What `ra-lens maps --out DIR` writes into DIR.
OUT_FILES = ("head_norms.png", "top_heads.png", "reversed_attention.html")


def _run_maps(args: argparse.Namespace) -> int:
    import torch

    from ra_lens import metrics, reversed_attention, to_batch
    from ra_lens.timing import timed

    seconds: dict[str, float] = {}
    with timed(seconds, "load_model"):
        model = load_model_of(args)

    prompt_tokens = to_batch(model, args.prompt).tokens  # refuses text longer than n_ctx
    target_ids = model.to_tokens(args.target, prepend_bos=False)[0].tolist()
    if not target_ids:
        raise ValueError("--target is empty: give the text the model should produce")
    tokens: Batch | Tensor
    metric: Metric
    if args.completion:
        tokens, metric = metrics.completion(model, args.prompt, args.target)
    else:
        tokens, metric = prompt_tokens, metrics.target_nll([target_ids[0]])
    with timed(seconds, "reversed_attention"):
        ra = reversed_attention(model, tokens, metric, convention=args.convention)

    with torch.no_grad():
        probs = model(prompt_tokens)[0, -1].float().softmax(-1)
    top_p, top_ids = probs.topk(5)
    predictions = [
        {"token": model.tokenizer.decode([i]), "id": i, "prob": p}
        for i, p in zip(top_ids.tolist(), top_p.tolist())
    ]
    target_prob = float(probs[target_ids[0]])
    report = ra.to_dict(k=args.top)

    first = model.tokenizer.decode([target_ids[0]])
    say(args, f"model: {args.model}   prompt: {args.prompt!r}   target: {args.target!r}")
    say(
        args,
        f"metric: -log p({first!r}) = {report['metric']:.3f}"
        if not args.completion
        else f"metric: mean NLL of {args.target!r} = {report['metric']:.3f}",
    )
    say(
        args,
        "top predictions: "
        + ", ".join(f"{p['token']!r} {p['prob']:.1%}" for p in predictions)
        + f"   (target {first!r}: {target_prob:.1%})",
    )
    say(args, "\n" + ra.table(args.top))
    say(
        args,
        f"\nRA of {ra.norms.shape[1] * ra.norms.shape[2]} heads in "
        f"{seconds['reversed_attention']:.2f} s (one forward + one backward pass)",
    )

    files = []
    if args.out is not None:
        from ra_lens import viz

        args.out.mkdir(parents=True, exist_ok=True)
        files = [args.out / n for n in OUT_FILES]
        viz.head_norm_heatmaps(ra, save=files[0])
        viz.top_heads_grid(ra, k=min(4, args.top), save=files[1])
        viz.circuitsvis_heads(ra, ra.top_heads(min(8, args.top)), save=files[2])
        for f in files:
            say(args, f"wrote {f}")
    emit_json(
        args.json,
        {
            "model": args.model,
            "prompt": args.prompt,
            "target": args.target,
            **report,
            "target_prob": target_prob,
            "predictions": predictions,
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0
