"""Heat maps: head norms (layer x head), one head's forward pattern beside its Reversed
Attention map, the top heads' pairs, and any per-head scores side by side.

Every function builds a fresh `matplotlib.figure.Figure` (never through pyplot) and returns it;
`save="path.png"` also writes it (png, pdf, svg: any format matplotlib knows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from jaxtyping import Float
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from torch import Tensor

from ra_lens.viz._base import (
    PATTERN_CMAP,
    PATTERN_LABEL,
    SHORT_NAMES,
    SIGNED_CMAP,
    PathLike,
    add_colorbar,
    as_numpy,
    colour_map,
    head_matrices,
    layer_head_figure,
    layer_head_panel,
    layer_index,
    map_name,
    new_figure,
    ra_colour_label,
    save_figure,
    symmetric_limit,
    token_fontsize,
    token_labels,
)

# Results import their views; views name results for type hints only.
if TYPE_CHECKING:
    from ra_lens.result import ReversedAttention


__all__ = ["head_norm_heatmaps", "head_pair", "ranking_maps", "top_heads_grid"]


def _mask_upper(matrix: np.ndarray) -> np.ma.MaskedArray:
    n = matrix.shape[-1]
    return np.ma.masked_array(matrix, mask=np.triu(np.ones((n, n), dtype=bool), k=1))


def _token_panel(
    ax: Axes, matrix: np.ndarray, labels: list[str], title: str, *, signed: bool
) -> Any:
    """One attention-shaped map with token labels; returns the image (for a colorbar)."""
    if signed:
        limit = symmetric_limit(np.tril(matrix))
        image = ax.imshow(
            _mask_upper(matrix),
            cmap=colour_map(SIGNED_CMAP),
            vmin=-limit,
            vmax=limit,
            interpolation="nearest",
        )
    else:
        image = ax.imshow(
            _mask_upper(matrix),
            cmap=colour_map(PATTERN_CMAP),
            vmin=0.0,
            vmax=1.0,
            interpolation="nearest",
        )
    n, size = len(labels), token_fontsize(len(labels))
    ax.set_xticks(range(n), labels, rotation=90, fontsize=size)
    ax.set_yticks(range(n), labels, fontsize=size)
    ax.tick_params(length=2, pad=1)
    ax.set_xlabel("key (attended-to token)", fontsize=8)
    ax.set_ylabel("query (attending token)", fontsize=8)
    ax.set_title(title, fontsize=10)
    return image


def _head_title(ra: ReversedAttention, layer: int, head: int, prompt: int) -> str:
    norm = float(ra.norms[prompt, layer_index(ra, layer), head])
    return f"L{layer} H{head}  |{SHORT_NAMES.get(ra.convention, 'RA')}|={norm:.3g}"


def _draw_pair(
    fig: Figure | SubFigure, ra: ReversedAttention, layer: int, head: int, prompt: int
) -> None:
    ra_map, pattern = head_matrices(ra, layer, head, prompt)
    labels = token_labels(ra, prompt)
    ax_fwd, ax_ra = fig.subplots(1, 2)
    image = _token_panel(ax_fwd, pattern, labels, "Forward attention", signed=False)
    add_colorbar(fig, image, ax_fwd, PATTERN_LABEL)
    image = _token_panel(ax_ra, ra_map, labels, map_name(ra), signed=True)
    add_colorbar(fig, image, ax_ra, ra_colour_label(ra.convention))
    fig.suptitle(_head_title(ra, layer, head, prompt), fontsize=12)


def _pair_size(labels: list[str]) -> tuple[float, float]:
    """(width, height) in inches of one forward/RA row: square maps plus room for the labels."""
    n = len(labels)
    side = min(10.0, max(3.6, 0.2 * n + 1.8))
    longest = max((len(label) for label in labels), default=1)
    label = min(2.5, longest * token_fontsize(n) * 0.62 / 72) + 0.35
    return 2 * (side + label + 0.9), side + label + 0.95


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
    ra_norms, fwd_norms = as_numpy(ra.head_norms()), as_numpy(ra.forward_norms())
    fig = layer_head_figure(2, *ra_norms.shape)
    ax_ra, ax_fwd = fig.subplots(1, 2)
    short = SHORT_NAMES.get(ra.convention, ra.convention)
    layer_head_panel(fig, ax_ra, ra_norms, ra.layers, f"{map_name(ra)} norm", signed=False,
                      label=f"mean Frobenius norm of {short}\n(larger: the metric depends more on\nthis head's attention)")  # fmt: skip
    layer_head_panel(fig, ax_fwd, fwd_norms, ra.layers, "Forward attention norm", signed=False,
                      label="mean Frobenius norm of A")  # fmt: skip
    return save_figure(fig, save)


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
    width, height = _pair_size(token_labels(ra, prompt))
    fig = new_figure(width, height)
    _draw_pair(fig, ra, layer, head, prompt)
    return save_figure(fig, save)


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
    width, height = _pair_size(token_labels(ra, prompt))
    fig = new_figure(width, len(heads) * height)
    rows = fig.subfigures(len(heads), 1, squeeze=False)[:, 0]
    for row, (layer, head, _) in zip(rows, heads, strict=True):
        _draw_pair(row, ra, layer, head, prompt)
    return save_figure(fig, save)


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
    values = {name: as_numpy(v) for name, v in rankings.items()}
    shapes = {v.shape for v in values.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"rankings must all be [layer, head] of one shape, got {shapes}")
    n_layers, n_heads = next(iter(shapes))
    labels = list(layers) if layers is not None else list(range(n_layers))
    if len(labels) != n_layers:
        raise ValueError(f"{len(labels)} layer labels for {n_layers} layers")
    fig = layer_head_figure(len(values), n_layers, n_heads)
    axes = fig.subplots(1, len(values), squeeze=False)[0]
    for ax, (name, grid) in zip(axes, values.items(), strict=True):
        layer_head_panel(fig, ax, grid, labels, name)
    return save_figure(fig, save)
