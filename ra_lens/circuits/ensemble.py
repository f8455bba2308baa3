"""Score ensembles: several methods' edge scores on one graph combined into one `EdgeScores`.

Each input is first put in MIB's sign (`EdgeScores.helps`: noise scores negated, so positive
always means "the edge helps the metric"), then divided by its scale over the graph's real edges,
then averaged with the weights (normalised to sum 1):

    combined = sum_i (w_i / sum_j w_j) * helps_i / scale_i

normalise="rms": scale_i = sqrt(mean over real edges of helps_i^2) (the scale of one method's
scores, so a method with larger raw numbers does not dominate); "max": max |helps_i|; "none":
scale_i = 1 (raw scores, for methods already in the same units, e.g. eap-ig and exact-ig of one
metric). These are linear, so every tensor field an `EdgeScores` carries (`scores`, `per_pair`,
`node_scores` and any field added later) is combined with the same coefficients and stays
consistent with `scores` (the mean of the combined `per_pair` is the combined `scores`).
normalise="rank": the signed rank, sign(helps) * rank of |helps| among real edges / n_edges (1 for
the largest |score|), which ignores how far apart the scores are; a rank of a mean is not the mean
of ranks, so the result carries `scores` only.

`hybrid` is Hybrid-Ens's parallel ensemble (Mondorf et al. 2025, arXiv 2510.06811, the BlackboxNLP
2025 MIB shared task): the plain mean of EAP, EAP-IG-inputs and EAP-IG-activations scores, each
computed as EAP-IG computes it, with normalise="none": the paper takes the three EAP variants as
"comparable in their scoring space" and found simple averaging best, so their raw scores are
averaged (in MIB's sign, which flips all three EAP-IG scores alike).

    >>> from ra_lens.circuits.graph import Graph
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> a = EdgeScores(g, g.real * 2.0, method="eap", direction="denoise")
    >>> b = EdgeScores(g, g.real * -4.0, method="exact", direction="noise")
    >>> both = ensemble([a, b])  # rms 2 and 4, b negated: both are all-ones after normalising
    >>> both.method, both.direction, float(both.scores[g.real].min()), float(both.scores.max())
    ('ensemble(eap:denoise*0.5 + exact:noise*0.5, rms)', 'denoise', 1.0, 1.0)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import fields
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.mib import mib_sign
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import MetricFn, Tokens

Normalise = Literal["rms", "max", "none", "rank"]
NORMALISATIONS: tuple[str, ...] = ("rms", "max", "none", "rank")
#: Hybrid-Ens's parts as `attribute`'s (method, direction), each EAP-IG's own algorithm: EAP
#: (gradient on the clean run), EAP-IG-inputs (denoise; EAP-IG's sign is the opposite, which MIB's
#: sign undoes) and EAP-IG-activations (noise).
HYBRID_PARTS: tuple[tuple[str, str], ...] = (
    ("eap", "noise"),
    ("eap-ig", "denoise"),
    ("eap-ig-act", "noise"),
)


def hybrid(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    steps: int = 5,
    batch_size: int = 8,
    progress: bool = False,
) -> EdgeScores:
    """Hybrid-Ens's score ensemble (module docstring): `attribute` with each of `HYBRID_PARTS`
    (`steps` IG steps for the two IG methods), then `ensemble(parts, normalise="none")`.

    Returns:
        EdgeScores as `ensemble` gives them (direction "denoise", MIB's sign, [writer reader]
        float64; `ungrouped_scores` on grouped-query models). Its cost is the three methods'
        together, mostly EAP-IG-activations' (2 n_layers + 1) x steps passes per batch.

    Raises:
        ValueError: as `attribute` (steps < 1, a bad metric), raised by the first part, before
            the expensive ones run; TypeError likewise (not a TransformerLens model).
        NotImplementedError: as `attribute` (readers it cannot rewrite), from the first part.
    """
    parts = [
        attribute(
            model,
            clean,
            corrupted,
            metric,
            method=method,  # type: ignore[arg-type]
            direction=direction,  # type: ignore[arg-type]
            steps=steps,
            batch_size=batch_size,
            progress=progress,
        )  # fmt: skip
        for method, direction in HYBRID_PARTS
    ]
    return ensemble(parts, normalise="none")


def ensemble(
    scores: Validated[Sequence[EdgeScores]],
    weights: Validated[Sequence[float]] | None = None,
    *,
    normalise: Validated[Normalise] = "rms",
) -> EdgeScores:
    """The weighted mean of several methods' normalised scores, in MIB's sign (module docstring).

    Args:
        scores: `EdgeScores` of one graph (any methods, either direction).
        weights: one non-negative weight per input (default: equal); normalised to sum 1.
        normalise: "rms", "max", "none" or "rank" (module docstring).

    Returns:
        EdgeScores with direction "denoise" (its `scores` are in MIB's sign: positive helps),
        method "ensemble(m1:d1*w1 + m2:d2*w2, normalise)", `scores` [writer reader] float64 on
        the CPU, 0 off the graph; every other tensor field (`per_pair` [pair writer reader],
        `node_scores` [writer], ...) combined the same way where all inputs carry it with one
        shape (else None; always None under "rank"); `ungrouped_scores` (grouped-query
        models) combined where any input has them, an input without them counting equal
        shares; `seconds` the sum of the inputs' when all
        have one (what the ensemble cost).

    Raises:
        ValueError: no scores, scores of different graphs, a weight count that does not match,
            negative or non-finite weights or all zero, an unknown normalise, an input whose
            scores are all zero (it has no scale).
        TypeError: an input that is not `EdgeScores`.
    """
    items = list(scores) if not isinstance(scores, EdgeScores) else [scores]
    if not items:
        raise ValueError("ensemble needs at least one EdgeScores")
    for i, item in enumerate(items):
        if not isinstance(item, EdgeScores):
            raise TypeError(
                f"scores[{i}] is a {type(item).__name__}: pass EdgeScores "
                "(circuits.attribute's result, not attribute_nodes')"
            )
    graph = items[0].graph
    for i, item in enumerate(items[1:], start=1):
        if item.graph != graph:
            raise ValueError(
                f"scores[{i}] is for {item.graph}, scores[0] for {graph}: combine scores of "
                "one model's graph"
            )
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise={normalise!r}: choose one of {NORMALISATIONS}")
    shares = _shares(weights, len(items))
    scales = [_scale(item, normalise) for item in items]
    label = " + ".join(
        f"{item.method}:{item.direction}*{share:.3g}" for item, share in zip(items, shares)
    )
    method = f"ensemble({label}, {normalise})"
    seconds = [item.seconds for item in items]
    total_seconds = None if any(s is None for s in seconds) else float(sum(seconds))  # type: ignore[arg-type]
    if normalise == "rank":
        combined = sum(
            share * _signed_rank(item) for item, share in zip(items, shares, strict=True)
        )
        assert isinstance(combined, Tensor)
        return EdgeScores(graph, combined, method, "denoise", seconds=total_seconds)
    # MIB's sign and the scale folded into one coefficient per input, for every tensor field.
    coefficients = [
        share * mib_sign(item.direction) / scale
        for item, share, scale in zip(items, shares, scales, strict=True)
    ]
    # The inputs' own class: a tensor field added to EdgeScores (or a subclass) is combined too.
    kind = type(items[0]) if all(type(item) is type(items[0]) for item in items) else EdgeScores
    values: dict[str, Tensor | None] = {}
    for spec in fields(kind):
        field_values = [getattr(item, spec.name) for item in items]
        if spec.name == "ungrouped_scores" and any(isinstance(v, Tensor) for v in field_values):
            # an input without its own copies contributes equal shares (what export gives it)
            field_values = [_copies(item) for item in items]
        if not all(isinstance(v, Tensor) for v in field_values):
            continue
        shapes = {tuple(v.shape) for v in field_values}
        if len(shapes) != 1:
            values[spec.name] = None  # e.g. per_pair over different pairs: not one quantity
            continue
        values[spec.name] = sum(
            c * v.detach().to("cpu", torch.float64)
            for c, v in zip(coefficients, field_values, strict=True)
        )
    for spec in fields(kind):  # a tensor field some inputs lack: not combinable
        if spec.name not in values and any(
            isinstance(getattr(item, spec.name), Tensor) for item in items
        ):
            values[spec.name] = None
    main = values.pop("scores")
    assert main is not None  # every EdgeScores has scores of the graph's shape
    return kind(graph, main, method, "denoise", seconds=total_seconds, **values)


def _copies(item: EdgeScores) -> Float[Tensor, "writer ureader"]:
    """The input's scores over EAP-IG's ungrouped readers in its own sign: its
    `ungrouped_scores`, or an equal share of each grouped key/value edge."""
    g = item.graph
    if item.ungrouped_scores is not None:
        return item.ungrouped_scores
    shares = item.scores.detach().to("cpu", torch.float64) / g.copies[None, :]
    return shares[:, g.ungrouped_target] * g.real[:, g.ungrouped_target]


def _shares(weights: Sequence[float] | None, n: int) -> list[float]:
    """The weights normalised to sum 1 (equal when None), checked."""
    if weights is None:
        return [1.0 / n] * n
    values = list(weights)
    if len(values) != n:
        raise ValueError(f"{len(values)} weights for {n} scores: pass one weight per input")
    for w in values:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"weights={values}: pass finite numbers")
        if w < 0:
            raise ValueError(
                f"weights={values}: weights must be >= 0 (the sign comes from each input's "
                "direction; a method to subtract is not an ensemble)"
            )
    total = float(sum(values))
    if total <= 0:
        raise ValueError(f"weights={values} sum to 0: give at least one input a positive weight")
    return [float(w) / total for w in values]


def _scale(item: EdgeScores, normalise: str) -> float:
    """What one input is divided by (1 for "none" and "rank")."""
    if normalise in ("none", "rank"):
        return 1.0
    real = item.helps[item.graph.real]
    scale = float(real.pow(2).mean().sqrt()) if normalise == "rms" else float(real.abs().max())
    if scale == 0.0:
        raise ValueError(
            f"the {item.method} ({item.direction}) scores are 0 on every edge, so they have no "
            f"scale to normalise by: leave them out or pass normalise='none'"
        )
    return scale


def _signed_rank(item: EdgeScores) -> Float[Tensor, "writer reader"]:
    """sign(helps) * rank of |helps| among real edges / n_edges: 1 for the largest |score|,
    1 / n_edges for the smallest; ties get the rank of the earlier edge in graph order; 0 off
    the graph."""
    g = item.graph
    helps = item.helps
    keys = helps.abs().masked_fill(~g.real, -1.0).flatten()
    order = torch.argsort(keys, descending=True, stable=True)
    n = g.n_edges
    ranks = torch.zeros(keys.numel(), dtype=torch.float64)
    ranks[order[:n]] = torch.arange(n, 0, -1, dtype=torch.float64) / n
    return (ranks.view_as(helps) * torch.sign(helps)) * g.real
