"""Line plots: accuracy against the attention-patching scale, and against the fraction of heads
kept (ablation curves, each labelled with its area under the curve); named bars (a result's
largest scores).

Each returns a fresh `matplotlib.figure.Figure`; `save=` also writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from ra_lens.math import trapezoid_auc
from ra_lens.viz._base import ArrayLike, PathLike, add_legend, as_numpy, new_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "ablation_curves",
    "ablation_curves_pair",
    "named_bars",
    "scale_sweep",
    "stability_curve",
    "training_curve",
]


def _check_curves(x: np.ndarray, curves: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    if not curves:
        raise ValueError("no curves to plot")
    out = {}
    for name, values in curves.items():
        ys = as_numpy(values).reshape(-1)
        if ys.shape != x.shape:
            raise ValueError(f"curve {name!r} has {ys.size} values for {x.size} x values")
        out[name] = ys
    return out


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
    xs = as_numpy(scales).reshape(-1)
    data = _check_curves(xs, curves)
    order = np.argsort(xs, kind="stable")
    fig = new_figure(7.0, 4.2)
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
    add_legend(ax, len(data) + (baseline is not None))
    return save_figure(fig, save)


def _fractions(fractions: ArrayLike) -> np.ndarray:
    xs = as_numpy(fractions).reshape(-1)
    if xs.size and (xs.min() < 0 or xs.max() > 1):
        raise ValueError(f"fractions must lie in [0, 1], got {xs.min()} to {xs.max()}")
    return xs


def _ablation_axis(
    ax: Axes, xs: np.ndarray, data: dict[str, np.ndarray], ylabel: str, title: str
) -> None:
    """One panel of ablation curves. Past the colour cycle's ten colours lines turn dashed, then
    dotted, so no two rankings of a study look alike."""
    order = np.argsort(xs, kind="stable")
    for i, (name, ys) in enumerate(data.items()):
        auc = trapezoid_auc(xs, ys)
        ax.plot(
            xs[order],
            ys[order],
            linestyle=("-", "--", ":")[(i // 10) % 3],
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
    add_legend(ax, len(data))


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
    xs = _fractions(fractions)
    data = _check_curves(xs, curves)
    fig = new_figure(6.5, 4.2)
    _ablation_axis(fig.subplots(), xs, data, ylabel, title)
    return save_figure(fig, save)


def ablation_curves_pair(
    fractions: ArrayLike,
    top: Mapping[str, ArrayLike],
    bottom: Mapping[str, ArrayLike],
    *,
    ylabel: str = "top-1 accuracy",
    title: str | None = None,
    save: PathLike | None = None,
) -> Figure:
    """Keeping the top-ranked heads (left) beside keeping the bottom-ranked heads (right), as in
    `ablation_curves`, on one shared y axis: a good ranking rises early on the left and late on
    the right.

    Args:
        fractions: Float[step], fractions of heads kept, each in [0, 1].
        top, bottom: ranking name -> Float[step] accuracies with the top (bottom) heads kept.
        ylabel: y axis label; title: optional figure title; save: optional path.

    >>> fig = ablation_curves_pair([0.0, 1.0], {"ra": [0.0, 1.0]}, {"ra": [0.5, 1.0]}, title="toy")
    >>> [ax.get_title() for ax in fig.axes], fig.get_suptitle()
    (['Keeping the top-ranked heads', 'Keeping the bottom-ranked heads'], 'toy')
    """
    xs = _fractions(fractions)
    panels = [
        (_check_curves(xs, top), "Keeping the top-ranked heads"),
        (_check_curves(xs, bottom), "Keeping the bottom-ranked heads"),
    ]
    fig = new_figure(12.0, 4.4)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (data, panel_title) in zip(axes, panels, strict=True):
        _ablation_axis(ax, xs, data, ylabel, panel_title)
    if title:
        fig.suptitle(title, fontsize=12)
    return save_figure(fig, save)


def named_bars(
    names: Sequence[str],
    values: ArrayLike,
    *,
    title: str,
    xlabel: str,
    kept: Sequence[bool] | None = None,
    save: PathLike | None = None,
) -> Figure:
    """One horizontal bar per name (the first on top): a result's largest scores, a
    faithfulness per pair, a search's trials (`kept` colours the kept ones).

    >>> fig = named_bars(["a0.h1", "m0"], [0.5, -0.25], title="scores", xlabel="score")
    >>> [(t.get_text(), int(t.get_position()[1])) for t in fig.axes[0].get_yticklabels()]
    [('a0.h1', 1), ('m0', 0)]
    """
    xs = as_numpy(values)
    if len(names) != len(xs):
        raise ValueError(f"{len(names)} names for {len(xs)} values: pass one value per name")
    fig = new_figure(6.0, 1.2 + 0.25 * max(1, len(names)))
    ax = fig.subplots()
    colours = ["#4c72b0" if ok else "#bbbbbb" for ok in (kept or [True] * len(xs))]
    ax.barh(list(range(len(xs)))[::-1], xs, color=colours)
    ax.set_yticks(list(range(len(xs)))[::-1], list(names), fontsize=8)
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=11)
    return save_figure(fig, save)


def stability_curve(
    fractions: Sequence[float],
    pairwise: ArrayLike,
    to_full: ArrayLike,
    low: ArrayLike,
    high: ArrayLike,
    *,
    bar: float,
    title: str,
    save: PathLike | None = None,
) -> Figure:
    """Bootstrap Jaccard of a method's circuits against their size (`CircuitStability.plot`):
    the mean over pairs of resamples, and each resample against all pairs' circuit with its 95 %
    range, on a log axis of the fraction of edges, with the stability `bar` dashed.

    >>> fig = stability_curve([0.01, 0.1], [0.5, 0.9], [0.6, 0.9], [0.4, 0.8], [0.7, 1.0],
    ...                       bar=0.8, title="t")
    >>> [line.get_label() for line in fig.axes[0].get_lines()][:2]
    ['pairs of resamples', 'resample vs all pairs']
    """
    xs = _fractions(fractions)
    fig = new_figure(6.0, 3.8)
    ax = fig.subplots()
    ax.plot(xs, as_numpy(pairwise), marker="o", lw=1.5, label="pairs of resamples")
    ax.plot(xs, as_numpy(to_full), marker="s", lw=1.2, label="resample vs all pairs")
    ax.fill_between(xs, as_numpy(low), as_numpy(high), alpha=0.2, label="95 % of resamples")
    ax.axhline(bar, color="grey", ls="--", lw=0.9)
    ax.text(0.01, bar, f"stable ({bar:g})", va="bottom", fontsize=8, color="grey",
            transform=ax.get_yaxis_transform())  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{100 * v:g} %" for v in xs], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("circuit size (fraction of the graph's edges)", fontsize=9)
    ax.set_ylabel("Jaccard of the chosen edges", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, save)


def training_curve(
    left: Mapping[str, ArrayLike],
    right: Mapping[str, ArrayLike],
    *,
    title: str,
    save: PathLike | None = None,
) -> Figure:
    """Values per training step in two panels side by side (`LearnedMask.plot`: the
    faithfulness on the left, the edges kept on the right), one line per name.

    >>> fig = training_curve({"f": [0.2, 0.6, 0.9]}, {"kept": [10, 8, 8]}, title="t")
    >>> [ax.get_lines()[0].get_label() for ax in fig.axes]
    ['f', 'kept']
    """
    fig = new_figure(9.0, 3.4)
    axes = fig.subplots(1, 2)
    for ax, curves in zip(axes, (left, right)):
        for name, values in curves.items():
            ys = as_numpy(values)
            ax.plot(np.arange(len(ys)), ys, marker="o", lw=1.5, label=name)
        ax.set_xlabel("step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        add_legend(ax, len(curves))
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, save)
