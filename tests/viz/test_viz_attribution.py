"""Attribution figures say what their colours mean (ra_lens/viz/attribution.py)."""

from __future__ import annotations

import pytest
from helpers import arch_or_hooked

from ra_lens import attention_attribution, metrics, viz
from ra_lens.toy_models import tiny_model


@pytest.mark.parametrize(
    ("direction", "move"), [("denoise", "corrupted -> clean"), ("noise", "clean -> corrupted")]
)
def test_heatmap_colorbars_and_edge_legend_give_the_sign(direction: str, move: str) -> None:
    model = tiny_model(arch_or_hooked("gpt2"))
    att = attention_attribution(model, "The capital of France is", "The capital of Italy is",
                                metrics.logit_diff([294], [52]), direction=direction)  # fmt: skip
    fig = viz.attribution_heatmaps(att)
    bars = [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == len(att.scores)
    for label in bars:
        assert label.splitlines() == ["estimate of M(patched) - M", f"red > 0: moving the node {move} raises M"]  # fmt: skip
    title = viz.top_edges_on_tokens(att, k=3).axes[0].get_legend().get_title().get_text()
    assert title.splitlines() == ["red: raises M, blue: lowers it", f"(node moved {move})"]
