"""Learned edge masks (`circuits.masks`): the masked run is exact at its ends and for 0/1 masks
(ra-lens's own edge patching), its gradient is the true derivative, training raises the training
faithfulness, bad input is refused and the model is left as found. Float64 tiny models, both
TransformerLens worlds: GPT-2-like and Llama-like (grouped-query, rotary); post-norm (Gemma-2)
needs a TransformerBridge."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    PAIR_CLEAN,
    PAIR_CORRUPTED,
    PAIR_METRIC,
    circuit_toy,
    snapshot,
)

from ra_lens.capture import to_batch
from ra_lens.circuits import (
    Circuit,
    EdgeScores,
    Graph,
    LearnedMask,
    attribute,
    faithfulness,
    learn_mask,
)
from ra_lens.circuits.masks import masked_values
from ra_lens.metrics import logit_diff

CLEAN, CORRUPTED, METRIC = PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC  # right-padded: unequal lengths


# gemma2: post-norm blocks are patched only on a TransformerBridge (TL >= 3); tl4 marks it.
@pytest.fixture(scope="module", params=["gpt2", "llama", pytest.param("gemma2", marks=pytest.mark.tl4)])  # fmt: skip
def model(request):
    model = circuit_toy(request.param)
    with torch.no_grad():  # a bridge adds its own pre-hooks on its first forward pass
        model(model.to_tokens("Q: hot"))
    return model


@pytest.fixture(scope="module")
def warm(model) -> EdgeScores:
    """The warm start `learn_mask` computes when given none (eap-ig, 5 steps, on these pairs),
    computed once per model for the tests whose subject is not the warm start itself."""
    return attribute(model, CLEAN, CORRUPTED, METRIC, method="eap-ig", steps=5)


def _same_state(model, before) -> None:
    after = snapshot(model)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(after[2], before[2], strict=True)
    )


def _full(graph: Graph, value: float) -> torch.Tensor:
    return torch.full((len(graph.writers), len(graph.readers)), value, dtype=torch.float64)


def test_all_ones_is_the_clean_run_and_all_zeros_the_corrupted_run(model):
    graph = Graph.from_model(model)
    before = snapshot(model)
    kept = masked_values(model, CLEAN, CORRUPTED, METRIC, _full(graph, 1.0))
    patched = masked_values(model, CLEAN, CORRUPTED, METRIC, _full(graph, 0.0))
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    with torch.no_grad():
        clean_m = METRIC(model(clean.tokens), lengths=clean.lengths)
        corrupted_m = METRIC(model(corrupted.tokens), lengths=corrupted.lengths)
    assert torch.equal(kept.detach(), clean_m)  # no reader changed: bit for bit
    torch.testing.assert_close(patched.detach(), corrupted_m, rtol=0, atol=1e-10)
    assert float((clean_m - corrupted_m).abs().min()) > 1e-4  # the two runs differ
    _same_state(model, before)


def test_a_zero_one_mask_is_ra_lens_edge_patching_of_that_circuit(model):
    graph = Graph.from_model(model)
    generator = torch.Generator().manual_seed(3)
    for share in (0.1, 0.5, 0.9):
        edges = (torch.rand(graph.real.shape, generator=generator) < share) & graph.real
        values = masked_values(model, CLEAN, CORRUPTED, METRIC, edges.double())
        expected = faithfulness(model, Circuit(graph, edges), CLEAN, CORRUPTED, METRIC)
        torch.testing.assert_close(values.detach(), expected.circuit_per_pair, rtol=0, atol=1e-10)
        assert float((values.detach() - expected.clean_per_pair).abs().max()) > 1e-6


def _random_mask(graph: Graph, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 0.2 + 0.6 * torch.rand(graph.real.shape, generator=generator, dtype=torch.float64)


def _gradient(model, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(masked_values(model, CLEAN, CORRUPTED, METRIC, mask).sum(), mask)
    return grad


def _difference(model, mask: torch.Tensor, step: torch.Tensor) -> float:
    """Central difference of the summed metric along `step` (over 2 |step|)."""
    with torch.no_grad():
        up = masked_values(model, CLEAN, CORRUPTED, METRIC, mask + step).sum()
        down = masked_values(model, CLEAN, CORRUPTED, METRIC, mask - step).sum()
    return float(up - down) / 2


def test_the_gradient_is_the_directional_finite_difference(model):
    # Along random directions over every edge at once, with a step large enough to stand above
    # the rounding of HuggingFace's attention, which takes its softmax in float32 even in a
    # float64 model (a bridge's Llama and Gemma-2): one edge's tiny step drowns in it.
    graph = Graph.from_model(model)
    mask = _random_mask(graph, 0)
    grad = _gradient(model, mask)
    assert bool(grad[~graph.real].eq(0).all()) and float(grad.abs().max()) > 1e-4
    # Richardson's extrapolation from steps eps and 2 eps cancels the eps^2 error
    eps = 1e-2
    for seed in (1, 2):
        direction = torch.randn(graph.real.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # fmt: skip
        near = _difference(model, mask, eps * direction) / eps
        far = _difference(model, mask, 2 * eps * direction) / (2 * eps)
        numeric = (4 * near - far) / 3
        assert float((grad * direction).sum()) == pytest.approx(numeric, rel=1e-3)


def test_the_gradient_of_each_edge_is_its_finite_difference():
    # GPT-2-like toy: float64 end to end, so one edge's tiny step is exact to 1e-5.
    model = circuit_toy("gpt2")
    graph = Graph.from_model(model)
    mask = _random_mask(graph, 0)
    grad = _gradient(model, mask)
    # one edge into each kind of reader, from the input, a head and an MLP
    names = ["input->a1.h0<q>", "a0.h1->a1.h1<k>", "a0.h3->a1.h0<v>", "m0->m1", "a1.h2->logits", "input->m0"]  # fmt: skip
    eps = 1e-6
    for name in names:
        step = torch.zeros_like(mask)
        step[graph.edge_index(name)] = eps
        numeric = _difference(model, mask, step) / eps
        assert float(grad[graph.edge_index(name)]) == pytest.approx(numeric, rel=1e-5, abs=1e-9), (
            name
        )


@pytest.mark.parametrize(("rule", "lr"), [("adam", 0.3), ("scaled", 1.0)])
def test_training_raises_the_training_faithfulness_and_ranks_every_edge(model, warm, rule, lr):
    before = snapshot(model)
    result = learn_mask(
        model, CLEAN, CORRUPTED, METRIC, steps=6, lr=lr, sparsity=0.0, rule=rule, warm_start=warm
    )
    assert isinstance(result, LearnedMask)
    assert len(result.faithfulness) == 6 and len(result.kept) == 6
    assert result.faithfulness[-1] > result.faithfulness[0] + 0.01
    assert result.losses[-1] < result.losses[0]
    graph = result.scores.graph
    assert torch.equal(result.scores.scores, result.log_alpha)
    assert bool(result.log_alpha[~graph.real].eq(0).all())
    torch.testing.assert_close(result.mask, torch.sigmoid(result.log_alpha) * graph.real)
    assert result.scores.method == "mask" and result.scores.direction == "denoise"
    half = graph.n_edges_ungrouped // 2
    assert result.seconds > 0 and 0 < result.scores.top(half).n_edges_ungrouped <= half
    _same_state(model, before)


def test_the_warm_start_is_eap_ig_and_the_sparsity_turns_edges_off(model):
    graph = Graph.from_model(model)
    warm = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=1, lr=1e-6, ig_steps=3).warm_start
    assert warm.method == "eap-ig"
    helps = warm.helps
    scale = helps[graph.real].pow(2).mean().sqrt()
    # with a tiny learning rate log_alpha stays at init_scale * helps / rms
    tiny = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=1, lr=1e-9, warm_start=warm, init_scale=2.0)  # fmt: skip
    torch.testing.assert_close(tiny.log_alpha, 2 * helps / scale * graph.real, rtol=0, atol=1e-6)
    sparse = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=8, lr=0.3, sparsity=50.0, warm_start=warm)  # fmt: skip
    free = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=8, lr=0.3, sparsity=0.0, warm_start=warm)  # fmt: skip
    assert sparse.kept[-1] < free.kept[-1]


def test_grouped_copies_share_the_learned_score(model, warm):
    result = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=2, lr=0.1, warm_start=warm)
    g, scores = result.scores.graph, result.scores
    if g.group == 1:
        assert scores.ungrouped_scores is None
        return
    assert scores.ungrouped_scores is not None
    summed = torch.zeros_like(scores.scores).index_add_(1, g.ungrouped_target, scores.ungrouped_scores)  # fmt: skip
    torch.testing.assert_close(summed, scores.scores, rtol=0, atol=1e-12)
    # an edge training leaves alone keeps the warm start's own per-copy scores (MIB's evaluator
    # ranks copies): with a vanishing step every copy is its warm score over the same rms
    still = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=1, lr=1e-12, rule="scaled", warm_start=warm)  # fmt: skip
    rms = warm.helps[g.real].pow(2).mean().sqrt()
    expected = warm.ungrouped_helps / rms * g.real[:, g.ungrouped_target]
    torch.testing.assert_close(still.scores.ungrouped_scores, expected, rtol=1e-6, atol=1e-9)


def test_the_faithful_objective_brings_f_towards_one(model, warm):
    result = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=6, lr=0.3, sparsity=0.0, objective="faithful", warm_start=warm)  # fmt: skip
    assert abs(result.faithfulness[-1] - 1) < abs(result.faithfulness[0] - 1)
    assert result.losses[-1] == pytest.approx((result.faithfulness[-1] - 1) ** 2)


def test_the_scaled_rule_moves_each_edge_by_its_own_gradient(model, warm):
    graph = Graph.from_model(model)
    start = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=1, lr=1e-12, rule="scaled", warm_start=warm)  # fmt: skip
    moved = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=1, lr=0.5, rule="scaled", warm_start=warm)  # fmt: skip
    # one step: log_alpha - lr * g / rms(g), g = d(-f)/d log_alpha = -sigmoid'(la) df/dm
    mask = torch.sigmoid(start.log_alpha).requires_grad_(True)
    f = masked_values(model, CLEAN, CORRUPTED, METRIC, mask).mean()
    (df,) = torch.autograd.grad(f, mask)
    ends = [masked_values(model, CLEAN, CORRUPTED, METRIC, _full(graph, v)).mean() for v in (1, 0)]
    gap_sign = 1.0 if float(ends[0] - ends[1]) > 0 else -1.0  # f divides by m(clean) - m(empty)
    g = -gap_sign * (df * mask * (1 - mask)).detach() * graph.real
    expected = start.log_alpha - 0.5 * g / g[graph.real].pow(2).mean().sqrt()
    torch.testing.assert_close(moved.log_alpha, expected * graph.real, rtol=0, atol=1e-5)


def test_a_cpu_budget_stops_training(model, warm):
    result = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=50, budget_s=1e-9, warm_start=warm)
    assert len(result.faithfulness) == 1


def test_bad_input_is_refused_naming_the_fix(model, warm):
    graph = Graph.from_model(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=0)
    with pytest.raises(ValueError, match="positive number of CPU seconds"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, budget_s=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        learn_mask(model, CLEAN[:1], CORRUPTED[:1], logit_diff([294], [52]))
    nan = torch.zeros(graph.real.shape, dtype=torch.float64)
    nan[graph.real.nonzero()[0].tolist()[0], graph.real.nonzero()[0].tolist()[1]] = float("nan")
    with pytest.raises(ValueError, match="non-finite .* warm_start=None"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, warm_start=nan)
    other = EdgeScores(Graph(1, 2, 1, 8), Graph(1, 2, 1, 8).real.double(), "eap", "denoise")
    with pytest.raises(ValueError, match="attribute this model"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, warm_start=other)
    with pytest.raises(ValueError, match="objective='kl'"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, objective="kl")
    with pytest.raises(ValueError, match="rule='sgd'"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, rule="sgd")
    with pytest.raises(ValueError, match="collapsed to empty.*lower sparsity"):
        learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=4, lr=5.0, sparsity=1e6, init_scale=0.1, warm_start=warm)  # fmt: skip
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        masked_values(model, CLEAN, CORRUPTED, METRIC, _full(graph, 1.5))
    with pytest.raises(ValueError, match="same mean metric"):
        learn_mask(model, CLEAN, CLEAN, METRIC)
    _same_state(model, before)
