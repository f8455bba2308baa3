"""What the circuit page shows, chosen and computed: MIB's circuits of both rankings at each size
(each chosen once, through `mib.ChosenCircuits`), checked against a faithfulness curve, and the
heads' RA on the first clean prompts (`heads_ra`). The view, `ra_lens.viz.circuit_page`, draws
them; `EdgeScores.to_html`, `Circuit.to_html` and `ra-lens circuit --html` come through here.

    >>> from ra_lens import circuits
    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = ["The capital of France is"], ["The capital of Italy is"]
    >>> metric = logit_diff([294], [52])
    >>> scores = circuits.attribute(model, clean, corrupted, metric, method="eap")
    >>> page = scores_page(scores, model=model, clean=clean, metric=metric)
    >>> page.n_circuits, page.html.startswith("<!DOCTYPE html>"), "://" in page.html
    (20, True, False)
    >>> page.save("circuit.html")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ra_lens import capture
from ra_lens.checks import check_count
from ra_lens.circuits.graph import Graph, Units
from ra_lens.circuits.mib import MIB_FRACTIONS, ChosenCircuits, check_fractions, chosen_for
from ra_lens.core import reversed_attention
from ra_lens.metrics import LogitDiff, Metric
from ra_lens.pairs import metric_rows
from ra_lens.types import HookedModel, MetricFn, Tokens
from ra_lens.viz.circuit_page import (
    MAX_DRAWN,
    RANKINGS,
    TARGET,
    CircuitPage,
    PageStop,
    render_page,
)

if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.curve import FaithfulnessCurve
    from ra_lens.circuits.scores import EdgeScores
    from ra_lens.result import ReversedAttention

__all__ = ["MAX_DRAWN", "TARGET", "CircuitPage", "circuit_page", "heads_ra", "scores_page"]


def scores_page(
    scores: EdgeScores,
    *,
    curve: FaithfulnessCurve | None = None,
    sizes: Sequence[float] | None = None,
    selection: str = "top",
    circuit: Circuit | None = None,
    faithfulness: float | None = None,
    model: HookedModel | None = None,
    clean: Tokens | None = None,
    metric: MetricFn | None = None,
    n_pairs: int = 3,
    ra: ReversedAttention | None = None,
    max_drawn: int = MAX_DRAWN,
    title: str | None = None,
    target: float = TARGET,
    chosen: ChosenCircuits | None = None,
) -> CircuitPage:
    """The page of the circuits `scores` picks at each size (`EdgeScores.to_html`).

    Args:
        scores: edge scores [writer reader].
        curve: a faithfulness curve measured on these scores: its sizes and selection give the
            circuits, its values the curve beside them (checked: each circuit's edge count).
        sizes: fractions of the graph's edges without a curve (default MIB's 0.1 % .. 100 %).
        selection: "top" or "greedy", without a curve.
        circuit: one more circuit (e.g. the one a run saved), placed by its edge count; the page
            opens on it. faithfulness: its faithfulness, marked on the curve.
        model, clean, metric: to show each head's attention pattern and RA (`heads_ra`) on the
            first `n_pairs` clean prompts.
        ra: that RA already computed (`heads_ra`, or `reversed_attention(..., keep="maps")`),
            instead of model and clean; `metric` then only names the metric on the page.
        max_drawn: the most edges drawn per circuit (the largest |score|).
        title: the page's title.
        target: the faithfulness the page first asks its smallest circuit to reach (changeable
            on the page).
        chosen: circuits already chosen from these scores by the selection (e.g. by the
            curve's `faithfulness_curve(..., chosen=...)`), taken instead of choosing again.
    """
    units: Units = "ungrouped"
    if curve is not None:
        units = curve.units
        total = scores.graph.count(units)
        if curve.n_total != total:
            raise ValueError(
                f"the curve is over {curve.n_total} edges, the scores' graph has {total} ({units})"
            )
        sizes, selection = curve.sizes, curve.selection
    fractions = check_fractions(MIB_FRACTIONS if sizes is None else sizes)
    if selection not in ("top", "greedy"):
        raise ValueError(f"selection={selection!r}: expected 'top' or 'greedy'")
    stops = _mib_stops(chosen_for(scores, chosen, selection), fractions, units, curve)
    start = None  # the view's default: the largest |score| circuit a browser draws at once
    if circuit is not None:
        if circuit.graph != scores.graph:
            raise ValueError(f"circuit is for {circuit.graph}, the scores for {scores.graph}")
        start = len(stops)
        label = f"the chosen circuit ({circuit.n_edges:,} edges)"
        stops.append(PageStop(circuit, label, None, faithfulness))
    return render_page(
        stops,
        start=start,
        scores=scores.scores,
        node_scores=scores.node_scores,
        per_pair=scores.per_pair,
        curve=curve,
        ra=_heads(scores.graph, model, clean, metric, n_pairs, ra),
        method=scores.method,
        direction=scores.direction,
        metric=metric_label(metric),
        max_drawn=max_drawn,
        title=title or f"Circuit: {scores.method} edge scores",
        summary=(
            f"{scores.method} edge scores ({scores.direction}), circuits by {selection} signed "
            f"score and by {selection} |score| at {len(fractions)} sizes, pruned to input -> "
            "logits paths"
        ),
        target=target,
    )


def circuit_page(
    circuit: Circuit,
    *,
    faithfulness: float | None = None,
    model: HookedModel | None = None,
    clean: Tokens | None = None,
    metric: MetricFn | None = None,
    n_pairs: int = 3,
    ra: ReversedAttention | None = None,
    max_drawn: int = MAX_DRAWN,
    title: str | None = None,
) -> CircuitPage:
    """The page of one circuit (`Circuit.to_html`); arguments as `scores_page`. The edges'
    scores are the circuit's own (`circuit.scores`), uniform grey lines without them."""
    return render_page(
        [PageStop(circuit, f"{circuit.n_edges:,} edges", None, faithfulness)],
        scores=circuit.scores,
        node_scores=circuit.node_scores,
        ra=_heads(circuit.graph, model, clean, metric, n_pairs, ra),
        metric=metric_label(metric),
        max_drawn=max_drawn,
        title=title or f"Circuit: {circuit.n_edges:,} edges",
        summary=f"one circuit of {circuit.graph.n_edges:,} edges' graph",
    )


def heads_ra(
    model: HookedModel,
    clean: Tokens,
    metric: MetricFn,
    *,
    n_pairs: int = 3,
    graph: Graph | None = None,
) -> ReversedAttention:
    """What a click on a head shows: RA (`reversed_attention` of `metric`, keep="maps",
    convention "qk") on the first `n_pairs` clean prompts, cut by `Batch.rows` and
    `pairs.metric_rows`; a metric that cannot be cut (not one of `ra_lens.metrics`) gets every
    prompt. `graph`: the page's graph, refused unless it is the model's. Leaves the model as
    found."""
    if graph is not None and Graph.from_model(model) != graph:
        raise ValueError(f"the model's graph {Graph.from_model(model)} is not the page's {graph}")
    check_count(n_pairs, "n_pairs", why="the page shows at least one pair")
    batch = capture.to_batch(model, clean)
    n = batch.tokens.shape[0]
    rows = slice(0, min(n_pairs, n) if isinstance(metric, Metric) else n)
    return reversed_attention(
        model, batch.rows(rows, trim=True), metric_rows(metric, rows, n), keep="maps"
    )


def metric_label(metric: MetricFn | None) -> str:
    """How the page names the metric."""
    if metric is None:
        return "the metric"
    if isinstance(metric, LogitDiff):
        return "M = logit(answer) - logit(wrong)"
    return f"M = {type(metric).__name__}"


def _mib_stops(
    kept: ChosenCircuits,
    fractions: list[float],
    units: Units,
    curve: FaithfulnessCurve | None,
) -> list[PageStop]:
    """MIB's circuits of both rankings, int(k * N) edges in MIB's units, each with its value on
    the curve (checked: the curve's circuit at that size has as many edges)."""
    stops = []
    for ranking in RANKINGS:
        absolute = ranking == "abs"
        for i, (k, at_k) in enumerate(
            zip(fractions, kept.at(fractions, absolute=absolute, units=units))
        ):
            value = None
            if curve is not None:
                counts = curve.abs_n_edges if absolute else curve.signed_n_edges
                if counts[i] != at_k.count(units):
                    raise ValueError(
                        f"the curve's circuit at {k:g} ({ranking} ranking) has {counts[i]} edges, "
                        f"these scores give {at_k.count(units)}: pass the curve measured on "
                        "these scores"
                    )
                value = (curve.abs_values if absolute else curve.signed_values)[i]
            label = f"{100 * k:g} % ({at_k.n_edges:,} edges)"
            stops.append(PageStop(at_k, label, k, value, ranking))
    return stops


def _heads(
    graph: Graph,
    model: HookedModel | None,
    clean: Tokens | None,
    metric: MetricFn | None,
    n_pairs: int,
    ra: ReversedAttention | None,
) -> ReversedAttention | None:
    """The RA the page's heads show: `ra` as given, or `heads_ra` of model, clean and metric."""
    if ra is not None:
        if model is not None or clean is not None:
            raise ValueError("pass ra= or model= with clean= and metric=, not both")
        return ra
    if model is not None:
        if clean is None or metric is None:
            raise ValueError("pass clean= and metric= with model= (for the heads' RA)")
        return heads_ra(model, clean, metric, n_pairs=n_pairs, graph=graph)
    if clean is not None or metric is not None:
        raise ValueError("pass model= with clean= and metric= (for the heads' RA)")
    return None
