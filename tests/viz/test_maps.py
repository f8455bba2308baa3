"""RA figures say what their colours mean (ra_lens/viz/maps.py, viz/_base.py), and the forward
pattern's colours are not RA's: each colorbar's label, read from the figure's artists."""

from __future__ import annotations

import pytest
from helpers import arch_or_hooked
from matplotlib import colormaps

from ra_lens import metrics, reversed_attention, viz
from ra_lens.toy_models import tiny_model
from ra_lens.viz._base import PATTERN_CMAP, SIGNED_CMAP


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"))


def _bar_labels(fig) -> list[str]:
    """The colorbars' labels, in the order of their axes."""
    return [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]


@pytest.mark.parametrize(
    ("convention", "name", "what"),
    [
        ("qk", "RA = dM/d(QK^T)", "query-key logit"),
        ("scores", "dM/dS", "pre-softmax score"),
        ("pattern", "dM/dA", "attention weight"),
    ],
)
def test_head_pair_colorbars_say_what_the_colours_mean(model, convention, name, what) -> None:
    ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]),
                            convention=convention)  # fmt: skip
    fig = viz.head_pair(ra, 1, 2)
    pattern, signed = _bar_labels(fig)
    assert pattern == "attention weight A (0 to 1)"
    assert signed.splitlines() == [
        name,
        f"red > 0: a larger {what} raises M",
        "blue < 0: it lowers M (M a loss: red = descent weakens the link)",
    ]
    forward, reversed_ = fig.axes[:2]
    assert forward.images[0].get_cmap().name.startswith(PATTERN_CMAP)
    assert reversed_.images[0].get_cmap().name.startswith(SIGNED_CMAP)
    # the pattern's darkest colour is no colour of the diverging map's blue (negative) half
    darkest = forward.images[0].get_cmap()(1.0)[:3]
    blue = colormaps[SIGNED_CMAP](0.0)[:3]
    assert darkest[1] > darkest[2] and blue[2] > blue[1]  # green beside blue


def test_norm_heatmaps_and_grid_label_their_colorbars(model) -> None:
    ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    labels = _bar_labels(viz.head_norm_heatmaps(ra))
    assert (
        labels[0].startswith("mean Frobenius norm of RA")
        and labels[1] == "mean Frobenius norm of A"
    )
    grid = viz.top_heads_grid(ra, k=2)
    for row in grid.subfigs:
        bars = [ax.get_ylabel() for ax in row.axes if ax.get_label() == "<colorbar>"]
        assert bars[0] == "attention weight A (0 to 1)" and bars[1].startswith("RA = dM/d(QK^T)")
