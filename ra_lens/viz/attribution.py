"""Figures of query/key/pattern attribution (`ra_lens.attribution`): per-node scores as
layer x head heat maps, the strongest query-key edges as arcs over the tokens, and estimates
against a ground truth.

Each returns a fresh `matplotlib.figure.Figure`; `save=` also writes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from ra_lens.viz._base import (
    NEGATIVE,
    POSITIVE,
    ArrayLike,
    PathLike,
    as_numpy,
    attribution_colour_label,
    layer_head_figure,
    layer_head_panel,
    new_figure,
    save_figure,
    symmetric_limit,
    token_fontsize,
    token_labels,
)

# Results import their views; views name results for type hints only.
if TYPE_CHECKING:
    from ra_lens.attribution import AttentionAttribution


__all__ = ["attribution_heatmaps", "estimate_scatter", "top_edges_on_tokens"]


_KIND_TITLES = {
    "query": "query nodes",
    "key": "key nodes (per key/value head)",
    "pattern": "pattern",
}


def attribution_heatmaps(att: AttentionAttribution, *, save: PathLike | None = None) -> Figure:
    """Per-node estimates of an `AttentionAttribution` as layer x head heat maps, one per kind.

    Signed, centred at zero; key nodes are drawn per key/value head (fewer columns on GQA
    models). Titles give the method and direction.

    >>> from ra_lens import attention_attribution, metrics
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> att = attention_attribution(model, clean, corrupted, metrics.logit_diff([294], [52]))
    >>> [ax.get_title().splitlines()[0] for ax in attribution_heatmaps(att).axes[:3]]
    ['pattern', 'query nodes', 'key nodes (per key/value head)']
    """
    kinds = list(att.scores)
    n_layers = len(att.layers)
    fig = layer_head_figure(len(kinds), n_layers, att.n_heads)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        title = f"{_KIND_TITLES[kind]}\n{att.method}, {att.direction}"
        layer_head_panel(fig, ax, as_numpy(att.scores[kind]), att.layers, title, signed=True,
                          label=attribution_colour_label(att.direction))  # fmt: skip
        if kind == "key":
            ax.set_xlabel("key/value head", fontsize=9)
    return save_figure(fig, save)


def estimate_scatter(
    truth: Mapping[str, ArrayLike],
    estimates: Mapping[str, Mapping[str, ArrayLike]],
    *,
    save: PathLike | None = None,
) -> Figure:
    """Estimate against ground truth, one panel per node kind, one colour per estimate.

    Args:
        truth: kind -> true effects (any shape).
        estimates: estimate name -> kind -> values of the truth's shape.

    >>> truth = {"query": [0.1, -0.2, 0.3]}
    >>> fig = estimate_scatter(truth, {"linear": {"query": [0.2, -0.4, 0.6]}})
    >>> [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    ['linear (r=1.00)']
    """
    kinds = list(truth)
    fig = new_figure(3.6 * len(kinds), 3.4)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    markers = ["o", "x", "s", "^"]
    for ax, kind in zip(axes, kinds, strict=True):
        x = as_numpy(truth[kind]).ravel()
        limit = symmetric_limit(x)
        ax.plot([-limit, limit], [-limit, limit], color="#888888", lw=0.8, ls="--", zorder=0)
        for i, (name, table) in enumerate(estimates.items()):
            y = as_numpy(table[kind]).ravel()
            r = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")
            ax.scatter(x, y, s=12, marker=markers[i % 4], alpha=0.7, label=f"{name} (r={r:.2f})")
        ax.set_xlabel("activation patching (true effect)", fontsize=9)
        ax.set_ylabel("estimate", fontsize=9)
        ax.set_title(kind, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, save)


def top_edges_on_tokens(
    att: AttentionAttribution, k: int = 8, *, prompt: int = 0, save: PathLike | None = None
) -> Figure:
    """The k query-key links with the largest |R * (A_other - A)|, drawn as arcs over the tokens
    from key (left) to query (right); red raises the metric, blue lowers it, width ~ |value|.
    Each arc is numbered at its top; the legend names its head and value.

    >>> from ra_lens import attention_attribution, metrics
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> att = attention_attribution(model, clean, corrupted, metrics.logit_diff([294], [52]))
    >>> len(top_edges_on_tokens(att, k=3).axes[0].get_legend().get_texts())
    3
    """
    n = int(att.lengths[prompt])
    labels = token_labels(att, prompt)
    top = att.top_edges(k, batch=prompt)
    fig = new_figure(max(7.0, 0.55 * n + 3.0), 3.6)
    ax = fig.subplots()
    for i, label in enumerate(labels):
        ax.text(i, -0.05, label, ha="right", va="top", fontsize=token_fontsize(n), rotation=45)
    largest = max((abs(e[4]) for e in top), default=1.0) or 1.0
    peak_top = 0.0
    for rank, (layer, head, query, key, value) in enumerate(top, 1):
        color = POSITIVE if value > 0 else NEGATIVE
        x = np.linspace(key, query, 60)
        half = max((query - key) / 2, 0.5)
        height = 0.25 + 0.22 * math.sqrt(query - key) + 0.06 * rank
        y = height * (1 - ((x - (key + query) / 2) / half) ** 2).clip(0)
        peak_top = max(peak_top, height)
        ax.plot(x, y, color=color, lw=0.7 + 3.0 * abs(value) / largest, alpha=0.75,
                label=f"{rank}: L{layer}H{head} {labels[query]!s} \u2190 {labels[key]!s} {value:+.3g}")  # fmt: skip
        ax.text((key + query) / 2, height, str(rank), ha="center", va="bottom", fontsize=7,
                color=color)  # fmt: skip
    ax.set_xlim(-1.0, n)
    ax.set_ylim(-0.9, peak_top + 0.25)
    ax.axis("off")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              title=f"red: raises M, blue: lowers it\n(node moved {'corrupted -> clean' if att.direction == 'denoise' else 'clean -> corrupted'})",
              title_fontsize=7)  # fmt: skip
    ax.set_title(f"top {len(top)} edges R * (A_other - A), {att.direction}", fontsize=10)
    return save_figure(fig, save)
