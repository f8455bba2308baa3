"""ra_lens.viz: every figure's axes, labels, colour scales, masks and saved files (offline)."""

from __future__ import annotations

import json
import re

import matplotlib
import numpy as np
import pytest
import torch
from helpers import PROMPTS, arch_or_hooked
from matplotlib.figure import Figure

import ra_lens
from ra_lens import viz
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model

PROMPT = PROMPTS[0]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"))


@pytest.fixture(scope="module")
def ra(model):
    return ra_lens.reversed_attention(model, PROMPT, target_nll([5]))


@pytest.fixture(scope="module")
def ra_batch(model):
    """Two prompts of different lengths (right-padded), one with newlines."""
    return ra_lens.reversed_attention(model, [PROMPT, "Q: hot\nA:"], target_nll([5, 6]))


def _png(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def _tick_texts(labels) -> list[str]:
    return [label.get_text() for label in labels]


def _image(ax):
    (image,) = ax.get_images()
    return image


def _token_axes(fig: Figure):
    return [ax for ax in fig.axes if ax.get_title() in ("Forward attention", "Reversed Attention")]


def test_visible_token():
    assert viz.visible_token("\n") == "\\n"
    assert viz.visible_token("a\tb\r") == "a\\tb\\r"
    assert viz.visible_token(" ") == "\u2423"
    assert viz.visible_token("  ") == "\u2423\u2423"
    assert viz.visible_token("") == "\u2423"
    assert viz.visible_token(" Italy") == " Italy"


def test_no_pyplot_state(ra, tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    viz.head_norm_heatmaps(ra)
    viz.head_pair(ra, 0, 0)
    assert plt.get_fignums() == before  # nothing registered with pyplot, nothing to close


def test_head_norm_heatmaps(ra, tmp_path):
    path = tmp_path / "norms.png"
    fig = viz.head_norm_heatmaps(ra, save=path)
    assert isinstance(fig, Figure)
    _png(path)
    titled = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(titled) == {"Reversed Attention norm", "Forward attention norm"}
    assert len(fig.axes) == 4  # two maps, two colorbars
    for title, values in [
        ("Reversed Attention norm", ra.head_norms()),
        ("Forward attention norm", ra.forward_norms()),
    ]:
        ax = titled[title]
        np.testing.assert_allclose(_image(ax).get_array(), values.numpy(), rtol=1e-6)
        assert _tick_texts(ax.get_yticklabels()) == [str(layer) for layer in ra.layers]
        assert _tick_texts(ax.get_xticklabels()) == [str(h) for h in range(values.shape[1])]
        assert ax.get_ylabel() == "layer" and ax.get_xlabel() == "head"


def test_head_norm_heatmaps_many_layers(tmp_path):
    """30 layers x 9 heads (a synthetic result: only norms are needed)."""
    norms = torch.rand(2, 30, 9)
    fake = ra_lens.ReversedAttention(
        norms=norms,
        pattern_norms=norms + 1,
        tokens=torch.zeros(2, 3, dtype=torch.long),
        lengths=torch.tensor([3, 3]),
        metric_values=torch.zeros(2),
        layers=list(range(30)),
        convention="qk",
        scales=[1.0] * 30,
        routes=["pattern"] * 30,
    )
    fig = viz.head_norm_heatmaps(fake, save=tmp_path / "big.png")
    ax = fig.axes[0]
    assert _tick_texts(ax.get_yticklabels()) == [str(i) for i in range(30)]
    assert fig.get_figheight() >= 6  # tall enough for 30 rows of labels
    _png(tmp_path / "big.png")


def test_head_pair(ra, tmp_path):
    layer, head, _ = ra.top_heads(1)[0]
    path = tmp_path / "pair.png"
    fig = viz.head_pair(ra, layer, head, save=path)
    _png(path)
    assert isinstance(fig, Figure)
    fwd_ax, ra_ax = _token_axes(fig)
    assert fwd_ax.get_title() == "Forward attention" and ra_ax.get_title() == "Reversed Attention"
    assert fig.get_suptitle().startswith(f"L{layer} H{head}  |RA|=")
    tokens = [viz.visible_token(t) for t in ra.str_tokens[0]]
    n = int(ra.lengths[0])
    for ax in (fwd_ax, ra_ax):
        assert _tick_texts(ax.get_xticklabels()) == tokens[:n]
        assert _tick_texts(ax.get_yticklabels()) == tokens[:n]
        assert all(label.get_rotation() == 90 for label in ax.get_xticklabels())
        data = _image(ax).get_array()
        assert data.shape == (n, n)
        upper = np.triu(np.ones((n, n), dtype=bool), k=1)
        assert np.array_equal(np.ma.getmaskarray(data), upper)  # upper triangle masked
    ra_image = _image(ra_ax)
    vmin, vmax = ra_image.get_clim()
    assert vmin == -vmax and vmax == pytest.approx(ra.head(layer, head).abs().max().item())
    assert ra_image.get_cmap().name.startswith("RdBu_r")
    np.testing.assert_allclose(
        np.ma.filled(ra_image.get_array(), 0.0), ra.head(layer, head).numpy(), rtol=1e-6
    )
    assert _image(fwd_ax).get_clim() == (0.0, 1.0)


def test_head_pair_padded_prompt_and_newlines(ra_batch):
    fig = viz.head_pair(ra_batch, 1, 2, prompt=1)
    n = int(ra_batch.lengths[1])
    assert n < ra_batch.tokens.shape[1]  # the short prompt is padded: labels must be cut
    labels = _tick_texts(_token_axes(fig)[1].get_xticklabels())
    assert len(labels) == n and "\\n" in labels and not any("\n" in t for t in labels)


def test_head_pair_errors(ra):
    with pytest.raises(ValueError, match="layer 7"):
        viz.head_pair(ra, 7, 0)
    norms_only = ra_lens.ReversedAttention(
        norms=ra.norms,
        pattern_norms=ra.pattern_norms,
        tokens=ra.tokens,
        lengths=ra.lengths,
        metric_values=ra.metric_values,
        layers=ra.layers,
        convention=ra.convention,
        scales=ra.scales,
        routes=ra.routes,
    )
    with pytest.raises(ValueError, match="keep='maps'"):
        viz.head_pair(norms_only, 0, 0)
    viz.head_norm_heatmaps(norms_only)  # needs only the norms


def test_top_heads_grid(ra, tmp_path):
    path = tmp_path / "grid.png"
    fig = viz.top_heads_grid(ra, k=3, save=path)
    _png(path)
    top = ra.top_heads(3)
    assert len(fig.subfigs) == 3
    for sub, (layer, head, norm) in zip(fig.subfigs, top, strict=True):
        title = sub.get_suptitle()
        assert title.startswith(f"L{layer} H{head}  |RA|=")
        assert float(title.split("=")[1]) == pytest.approx(norm, rel=1e-2)
    assert len(_token_axes(fig)) == 6
    for ax in _token_axes(fig)[1::2]:
        vmin, vmax = _image(ax).get_clim()
        assert vmin == -vmax > -np.inf


def test_circuitsvis_heads(ra, tmp_path):
    path = tmp_path / "heads.html"
    heads = [(0, 3), (1, 2)]
    page = viz.circuitsvis_heads(ra, heads, save=path)
    assert isinstance(page, str) and path.read_text(encoding="utf-8") == page
    assert page.lstrip().startswith("<!DOCTYPE html>")
    # offline: the bundle is inlined (once), nothing is fetched from a CDN
    assert "unpkg.com" not in page and "https://" not in page.split("<script")[0]
    assert page.count("var CircuitsVis=") == 1
    assert page.count("CircuitsVis.render(") == 2
    assert not re.search(r"<div[^>]*/>", page)  # self-closing divs would nest the sections
    props = [
        json.loads(m.group(1))
        for m in re.finditer(r"CircuitsVis\.AttentionHeads,\s*(\{.*?\})\s*\)", page, re.S)
    ]
    ra_props, fwd_props = props
    assert ra_props["attentionHeadNames"] == ["L0H3 RA", "L1H2 RA"]
    assert fwd_props["attentionHeadNames"] == ["L0H3 attn", "L1H2 attn"]
    tokens = [viz.visible_token(t) for t in ra.str_tokens[0]]
    assert ra_props["tokens"] == tokens == fwd_props["tokens"]
    maps = torch.stack([ra.head(layer, head) for layer, head in heads])
    np.testing.assert_allclose(np.array(ra_props["attention"]), maps.numpy(), rtol=1e-6)
    assert ra_props["minValue"] == -ra_props["maxValue"]
    assert ra_props["maxValue"] == pytest.approx(maps.abs().max().item())
    assert (fwd_props["minValue"], fwd_props["maxValue"]) == (0.0, 1.0)
    value = ra.head(0, 3)[-1, 0].item()
    assert repr(value) in page  # the raw numbers are in the page
    assert "Italy" in page


def test_circuitsvis_heads_default_and_top_heads_triples(ra):
    page = viz.circuitsvis_heads(ra, ra.top_heads(2))
    layer, head, _ = ra.top_heads(1)[0]
    assert f"L{layer}H{head} RA" in page
    page = viz.circuitsvis_heads(ra)  # default: the top 8 heads (all 8 here)
    assert page.count(' RA"') == 8


def test_scale_sweep(tmp_path):
    scales = [3, 1, 0.5, 0, -0.1, -1, -4, -16, -64, -120]
    curves = {
        "RA top-1": np.linspace(0, 0.5, 10).tolist(),
        "RA top-3": np.linspace(0, 0.9, 10).tolist(),
        "forward top-3": [0.1] * 10,
    }
    path = tmp_path / "sweep.png"
    fig = viz.scale_sweep(scales, curves, baseline=0.05, save=path)
    _png(path)
    (ax,) = fig.axes
    assert ax.get_xscale() == "symlog"
    assert ax.get_ylabel() == "top-3 accuracy" and ax.get_title()
    legend = _tick_texts(ax.get_legend().get_texts())
    assert legend[:3] == list(curves) and legend[3].startswith("unpatched")
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and dashed[0].get_ydata()[0] == 0.05
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == sorted(scales)  # drawn in scale order
    with pytest.raises(ValueError, match="RA"):
        viz.scale_sweep(scales, {"RA": [1.0, 2.0]})


def test_ablation_curves(tmp_path):
    fractions = np.linspace(0, 1, 11)
    curves = {"RA": fractions**0.5, "random": fractions, "forward": torch.tensor(fractions**2)}
    path = tmp_path / "ablation.png"
    fig = viz.ablation_curves(fractions, curves, save=path)
    _png(path)
    (ax,) = fig.axes
    legend = _tick_texts(ax.get_legend().get_texts())
    assert legend[1] == "random (AUC=0.500)"
    squares = fractions**2
    auc = float(np.sum(np.diff(fractions) * (squares[1:] + squares[:-1]) / 2))
    assert legend[2] == f"forward (AUC={auc:.3f})"
    assert ax.get_ylabel() == "top-1 accuracy"
    assert ax.get_xlabel() == "fraction of heads kept"
    with pytest.raises(ValueError, match="fractions"):
        viz.ablation_curves([0, 50, 100], {"RA": [0, 1, 1]})


def test_ranking_maps(ra, tmp_path):
    rankings = {
        "RA norm": ra.head_norms(),
        "forward norm": ra.forward_norms(),
        "causal mediation": torch.tensor([[0.1, -0.3, 0.0, 0.2], [0.0, 0.05, -0.1, 0.0]]),
    }
    path = tmp_path / "rankings.png"
    fig = viz.ranking_maps(rankings, layers=ra.layers, save=path)
    _png(path)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == list(rankings)
    clims = [_image(ax).get_clim() for ax in axes]
    assert clims[0] != clims[1]  # each panel has its own colour scale
    assert clims[2] == pytest.approx((-0.3, 0.3))  # signed scores: symmetric, diverging
    assert _tick_texts(axes[0].get_yticklabels()) == ["0", "1"]
    with pytest.raises(ValueError, match="shape"):
        viz.ranking_maps({"a": torch.zeros(2, 4), "b": torch.zeros(3, 4)})


def test_backend_untouched():
    backend = matplotlib.get_backend()
    viz.scale_sweep([0, -1], {"a": [0.0, 1.0]})
    assert matplotlib.get_backend() == backend


def test_all_lists_every_public_function():
    """`viz.__all__` is exactly the public functions of its modules, each importable from viz;
    `_base` (a private module) also holds the helpers its sibling modules share, which it leaves
    out of its `__all__`."""
    import inspect

    from ra_lens.viz import _base, attribution, circuit_draw, circuit_page, curves, maps, pages

    modules = (_base, attribution, circuit_draw, circuit_page, curves, maps, pages)
    for module in modules:
        defined = {
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value)
            and value.__module__ == module.__name__
            and not name.startswith("_")
        }
        if module is _base:
            assert set(module.__all__) < defined, module.__name__
        else:
            assert set(module.__all__) == defined, module.__name__
    assert viz.__all__ == sorted(name for module in modules for name in module.__all__)
    assert all(callable(getattr(viz, name)) for name in viz.__all__)


def test_ablation_curves_pair(tmp_path):
    fractions = np.linspace(0, 1, 6)
    names = [f"ranking {i}" for i in range(12)]  # more rankings than the colour cycle has colours
    top = {name: fractions ** (1 + i / 4) for i, name in enumerate(names)}
    bottom = {name: fractions ** (4 - i / 4) for i, name in enumerate(names)}
    path = tmp_path / "pair.png"
    fig = viz.ablation_curves_pair(fractions, top, bottom, title="toy, 2-shot", save=path)
    _png(path)
    left, right = fig.axes
    assert fig.get_suptitle() == "toy, 2-shot"
    assert left.get_title() == "Keeping the top-ranked heads"
    assert right.get_title() == "Keeping the bottom-ranked heads"
    assert left.get_shared_y_axes().joined(left, right)
    for ax, curves in ((left, top), (right, bottom)):
        lines = ax.get_lines()
        np.testing.assert_allclose(lines[11].get_ydata(), curves["ranking 11"])
        styles = [line.get_linestyle() for line in lines]
        assert styles == ["-"] * 10 + ["--"] * 2  # the 11th and 12th differ from the 1st, 2nd
        auc = float(
            np.sum(np.diff(fractions) * (curves["ranking 0"][1:] + curves["ranking 0"][:-1]) / 2)
        )
        assert _tick_texts(ax.get_legend().get_texts())[0] == f"ranking 0 (AUC={auc:.3f})"
    with pytest.raises(ValueError, match="fractions"):
        viz.ablation_curves_pair([0, 2], {"a": [0, 1]}, {"a": [0, 1]})
