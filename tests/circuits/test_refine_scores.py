"""`circuits.refine`: greedy node multipliers within a budget of evaluations; the objective it
optimises never decreases and is what the evaluator measures of the refined scores."""

from __future__ import annotations

import pytest
import torch
from helpers import has_bridge

from ra_lens.circuits import (
    Circuit,
    EdgeScores,
    FaithfulnessEvaluator,
    attribute,
    refine,
)
from ra_lens.circuits.graph import Graph
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import tiny_model

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 50], [52, 60])


class Counting:
    """An evaluator that counts its calls."""

    def __init__(self, evaluate):
        self.evaluate, self.calls = evaluate, 0

    def __call__(self, circuit: Circuit):
        self.calls += 1
        return self.evaluate(circuit)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama" if has_bridge() else "hooked", dtype=torch.float64)
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap")
    return model, scores, FaithfulnessEvaluator(model, CLEAN, CORRUPTED, METRIC)


@pytest.mark.parametrize("absolute", [False, True])
def test_objective_never_decreases_and_the_budget_holds(setup, absolute):
    model, scores, evaluator = setup
    counting = Counting(evaluator)
    fractions = (0.05, 0.2)
    result = refine(scores, counting, fractions=fractions, absolute=absolute, candidates=6, budget=11)  # fmt: skip
    assert counting.calls == result.evaluations <= 11
    assert result.evaluations == 2 * (1 + len(result.steps))  # the start, then 2 per trial
    assert result.objective >= result.start_objective
    best = result.start_objective
    for step in result.steps:
        assert step.kept == (step.objective > best)
        best = max(best, step.objective)
    assert best == result.objective
    # the objective is what the evaluator measures of the refined scores' circuits
    n_total = scores.graph.n_edges_ungrouped
    values = [
        evaluator(result.scores.top(int(k * n_total), absolute=absolute, units="ungrouped")).value
        for k in fractions
    ]
    if absolute:
        expected = -sum(abs(1 - v) for v in values) / 2
    else:
        expected = sum(values) / 2
    assert result.objective == pytest.approx(expected, abs=1e-12)
    # untouched writers keep their scores; the refined scores are in MIB's sign
    kept = result.multipliers == 1
    owner = scores.graph.reader_owners.double()
    untouched_readers = (owner @ (~kept).double()) == 0
    mask = kept[:, None] & untouched_readers[None, :] & scores.graph.real
    torch.testing.assert_close(result.scores.scores[mask], scores.helps[mask], rtol=0, atol=0)


def test_a_node_that_hurts_is_pruned_and_one_that_helps_gets_its_place():
    """A made-up evaluator on a small graph: faithfulness rises with the edges out of a0.h1 kept
    and falls with those out of a0.h0, which the scores rank highest."""
    g = Graph(n_layers=2, n_heads=2, n_kv_heads=2, d_model=8)
    s = torch.ones(g.real.shape, dtype=torch.float64)
    for head, value in (("a0.h0", 10.0), ("a0.h1", 0.5)):  # a0.h0 the scores' favourite
        s[g.writer_index[head]] = value
        for port in ("q", "k", "v"):
            s[:, g.reader_index[f"{head}<{port}>"]] = value
    scores = EdgeScores(g, s * g.real, "made-up", "denoise")
    h0, h1 = g.writer_index["a0.h0"], g.writer_index["a0.h1"]

    def evaluate(circuit: Circuit) -> float:
        return float(circuit.edges[h1].sum()) - 2.0 * float(circuit.edges[h0].sum())

    result = refine(scores, evaluate, fractions=(0.5,), candidates=len(g.writers), budget=40)
    assert result.multipliers[h0] == 0.0  # tried first (the largest node score) and kept
    assert result.steps[0].node == "a0.h0" and result.steps[0].kept
    assert not result.scores.scores[h0].any()
    pruned = result.scores.top(int(0.5 * g.n_edges_ungrouped), units="ungrouped")
    assert not pruned.edges[h0].any() and pruned.edges[h1].any()
    start = scores.top(int(0.5 * g.n_edges_ungrouped), units="ungrouped")
    assert start.edges[h0].any() and not start.edges[h1].any()
    assert result.objective == evaluate(pruned) > result.start_objective == evaluate(start)


def test_cpu_budget_stops_before_a_trial():
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    scores = EdgeScores(g, g.real * 1.0, "ones", "denoise")
    ticks = iter(range(1000))
    counting = Counting(lambda c: float(c.n_edges))
    result = refine(scores, counting, budget=100, budget_s=2.5, clock=lambda: float(next(ticks)))
    # clock: 0 at the start, then one reading per trial check (1, 2, 3 -> stop at 3 >= 2.5)
    assert len(result.steps) == 2 and counting.calls == 3


def test_bad_input_is_refused(setup):
    _, scores, evaluator = setup
    with pytest.raises(ValueError, match="fractions"):
        refine(scores, evaluator, fractions=(5.0,))
    with pytest.raises(ValueError, match="budget"):
        refine(scores, evaluator, fractions=(0.1, 0.2), budget=1)
    with pytest.raises(ValueError, match="boost"):
        refine(scores, evaluator, boost=1.0)
    with pytest.raises(ValueError, match="candidates"):
        refine(scores, evaluator, candidates=-1)
    with pytest.raises(TypeError, match="EdgeScores"):
        refine(scores.scores, evaluator)  # type: ignore[arg-type]


def _hand_scores() -> EdgeScores:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    values = torch.arange(1.0, 1.0 + g.real.numel(), dtype=torch.float64).view_as(g.real)
    return EdgeScores(g, values * g.real, "eap", "denoise")


def test_an_evaluator_returning_nan_is_refused_at_its_first_answer():
    scores = _hand_scores()
    evaluate = Counting(lambda circuit: float("nan"))
    with pytest.raises(ValueError, match=r"evaluate \(.*Counting.*\) returned nan"):
        refine(scores, evaluate, budget=32)
    assert evaluate.calls == 1


def test_fractions_of_zero_edges_are_refused_naming_the_smallest():
    scores = _hand_scores()
    n = scores.graph.n_edges_ungrouped
    evaluate = Counting(lambda circuit: circuit.n_edges_ungrouped / n)
    with pytest.raises(ValueError, match=rf"int\(k \* N\) = 0 edges.*>= {1 / n:.3g}"):
        refine(scores, evaluate, fractions=(1e-4, 0.5))
    assert evaluate.calls == 0
    # the smallest fraction giving one edge is measured on a one-edge circuit
    refine(scores, evaluate, fractions=(1 / n,), budget=1)
    assert evaluate.calls == 1
