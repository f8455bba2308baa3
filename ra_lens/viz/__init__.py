"""Figures for Reversed Attention and attention attribution, one module per kind of drawing:

- `maps`: layer x head heat maps of head norms or any per-head scores, and one head's forward
  pattern beside its RA map (`head_norm_heatmaps`, `head_pair`, `top_heads_grid`, `ranking_maps`);
- `curves`: accuracy against the patching scale or the fraction of heads kept
  (`scale_sweep`, `ablation_curves`, `ablation_curves_pair`), circuit stability against size
  (`stability_curve`), a training run per step (`training_curve`);
- `pages`: interactive circuitsvis HTML (`circuitsvis_heads`, `attribution_edges_page`);
- `attribution`: `AttentionAttribution` scores, edges and estimates (`attribution_heatmaps`,
  `top_edges_on_tokens`, `estimate_scatter`);
- `circuit_draw`: a circuit layer by layer and the edges with the largest scores (`draw_circuit`,
  `draw_scores`: what `Circuit.plot` and `EdgeScores.plot` draw);
- `circuit_page`: the offline interactive page of circuits (`render_page` of
  `circuit_page.PageStop`s into a `circuit_page.CircuitPage`: what `EdgeScores.to_html`, `Circuit.to_html` and `ra-lens circuit --html` write,
  once `ra_lens.circuits.page` has chosen the circuits and computed the heads' RA).

Every figure function builds a fresh `matplotlib.figure.Figure` (never through pyplot, so
nothing is shown, nothing global is left open and nothing of the caller's is closed) and returns
it; pass `save="path.png"` (any format matplotlib knows: png, pdf, svg) to also write it to disk.
The pages return a self-contained HTML string instead (the JavaScript is inlined, so the page
works offline). Import everything from `ra_lens.viz`.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`):

    >>> from ra_lens import metrics, reversed_attention, viz
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> fig = viz.head_norm_heatmaps(ra)  # save="norms.png" writes it too
    >>> page = viz.circuitsvis_heads(ra, ra.top_heads(4))  # save="heads.html"

Colour conventions: signed maps (RA and its other conventions, attribution scores) use a
diverging map centred at zero with a symmetric range (vmin == -vmax); forward patterns use a
sequential green map on [0, 1] (no colour of a pattern reads as a sign of RA). Every colorbar
says what its colours mean. The causal (upper) triangle is masked and drawn grey.
"""

from ra_lens.viz._base import save_figure, visible_token
from ra_lens.viz.attribution import attribution_heatmaps, estimate_scatter, top_edges_on_tokens
from ra_lens.viz.circuit_draw import draw_circuit, draw_scores
from ra_lens.viz.circuit_page import render_page
from ra_lens.viz.curves import (
    ablation_curves,
    ablation_curves_pair,
    named_bars,
    scale_sweep,
    stability_curve,
    training_curve,
)
from ra_lens.viz.maps import head_norm_heatmaps, head_pair, ranking_maps, top_heads_grid
from ra_lens.viz.pages import attribution_edges_page, circuitsvis_heads

__all__ = [
    "ablation_curves",
    "ablation_curves_pair",
    "attribution_edges_page",
    "attribution_heatmaps",
    "circuitsvis_heads",
    "draw_circuit",
    "draw_scores",
    "estimate_scatter",
    "head_norm_heatmaps",
    "head_pair",
    "named_bars",
    "ranking_maps",
    "render_page",
    "save_figure",
    "scale_sweep",
    "stability_curve",
    "top_edges_on_tokens",
    "top_heads_grid",
    "training_curve",
    "visible_token",
]
