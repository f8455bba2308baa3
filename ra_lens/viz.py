"""Figures for Reversed Attention: head-norm heat maps, RA beside forward maps, patching sweeps.

Every function builds a fresh `matplotlib.figure.Figure` (never through pyplot, so nothing is
shown, nothing global is left open and nothing of the caller's is closed) and returns it; pass
`save="path.png"` (any format matplotlib knows: png, pdf, svg) to also write it to disk.
`circuitsvis_heads` returns a self-contained HTML string instead (its JavaScript is inlined, so
the page works offline).

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`):

    >>> from ra_lens import metrics, reversed_attention, viz
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> fig = viz.head_norm_heatmaps(ra)  # save="norms.png" writes it too
    >>> page = viz.circuitsvis_heads(ra, ra.top_heads(4))  # save="heads.html"

Colour conventions: signed maps (RA and its other conventions) use a diverging map centred at
zero with a symmetric range (vmin == -vmax); forward patterns use a sequential map on [0, 1].
The causal (upper) triangle is masked and drawn grey.
"""

from __future__ import annotations

import html as _html
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float
from matplotlib.axes import Axes
from matplotlib.colors import Colormap
from matplotlib.figure import Figure, SubFigure
from matplotlib.ticker import FuncFormatter, ScalarFormatter
from torch import Tensor

from ra_lens.attribution import AttentionAttribution
from ra_lens.ranking import trapezoid_auc
from ra_lens.result import ReversedAttention

__all__ = [
    "ablation_curves",
    "circuitsvis_heads",
    "head_norm_heatmaps",
    "head_pair",
    "ranking_maps",
    "scale_sweep",
    "top_heads_grid",
    "trapezoid_auc",
    "visible_token",
]

PathLike = str | Path
ArrayLike = Tensor | np.ndarray | Sequence[float]

SIGNED_CMAP = "RdBu_r"
PATTERN_CMAP = "Blues"
NORM_CMAP = "viridis"
MASK_COLOR = "#d9d9d9"
# circuitsvis draws positive values blue by default; match RdBu_r (positive = red) instead
_POSITIVE, _NEGATIVE = "#b2182b", "#2166ac"

_MAP_NAMES = {"qk": "Reversed Attention", "scores": "dL/d scores", "pattern": "dL/dA"}
_SHORT_NAMES = {"qk": "RA", "scores": "dL/dS", "pattern": "dL/dA"}


# --------------------------------------------------------------------------------------------
# small helpers


def visible_token(token: str) -> str:
    """A token as drawn on an axis: newlines, tabs and carriage returns escaped ("\\n"), and a
    token made only of spaces (or empty) drawn as open-box characters, so no label is blank.

    >>> print(visible_token("\\n"), visible_token("  "), visible_token(" cat"))
    \\n ␣␣  cat
    """
    out = token.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    out = out.replace("\r", "\\r")
    if out.strip(" ") == "":
        out = "\u2423" * max(len(out), 1)
    return out


def _numpy(values: ArrayLike) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


def _new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, save: PathLike | None) -> Figure:
    if save is not None:
        path = Path(save)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.1)
    return fig


def _cmap(name: str) -> Colormap:
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad=MASK_COLOR)


def _symmetric_limit(values: np.ndarray) -> float:
    """max |value| over the finite entries, never 0 (a zero range breaks the colour norm)."""
    finite = np.abs(values[np.isfinite(values)]) if values.size else np.zeros(0)
    limit = float(finite.max()) if finite.size else 0.0
    return limit if limit > 0 else 1.0


def _tick_step(n: int, most: int) -> int:
    return max(1, math.ceil(n / most))


def _token_fontsize(n: int) -> float:
    """Font size for n token labels: 9pt for short prompts, shrinking to 5pt past ~40 tokens."""
    return float(min(9.0, max(5.0, 11.0 - 0.15 * n)))


def _map_name(ra: ReversedAttention) -> str:
    return _MAP_NAMES.get(ra.convention, ra.convention)


def _layer_index(ra: ReversedAttention, layer: int) -> int:
    if layer not in ra.layers:
        raise ValueError(f"layer {layer} was not computed: this result holds layers {ra.layers}")
    return ra.layers.index(layer)


def _labels(ra: ReversedAttention, prompt: int) -> list[str]:
    n = int(ra.lengths[prompt])
    if ra.str_tokens is None:
        return [str(t) for t in ra.tokens[prompt, :n].tolist()]
    return [visible_token(t) for t in ra.str_tokens[prompt][:n]]


def _head_matrices(
    ra: ReversedAttention, layer: int, head: int, prompt: int
) -> tuple[np.ndarray, np.ndarray]:
    """(RA, forward pattern) of one head for one prompt, each [query key], cut to its length."""
    if ra.maps is None or ra.patterns is None:
        raise ValueError("maps were not kept: call reversed_attention(..., keep='maps')")
    li, n = _layer_index(ra, layer), int(ra.lengths[prompt])
    return (
        _numpy(ra.maps[prompt, li, head, :n, :n]),
        _numpy(ra.patterns[prompt, li, head, :n, :n]),
    )


def _mask_upper(matrix: np.ndarray) -> np.ma.MaskedArray:
    n = matrix.shape[-1]
    return np.ma.masked_array(matrix, mask=np.triu(np.ones((n, n), dtype=bool), k=1))


def _token_panel(
    ax: Axes, matrix: np.ndarray, labels: list[str], title: str, *, signed: bool
) -> Any:
    """One attention-shaped map with token labels; returns the image (for a colorbar)."""
    if signed:
        limit = _symmetric_limit(np.tril(matrix))
        image = ax.imshow(
            _mask_upper(matrix),
            cmap=_cmap(SIGNED_CMAP),
            vmin=-limit,
            vmax=limit,
            interpolation="nearest",
        )
    else:
        image = ax.imshow(
            _mask_upper(matrix),
            cmap=_cmap(PATTERN_CMAP),
            vmin=0.0,
            vmax=1.0,
            interpolation="nearest",
        )
    n, size = len(labels), _token_fontsize(len(labels))
    ax.set_xticks(range(n), labels, rotation=90, fontsize=size)
    ax.set_yticks(range(n), labels, fontsize=size)
    ax.tick_params(length=2, pad=1)
    ax.set_xlabel("key (attended-to token)", fontsize=8)
    ax.set_ylabel("query (attending token)", fontsize=8)
    ax.set_title(title, fontsize=10)
    return image


def _colorbar(fig: Figure | SubFigure, image: Any, ax: Axes, label: str | None = None) -> None:
    bar = fig.colorbar(image, ax=ax, shrink=0.8, pad=0.02)
    bar.ax.tick_params(labelsize=7)
    if isinstance(bar.formatter, ScalarFormatter):
        bar.formatter.set_powerlimits((-2, 3))
        bar.formatter.set_useOffset(False)
    if label:
        bar.set_label(label, fontsize=8)


def _head_title(ra: ReversedAttention, layer: int, head: int, prompt: int) -> str:
    norm = float(ra.norms[prompt, _layer_index(ra, layer), head])
    return f"L{layer} H{head}  |{_SHORT_NAMES.get(ra.convention, 'RA')}|={norm:.3g}"


def _draw_pair(
    fig: Figure | SubFigure, ra: ReversedAttention, layer: int, head: int, prompt: int
) -> None:
    ra_map, pattern = _head_matrices(ra, layer, head, prompt)
    labels = _labels(ra, prompt)
    ax_fwd, ax_ra = fig.subplots(1, 2)
    image = _token_panel(ax_fwd, pattern, labels, "Forward attention", signed=False)
    _colorbar(fig, image, ax_fwd)
    image = _token_panel(ax_ra, ra_map, labels, _map_name(ra), signed=True)
    _colorbar(fig, image, ax_ra)
    fig.suptitle(_head_title(ra, layer, head, prompt), fontsize=12)


def _pair_size(labels: list[str]) -> tuple[float, float]:
    """(width, height) in inches of one forward/RA row: square maps plus room for the labels."""
    n = len(labels)
    side = min(10.0, max(3.6, 0.2 * n + 1.8))
    longest = max((len(label) for label in labels), default=1)
    label = min(2.5, longest * _token_fontsize(n) * 0.62 / 72) + 0.35
    return 2 * (side + label + 0.9), side + label + 0.95


def _layer_head_panel(
    fig: Figure,
    ax: Axes,
    values: np.ndarray,
    layers: Sequence[int],
    title: str,
    *,
    signed: bool | None = None,
    cmap: str | None = None,
) -> None:
    """One layer x head heat map: layers down the y axis (first layer at the top), heads on x."""
    n_layers, n_heads = values.shape
    if signed is None:
        finite = values[np.isfinite(values)]
        signed = bool(finite.size and finite.min() < 0 < finite.max())
    if signed:
        limit = _symmetric_limit(values)
        image = ax.imshow(
            values,
            cmap=_cmap(cmap or SIGNED_CMAP),
            vmin=-limit,
            vmax=limit,
            aspect="auto",
            interpolation="nearest",
        )
    else:
        image = ax.imshow(
            values, cmap=_cmap(cmap or NORM_CMAP), aspect="auto", interpolation="nearest"
        )
    step = _tick_step(n_layers, 40)
    ax.set_yticks(range(0, n_layers, step), [str(layers[i]) for i in range(0, n_layers, step)])
    step = _tick_step(n_heads, 32)
    ax.set_xticks(range(0, n_heads, step), [str(h) for h in range(0, n_heads, step)])
    ax.tick_params(labelsize=7 if max(n_layers, n_heads) > 16 else 8, length=2)
    ax.set_xlabel("head", fontsize=9)
    ax.set_ylabel("layer", fontsize=9)
    ax.set_title(title, fontsize=10)
    _colorbar(fig, image, ax)


def _layer_head_figure(n_panels: int, n_layers: int, n_heads: int) -> Figure:
    width = n_panels * min(8.0, max(3.4, 0.32 * n_heads + 1.9))
    height = min(14.0, max(2.6, 0.24 * n_layers + 1.3))
    return _new_figure(width, height)


# --------------------------------------------------------------------------------------------
# public figures


def head_norm_heatmaps(ra: ReversedAttention, *, save: PathLike | None = None) -> Figure:
    """RA norms beside forward-pattern norms, as two layer x head heat maps.

    Args:
        ra: a result; uses `ra.head_norms()` and `ra.forward_norms()`, each Float[layer head]
            (mean over prompts of each head's Frobenius norm), and `ra.layers` for the y labels.
        save: optional path to write the figure to.

    Returns:
        Figure with two axes titled "Reversed Attention norm" and "Forward attention norm"
        (layer 0 at the top, heads along x, one colorbar each).

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> [ax.get_title() for ax in head_norm_heatmaps(ra).axes[:2]]
    ['Reversed Attention norm', 'Forward attention norm']
    """
    ra_norms, fwd_norms = _numpy(ra.head_norms()), _numpy(ra.forward_norms())
    fig = _layer_head_figure(2, *ra_norms.shape)
    ax_ra, ax_fwd = fig.subplots(1, 2)
    _layer_head_panel(fig, ax_ra, ra_norms, ra.layers, f"{_map_name(ra)} norm", signed=False)
    _layer_head_panel(fig, ax_fwd, fwd_norms, ra.layers, "Forward attention norm", signed=False)
    return _save(fig, save)


def head_pair(
    ra: ReversedAttention,
    layer: int,
    head: int,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> Figure:
    """One head's forward attention pattern beside its Reversed Attention map, for one prompt.

    Args:
        ra: a result computed with keep="maps" (needs `ra.maps` and `ra.patterns`,
            Float[batch layer head query key]).
        layer: the model's layer index (one of `ra.layers`); head: head index.
        prompt: which prompt of the batch; maps are cut to its real length.
        save: optional path to write the figure to.

    Returns:
        Figure with axes [forward, RA]: tokens on both axes (queries down y, keys along x),
        the RA on a diverging colour map with vmin == -vmax, the upper triangle masked (grey),
        and the suptitle "L{layer} H{head}  |RA|={norm of this prompt's map}".

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> forward, reversed_ = head_pair(ra, 1, 2).axes[:2]
    >>> forward.images[0].get_clim(), reversed_.get_title()
    ((0.0, 1.0), 'Reversed Attention')
    >>> low, high = reversed_.images[0].get_clim()
    >>> low == -high == -ra.head(1, 2).abs().max().item()  # centred at zero
    True
    """
    width, height = _pair_size(_labels(ra, prompt))
    fig = _new_figure(width, height)
    _draw_pair(fig, ra, layer, head, prompt)
    return _save(fig, save)


def top_heads_grid(
    ra: ReversedAttention,
    k: int = 4,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> Figure:
    """Forward/RA pairs (as in `head_pair`) for the k heads with the largest mean RA norm.

    Heads are ranked by `ra.top_heads(k)` (mean over prompts); each row is drawn for `prompt`
    and titled "L{layer} H{head}  |RA|={norm of that prompt's map}".

    Returns:
        Figure with one subfigure per head (`fig.subfigs`), each with axes [forward, RA].

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> len(top_heads_grid(ra, k=2).subfigs)
    2
    """
    heads = ra.top_heads(k)
    width, height = _pair_size(_labels(ra, prompt))
    fig = _new_figure(width, len(heads) * height)
    rows = fig.subfigures(len(heads), 1, squeeze=False)[:, 0]
    for row, (layer, head, _) in zip(rows, heads, strict=True):
        _draw_pair(row, ra, layer, head, prompt)
    return _save(fig, save)


def _parse_heads(ra: ReversedAttention, heads: Sequence[Sequence[Any]] | None) -> list[tuple]:
    if heads is None:
        heads = ra.top_heads(8)
    return [(int(h[0]), int(h[1])) for h in heads]


def _circuitsvis_section(rendered: Any) -> tuple[str, str, str] | None:
    """Split circuitsvis' offline HTML into (div id, inlined JS bundle, render call).

    Returns None if the layout is not the one of circuitsvis 1.43 (`render_local`)."""
    src: str = rendered.local_src
    found = re.match(r'\s*<div id="([^"]+)"[^>]*/?>\s*<script[^>]*>', src)
    call_at, end = src.rfind("CircuitsVis.render("), src.rfind("</script>")
    if not found or call_at < found.end() or end < call_at:
        return None
    return found.group(1), src[found.end() : call_at], src[call_at:end]


def circuitsvis_heads(
    ra: ReversedAttention,
    heads: Sequence[Sequence[Any]] | None = None,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> str:
    """An interactive circuitsvis page: the heads' RA maps, then the same heads' forward patterns.

    Args:
        ra: a result computed with keep="maps".
        heads: (layer, head) pairs (the (layer, head, norm) triples of `ra.top_heads` work too);
            default: the 8 heads with the largest RA norm.
        prompt: which prompt of the batch; maps are cut to its real length.
        save: optional path of an .html file to write.

    Returns:
        One self-contained HTML page (circuitsvis' JavaScript bundle inlined once, so it renders
        offline). RA is shown signed with a symmetric range shared by all the chosen heads
        (min_value == -max_value == -max|RA|); forward patterns on [0, 1]. Heads are named
        "L{layer}H{head} RA" and "L{layer}H{head} attn".

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> page = circuitsvis_heads(ra, [(1, 2), (0, 3)])
    >>> page.startswith("<!DOCTYPE html>"), "L1H2 RA" in page, "L0H3 attn" in page
    (True, True, True)
    """
    chosen = _parse_heads(ra, heads)
    if not chosen:
        raise ValueError("no heads to show")
    pairs = [_head_matrices(ra, layer, head, prompt) for layer, head in chosen]
    ra_maps = np.stack([np.tril(p[0]) for p in pairs])
    patterns = np.stack([p[1] for p in pairs])
    limit = _symmetric_limit(ra_maps)
    labels = _labels(ra, prompt)
    short = _SHORT_NAMES.get(ra.convention, "RA")
    sections = [
        (
            f"{_map_name(ra)} (signed; red = raising this logit raises the metric, blue = "
            f"lowers it; colour range \u00b1{limit:.3g})",
            _signed_heads(ra_maps, labels, [f"L{la}H{h} {short}" for la, h in chosen], limit),
        ),
        (
            "Forward attention (range 0 to 1)",
            _forward_heads(patterns, labels, chosen),
        ),
    ]
    return _write_page(_assemble_page(sections, ra, prompt), save)


def _signed_heads(values: Any, labels: list[str], names: list[str], limit: float) -> Any:
    """A circuitsvis view of signed maps, blue to red, symmetric range +-limit."""
    from circuitsvis.attention import attention_heads

    return attention_heads(
        values.tolist(),
        labels,
        attention_head_names=names,
        max_value=limit,
        min_value=-limit,
        negative_color=_NEGATIVE,
        positive_color=_POSITIVE,
        mask_upper_tri=True,
    )


def _forward_heads(patterns: Any, labels: list[str], chosen: Any) -> Any:
    """A circuitsvis view of forward patterns, range 0 to 1."""
    from circuitsvis.attention import attention_heads

    return attention_heads(
        patterns.tolist(),
        labels,
        attention_head_names=[f"L{la}H{h} attn" for la, h in chosen],
        max_value=1.0,
        min_value=0.0,
        mask_upper_tri=True,
    )


def _write_page(page: str, save: str | Path | None) -> str:
    if save is not None:
        path = Path(save)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    return page


def _assemble_page(
    sections: list[tuple[str, Any]], ra: ReversedAttention | AttentionAttribution, prompt: int
) -> str:
    text = "".join(ra.str_tokens[prompt][: int(ra.lengths[prompt])]) if ra.str_tokens else ""
    head = (
        '<!DOCTYPE html>\n<html>\n<head><meta charset="utf-8"><title>ra-lens heads</title></head>'
        '\n<body style="font-family: sans-serif">\n'
        f"<p><b>Prompt {prompt}:</b> <code>{_html.escape(text)}</code></p>\n"
    )
    parts = [_circuitsvis_section(rendered) for _, rendered in sections]
    if any(p is None for p in parts):
        # Unknown circuitsvis layout: concatenate its own offline HTML (bundle repeated).
        body = "".join(
            f"<h3>{_html.escape(title)}</h3>\n<div>{r.local_src}</div>\n" for title, r in sections
        )
        return head + body + "</body>\n</html>\n"
    divs, calls = [], []
    for (title, _), (div_id, _, call) in zip(sections, parts, strict=True):
        divs.append(f'<h3>{_html.escape(title)}</h3>\n<div id="{div_id}"></div>\n')
        calls.append(call.strip().replace("</", "<\\/"))
    bundle = parts[0][1]
    script = '<script type="module">\n' + bundle + "\n" + "\n".join(calls) + "\n</script>\n"
    return head + "".join(divs) + script + "</body>\n</html>\n"


def _check_curves(x: np.ndarray, curves: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    if not curves:
        raise ValueError("no curves to plot")
    out = {}
    for name, values in curves.items():
        ys = _numpy(values).reshape(-1)
        if ys.shape != x.shape:
            raise ValueError(f"curve {name!r} has {ys.size} values for {x.size} x values")
        out[name] = ys
    return out


def _legend(ax: Axes, n: int) -> None:
    ax.legend(fontsize=8 if n <= 6 else 7, frameon=True, framealpha=0.85)


def scale_sweep(
    scales: ArrayLike,
    curves: Mapping[str, ArrayLike],
    *,
    ylabel: str = "top-3 accuracy",
    baseline: float | None = None,
    title: str = "Attention patching: A' = A + scale \u00b7 map",
    linthresh: float = 1.0,
    save: PathLike | None = None,
) -> Figure:
    """Accuracy against patching scale, one line per method.

    Args:
        scales: Float[scale], the patching scales eta (e.g. 3 ... -120; any order).
        curves: method name -> Float[scale] values aligned with `scales`
            (e.g. {"RA top-1": [...], "forward top-3": [...]}).
        ylabel: y axis label; baseline: the unpatched value, drawn as a dashed horizontal line.
        title: axis title; linthresh: half-width of the linear part of the symlog x axis.
        save: optional path to write the figure to.

    Returns:
        Figure with one axis; x on a symlog scale, linear on [-linthresh, linthresh] (so 0,
        +-0.1 and -120 are all visible) and logarithmic beyond; negative scales (the
        gradient-descent direction) to the left.

    >>> fig = scale_sweep([-16.0, -4.0, 0.0, 4.0], {"RA top-3": [0.5, 0.3, 0.1, 0.0]}, baseline=0.1)
    >>> fig.axes[0].get_xscale()
    'symlog'
    """
    xs = _numpy(scales).reshape(-1)
    data = _check_curves(xs, curves)
    order = np.argsort(xs, kind="stable")
    fig = _new_figure(7.0, 4.2)
    ax = fig.subplots()
    for i, (name, ys) in enumerate(data.items()):
        # Baselines often sit on top of each other (e.g. all at zero): vary the dash and marker.
        style = ("-", ":", "-.")[i % 3]  # "--" is kept for the unpatched baseline
        marker = ("o", "s", "^", "D")[i % 4]
        ax.plot(
            xs[order], ys[order], linestyle=style, marker=marker, markersize=3.5, linewidth=1.5,
            label=name,
        )  # fmt: skip
    if baseline is not None:
        ax.axhline(
            float(baseline),
            color="0.35",
            linestyle="--",
            linewidth=1.2,
            label=f"unpatched ({float(baseline):.3g})",
        )
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.axvline(0.0, color="0.8", linewidth=0.8, zorder=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("patching scale (symlog; negative = gradient-descent direction)", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=11)
    _legend(ax, len(data) + (baseline is not None))
    return _save(fig, save)


def ablation_curves(
    fractions: ArrayLike,
    curves: Mapping[str, ArrayLike],
    *,
    ylabel: str = "top-1 accuracy",
    title: str = "Keeping only the top-ranked heads",
    save: PathLike | None = None,
) -> Figure:
    """Accuracy against the fraction of heads kept (the others zeroed), one line per ranking.

    Args:
        fractions: Float[step], fractions of heads kept, each in [0, 1] (e.g. 0, 0.1, ..., 1).
        curves: ranking name -> Float[step] accuracies aligned with `fractions`.
        ylabel: y axis label; save: optional path to write the figure to.

    Returns:
        Figure with one axis; legend labels read "{name} (AUC={trapezoid_auc:.3f})".

    >>> fig = ablation_curves([0.0, 0.5, 1.0], {"ra": [0.0, 1.0, 1.0]})
    >>> [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    ['ra (AUC=0.750)']
    """
    xs = _numpy(fractions).reshape(-1)
    if xs.size and (xs.min() < 0 or xs.max() > 1):
        raise ValueError(f"fractions must lie in [0, 1], got {xs.min()} to {xs.max()}")
    data = _check_curves(xs, curves)
    order = np.argsort(xs, kind="stable")
    fig = _new_figure(6.5, 4.2)
    ax = fig.subplots()
    for name, ys in data.items():
        auc = trapezoid_auc(xs, ys)
        ax.plot(
            xs[order],
            ys[order],
            marker="o",
            markersize=3.5,
            linewidth=1.5,
            label=f"{name} (AUC={auc:.3f})",
        )
    ax.set_xlim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("fraction of heads kept", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=11)
    _legend(ax, len(data))
    return _save(fig, save)


def ranking_maps(
    rankings: Mapping[str, Float[Tensor, "layer head"] | np.ndarray],
    *,
    layers: Sequence[int] | None = None,
    save: PathLike | None = None,
) -> Figure:
    """Several per-head scores or rankings as layer x head heat maps side by side.

    Args:
        rankings: name -> Float[layer head] (all of one shape); each panel gets its own colour
            scale: diverging and symmetric about 0 when the values have both signs (e.g. causal
            mediation effects), sequential otherwise.
        layers: y labels (default 0 .. layer-1; pass `ra.layers` for a subset of layers).
        save: optional path to write the figure to.

    Returns:
        Figure with one axis per ranking, titled with its name, layer 0 at the top.

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> fig = ranking_maps({"ra": ra.head_norms(), "forward": ra.forward_norms()})
    >>> [ax.get_title() for ax in fig.axes[:2]]
    ['ra', 'forward']
    """
    if not rankings:
        raise ValueError("no rankings to plot")
    values = {name: _numpy(v) for name, v in rankings.items()}
    shapes = {v.shape for v in values.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"rankings must all be [layer, head] of one shape, got {shapes}")
    n_layers, n_heads = next(iter(shapes))
    labels = list(layers) if layers is not None else list(range(n_layers))
    if len(labels) != n_layers:
        raise ValueError(f"{len(labels)} layer labels for {n_layers} layers")
    fig = _layer_head_figure(len(values), n_layers, n_heads)
    axes = fig.subplots(1, len(values), squeeze=False)[0]
    for ax, (name, grid) in zip(axes, values.items(), strict=True):
        _layer_head_panel(fig, ax, grid, labels, name)
    return _save(fig, save)


# --------------------------------------------------------------------------------------------
# query/key/pattern attribution (ra_lens.attribution)

_KIND_TITLES = {
    "query": "query nodes",
    "key": "key nodes (per key/value head)",
    "pattern": "pattern",
}


def attribution_heatmaps(att: Any, *, save: PathLike | None = None) -> Figure:
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
    fig = _layer_head_figure(len(kinds), n_layers, att.n_heads)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        title = f"{_KIND_TITLES[kind]}\n{att.method}, {att.direction}"
        _layer_head_panel(fig, ax, _numpy(att.scores[kind]), att.layers, title, signed=True)
        if kind == "key":
            ax.set_xlabel("key/value head", fontsize=9)
    return _save(fig, save)


def attribution_edges_page(
    att: Any,
    heads: Sequence[Sequence[Any]] | None = None,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> str:
    """An offline circuitsvis page of edge maps R * (A_other - A) for chosen heads, then their
    forward patterns on the patched run.

    Args:
        att: an AttentionAttribution.
        heads: (layer, head) pairs (`att.top_heads(k, "pattern")` triples work); default: the 8 heads
            with the largest |pattern| score.
        prompt: which pair of the batch.
        save: optional .html path.

    >>> from ra_lens import attention_attribution, metrics
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> att = attention_attribution(model, clean, corrupted, metrics.logit_diff([294], [52]))
    >>> page = attribution_edges_page(att, att.top_heads(2, node="pattern"))
    >>> page.startswith("<!DOCTYPE html>"), "Edges R * (A_other - A)" in page
    (True, True)
    """

    chosen = [(int(h[0]), int(h[1])) for h in (heads or att.top_heads(8, node="pattern"))]
    if not chosen:
        raise ValueError("no heads to show")
    n = int(att.lengths[prompt])
    idx = [att.layers.index(la) for la, _ in chosen]
    edges = np.stack([_numpy(att.edges[prompt, i, h, :n, :n]) for i, (_, h) in zip(idx, chosen)])
    patterns = np.stack(
        [_numpy(att.patterns[prompt, i, h, :n, :n]) for i, (_, h) in zip(idx, chosen)]
    )
    limit = _symmetric_limit(edges)
    labels = (
        [visible_token(t) for t in att.str_tokens[prompt][:n]]
        if att.str_tokens
        else [str(t) for t in att.tokens[prompt, :n].tolist()]
    )
    sections = [
        (
            f"Edges R * (A_other - A), {att.direction}: the metric change each query-key link "
            f"carries (red = raises it; colour range \u00b1{limit:.3g})",
            _signed_heads(
                np.tril(edges),
                labels,
                [f"L{la}H{h} edges" for la, h in chosen],
                limit,
            ),
        ),
        (
            "Forward attention of the patched run (range 0 to 1)",
            _forward_heads(patterns, labels, chosen),
        ),
    ]
    return _write_page(_assemble_page(sections, att, prompt), save)


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
    fig = _new_figure(3.6 * len(kinds), 3.4)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    markers = ["o", "x", "s", "^"]
    for ax, kind in zip(axes, kinds, strict=True):
        x = _numpy(truth[kind]).ravel()
        limit = _symmetric_limit(x)
        ax.plot([-limit, limit], [-limit, limit], color="#888888", lw=0.8, ls="--", zorder=0)
        for i, (name, table) in enumerate(estimates.items()):
            y = _numpy(table[kind]).ravel()
            r = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")
            ax.scatter(x, y, s=12, marker=markers[i % 4], alpha=0.7, label=f"{name} (r={r:.2f})")
        ax.set_xlabel("activation patching (true effect)", fontsize=9)
        ax.set_ylabel("estimate", fontsize=9)
        ax.set_title(kind, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7, loc="upper left")
    return _save(fig, save)


def top_edges_on_tokens(
    att: Any, k: int = 8, *, prompt: int = 0, save: PathLike | None = None
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
    labels = (
        [visible_token(t) for t in att.str_tokens[prompt][:n]]
        if att.str_tokens
        else [str(t) for t in att.tokens[prompt, :n].tolist()]
    )
    top = att.top_edges(k, batch=prompt)
    fig = _new_figure(max(7.0, 0.55 * n + 3.0), 3.6)
    ax = fig.subplots()
    for i, label in enumerate(labels):
        ax.text(i, -0.05, label, ha="right", va="top", fontsize=_token_fontsize(n), rotation=45)
    largest = max((abs(e[4]) for e in top), default=1.0) or 1.0
    peak_top = 0.0
    for rank, (layer, head, query, key, value) in enumerate(top, 1):
        color = _POSITIVE if value > 0 else _NEGATIVE
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(f"top {len(top)} edges R * (A_other - A), {att.direction}", fontsize=10)
    return _save(fig, save)
