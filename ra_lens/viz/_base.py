"""What every ra_lens figure shares: the colour conventions, new figures and saving, the
layer x head heat-map panel, colorbars, and reading token labels and maps out of a result.

Signed maps use a diverging map centred at zero with a symmetric range (vmin == -vmax), red
positive and blue negative; forward patterns use a sequential green map on [0, 1], so that no
colour of a pattern reads as a sign of RA beside it; masked cells (the causal upper triangle) are
grey. Every colorbar says what its colours mean (`ra_colour_label`, `attribution_colour_label`).

A private module: `viz` re-exports only `__all__`; the other names are the helpers its sibling
modules share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import Colormap
from matplotlib.figure import Figure, SubFigure
from matplotlib.ticker import ScalarFormatter
from torch import Tensor

# Results import their views; views name results for type hints only.
if TYPE_CHECKING:
    from ra_lens.attribution import AttentionAttribution
    from ra_lens.result import ReversedAttention


__all__ = ["save_figure", "visible_token"]

PathLike = str | Path
ArrayLike = Tensor | np.ndarray | Sequence[float]

SIGNED_CMAP = "RdBu_r"
# green: neither end of the diverging map (blue is RA < 0 there)
PATTERN_CMAP = "Greens"
NORM_CMAP = "viridis"
MASK_COLOR = "#d9d9d9"
# circuitsvis draws positive values blue by default; match RdBu_r (positive = red) instead
POSITIVE, NEGATIVE = "#b2182b", "#2166ac"

_MAP_NAMES = {"qk": "Reversed Attention", "scores": "dL/d scores", "pattern": "dL/dA"}
SHORT_NAMES = {"qk": "RA", "scores": "dL/dS", "pattern": "dL/dA"}
# What each convention differentiates the metric M by (paper-notes section 1: RA = dM/d(QK^T) =
# (dM/dS) / s, S = QK^T / s + mask the pre-softmax scores, A = softmax(S) the pattern).
_WITH_RESPECT_TO = {
    "qk": ("RA = dM/d(QK^T)", "query-key logit"),
    "scores": ("dM/dS", "pre-softmax score"),
    "pattern": ("dM/dA", "attention weight"),
}
PATTERN_LABEL = "attention weight A (0 to 1)"


def ra_colour_label(convention: str) -> str:
    """The colorbar label of a signed map in `convention`: what red and blue mean. M is the
    metric that was differentiated: for a loss (e.g. `metrics.target_nll`) red means the loss
    rises with the link, so gradient descent weakens it (the paper patches with eta < 0).

    >>> print(ra_colour_label("qk"))
    RA = dM/d(QK^T)
    red > 0: a larger query-key logit raises M
    blue < 0: it lowers M (M a loss: red = descent weakens the link)
    """
    name, what = _WITH_RESPECT_TO.get(convention, (convention, "entry"))
    return (
        f"{name}\nred > 0: a larger {what} raises M\n"
        "blue < 0: it lowers M (M a loss: red = descent weakens the link)"
    )


def attribution_colour_label(direction: str) -> str:
    """The colorbar label of attribution estimates M(patched) - M(run) for `direction`.

    >>> print(attribution_colour_label("denoise"))
    estimate of M(patched) - M
    red > 0: moving the node corrupted -> clean raises M
    """
    move = "corrupted -> clean" if direction == "denoise" else "clean -> corrupted"
    return f"estimate of M(patched) - M\nred > 0: moving the node {move} raises M"


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


def as_numpy(values: ArrayLike) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Figure, save: PathLike | None) -> Figure:
    """Write `fig` to `save` (format from the suffix: png, pdf, svg; missing folders created) when
    it is not None, as every figure of ra-lens does; returns `fig`."""
    if save is not None:
        path = Path(save)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.1)
    return fig


def colour_map(name: str) -> Colormap:
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad=MASK_COLOR)


def symmetric_limit(values: np.ndarray) -> float:
    """max |value| over the finite entries, never 0 (a zero range breaks the colour norm)."""
    finite = np.abs(values[np.isfinite(values)]) if values.size else np.zeros(0)
    limit = float(finite.max()) if finite.size else 0.0
    return limit if limit > 0 else 1.0


def _tick_step(n: int, most: int) -> int:
    return max(1, math.ceil(n / most))


def token_fontsize(n: int) -> float:
    """Font size for n token labels: 9pt for short prompts, shrinking to 5pt past ~40 tokens."""
    return float(min(9.0, max(5.0, 11.0 - 0.15 * n)))


def add_colorbar(fig: Figure | SubFigure, image: Any, ax: Axes, label: str | None = None) -> None:
    bar = fig.colorbar(image, ax=ax, shrink=0.8, pad=0.02)
    bar.ax.tick_params(labelsize=7)
    if isinstance(bar.formatter, ScalarFormatter):
        bar.formatter.set_powerlimits((-2, 3))
        bar.formatter.set_useOffset(False)
    if label:
        bar.set_label(label, fontsize=8)


def add_legend(ax: Axes, n: int) -> None:
    ax.legend(fontsize=8 if n <= 6 else 7, frameon=True, framealpha=0.85)


def layer_head_panel(
    fig: Figure,
    ax: Axes,
    values: np.ndarray,
    layers: Sequence[int],
    title: str,
    *,
    signed: bool | None = None,
    cmap: str | None = None,
    label: str | None = None,
) -> None:
    """One layer x head heat map: layers down the y axis (first layer at the top), heads on x;
    `label` names the colorbar (default: what a sign means, for signed values)."""
    n_layers, n_heads = values.shape
    if signed is None:
        finite = values[np.isfinite(values)]
        signed = bool(finite.size and finite.min() < 0 < finite.max())
    if signed:
        limit = symmetric_limit(values)
        image = ax.imshow(
            values,
            cmap=colour_map(cmap or SIGNED_CMAP),
            vmin=-limit,
            vmax=limit,
            aspect="auto",
            interpolation="nearest",
        )
    else:
        image = ax.imshow(
            values, cmap=colour_map(cmap or NORM_CMAP), aspect="auto", interpolation="nearest"
        )
    step = _tick_step(n_layers, 40)
    ax.set_yticks(range(0, n_layers, step), [str(layers[i]) for i in range(0, n_layers, step)])
    step = _tick_step(n_heads, 32)
    ax.set_xticks(range(0, n_heads, step), [str(h) for h in range(0, n_heads, step)])
    ax.tick_params(labelsize=7 if max(n_layers, n_heads) > 16 else 8, length=2)
    ax.set_xlabel("head", fontsize=9)
    ax.set_ylabel("layer", fontsize=9)
    ax.set_title(title, fontsize=10)
    if label is None and signed:
        label = "red > 0, blue < 0 (centred at 0)"
    add_colorbar(fig, image, ax, label)


def layer_head_figure(n_panels: int, n_layers: int, n_heads: int) -> Figure:
    width = n_panels * min(8.0, max(3.4, 0.32 * n_heads + 1.9))
    height = min(14.0, max(2.6, 0.24 * n_layers + 1.3))
    return new_figure(width, height)


def map_name(ra: ReversedAttention) -> str:
    return _MAP_NAMES.get(ra.convention, ra.convention)


def layer_index(ra: ReversedAttention, layer: int) -> int:
    if layer not in ra.layers:
        raise ValueError(f"layer {layer} was not computed: this result holds layers {ra.layers}")
    return ra.layers.index(layer)


def token_labels(result: ReversedAttention | AttentionAttribution, prompt: int) -> list[str]:
    """One prompt's real tokens as axis labels: its string tokens made visible by
    `visible_token`, or the token ids when the result holds no strings."""
    n = int(result.lengths[prompt])
    if not result.str_tokens:
        return [str(t) for t in result.tokens[prompt, :n].tolist()]
    return [visible_token(t) for t in result.str_tokens[prompt][:n]]


def head_matrices(
    ra: ReversedAttention, layer: int, head: int, prompt: int
) -> tuple[np.ndarray, np.ndarray]:
    """(RA, forward pattern) of one head for one prompt, each [query key], cut to its length."""
    if ra.maps is None or ra.patterns is None:
        raise ValueError("maps were not kept: call reversed_attention(..., keep='maps')")
    li, n = layer_index(ra, layer), int(ra.lengths[prompt])
    return (
        as_numpy(ra.maps[prompt, li, head, :n, :n]),
        as_numpy(ra.patterns[prompt, li, head, :n, :n]),
    )
