"""Long-context retrieval: which heads does the loss want to read a fact from thousands of tokens back?

    python benchmarks/long_context_demo.py --tokens 4000 --out demo_out/long_context

A fact ("the secret meeting will take place in Oslo") sits early in a few thousand tokens of
filler about office life; the question comes at the end and the metric is -log p(" Oslo") at the
last position. reversed_attention(..., memory="layerwise", keep="rows") gives each head's RA row
at that position (one float per key): the heads whose loss rows put the most |RA| on the fact's
tokens are the ones gradient descent would tune to read it. Whether the model answers is checked,
not assumed: greedy next token and p(" Oslo") with the fact, and with the fact naming Kyoto instead
(if the model read the fact, p(" Oslo") drops there and " Kyoto" rises).

Writes <out>/long_context.json (answers, top heads, their top keys), <out>/long_context.png (the
RA rows of the top heads over positions, the fact shaded, and a zoom on it) and the rows
themselves (<out>/long_context_rows.safetensors, ReversedAttention.load).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from ra_lens import load_model, reversed_attention
from ra_lens.files import write_file
from ra_lens.metrics import target_nll

FACT = " Important: the secret meeting will take place in {city}."
QUESTION = (
    "\n\nQuestion: In which city will the secret meeting take place?\n"
    "Answer: The secret meeting will take place in"
)
_SUBJECTS = ["The manager", "A new intern", "The finance team", "Our supplier", "The printer"]
_VERBS = ["reviewed", "postponed", "discussed", "approved", "forgot about", "rewrote"]
_OBJECTS = [
    "the quarterly budget",
    "the parking schedule",
    "the coffee order",
    "the safety training",
    "the holiday rota",
    "the client report",
]
_TAILS = ["before lunch.", "again on Tuesday.", "without much fuss.", "after a long call."]


def filler(n_sentences: int, seed: int = 0) -> str:
    """Bland office sentences without any place name, varied so nothing is a copy task."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(n_sentences)
    )


def build(model: Any, n_tokens: int, city: str, fact_after: int) -> tuple[torch.Tensor, list[int]]:
    """Token ids (BOS, ~fact_after tokens of filler, the fact, filler, the question) of about
    n_tokens, and the positions of the fact's tokens."""
    before = model.to_tokens(filler(fact_after // 9 + 1, seed=1))[:, : fact_after + 1]
    fact = model.to_tokens(FACT.format(city=city), prepend_bos=False)
    question = model.to_tokens(QUESTION, prepend_bos=False)
    rest = n_tokens - before.shape[1] - fact.shape[1] - question.shape[1]
    after = model.to_tokens(" " + filler(rest // 9 + 2, seed=2), prepend_bos=False)[:, :rest]
    tokens = torch.cat([before, fact, after, question], dim=1)
    start = before.shape[1]
    return tokens, list(range(start, start + fact.shape[1]))


def answer(model: Any, tokens: torch.Tensor, targets: dict[str, int]) -> dict[str, Any]:
    """Greedy next token and the probability of each candidate at the last position."""
    with torch.no_grad():
        last = model(tokens)[0, -1].float().softmax(-1)
    top = int(last.argmax())
    return {
        "greedy": model.tokenizer.decode([top]),
        **{f"p({word!r})": float(last[i]) for word, i in targets.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--fact-after", type=int, default=200, help="filler tokens before it")
    parser.add_argument("--top", type=int, default=4, help="heads to plot")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("demo_out/long_context"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(device="cpu")
    targets = {" Oslo": model.to_single_token(" Oslo"), " Kyoto": model.to_single_token(" Kyoto")}
    tokens, fact_pos = build(model, args.tokens, "Oslo", args.fact_after)
    control, _ = build(model, args.tokens, "Kyoto", args.fact_after)
    print(f"{tokens.shape[1]} tokens, fact at positions {fact_pos[0]}..{fact_pos[-1]}", flush=True)
    answers = {"fact Oslo": answer(model, tokens, targets)}
    answers["fact Kyoto (control)"] = answer(model, control, targets)
    print(answers, flush=True)

    start = time.perf_counter()
    ra = reversed_attention(
        model, tokens, target_nll([targets[" Oslo"]]), memory="layerwise", keep="rows"
    )
    seconds = time.perf_counter() - start
    rows = ra.rows[0].abs()  # [layer, head, key]
    on_fact = rows[:, :, fact_pos].sum(-1) / rows.sum(-1).clamp_min(1e-30)
    order = on_fact.flatten().argsort(descending=True)[: args.top].tolist()
    n_heads = rows.shape[1]
    heads = [(i // n_heads, i % n_heads) for i in order]
    # Where the fact's share would be with |RA| spread evenly over the row.
    uniform_share = len(fact_pos) / tokens.shape[1]
    city = fact_pos[-2]  # the " Oslo" token, before the final "."
    report = {
        "n_tokens": tokens.shape[1],
        "fact_positions": fact_pos,
        "fact_tokens": [ra.str_tokens[0][p] for p in fact_pos],
        "answers": answers,
        "nll_oslo": float(ra.metric_values[0]),
        "ra_seconds_wall": seconds,
        "uniform_share_of_fact": uniform_share,
        "top_heads_by_share_of_row_on_fact": [
            {
                "layer": layer,
                "head": head,
                "share_on_fact": float(on_fact[layer, head]),
                "ra_at_city_token": float(ra.rows[0, layer, head, city]),
                "top_keys": ra.top_keys(layer, head, k=5),
            }
            for layer, head in heads
        ],
        "top_heads_by_norm": ra.top_heads(5),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_file(args.out / "long_context.json", json.dumps(report, indent=1))
    ra.save(args.out / "long_context_rows.safetensors")  # rows: layers x heads x pos floats
    plot(ra, heads, fact_pos, args.out / "long_context.png")
    print(json.dumps(report["top_heads_by_share_of_row_on_fact"], indent=1))


def plot(ra: Any, heads: list[tuple[int, int]], fact_pos: list[int], path: Path) -> None:
    """Left: each head's whole row (the fact shaded); right: a zoom on the fact's tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(heads),
        2,
        figsize=(13, 2.3 * len(heads)),
        sharex="col",
        gridspec_kw={"width_ratios": [3, 1.3]},
        squeeze=False,
    )
    lo, hi = max(fact_pos[0] - 6, 0), fact_pos[-1] + 7
    for (whole, zoom), (layer, head) in zip(axes, heads):
        row = ra.rows[0, ra.layers.index(layer), head].numpy()
        whole.axvspan(fact_pos[0] - 5, fact_pos[-1] + 5, color="orange", alpha=0.4, lw=0)
        whole.plot(row, lw=0.7, color="tab:blue")
        whole.axhline(0, color="grey", lw=0.5)
        whole.set_ylabel(f"L{layer}H{head}")
        zoom.axvspan(fact_pos[0] - 0.5, fact_pos[-1] + 0.5, color="orange", alpha=0.3, lw=0)
        zoom.bar(range(lo, hi), row[lo:hi], color="tab:blue")
        zoom.axhline(0, color="grey", lw=0.5)
    axes[0][0].set_title(
        "RA row at the question's last token, metric -log p(' Oslo'): negative = the loss wants "
        "more attention there"
    )
    axes[0][1].set_title("zoom: the fact (orange)")
    axes[-1][0].set_xlabel("key position")
    tokens = ra.str_tokens[0][lo:hi] if ra.str_tokens is not None else None
    if tokens is not None:
        axes[-1][1].set_xticks(range(lo, hi), tokens, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
