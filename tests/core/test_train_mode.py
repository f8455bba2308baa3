"""Every public function that runs a model gives one answer in train mode (the answer of eval
mode, the same on every call) and leaves the model exactly as it found it: each module's own mode
(a bridge's HuggingFace modules included), requires_grad, .grad, parameter values and hooks, also
when the metric raises.

The model (`helpers.dropout_model`) is a tiny float64 GPT-2 bridge with dropout 0.3 held in train
mode, so any module left in train mode makes two calls differ. TransformerLens 2's
HookedTransformer has no dropout, so under TL 2 only the mode bookkeeping is exercised.

To cover a new function, append one (name, function(model) -> tensor) pair to `CASES`; a function
with a `metric` parameter is also run with a metric that raises.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from helpers import CLEAN_TOKENS as TOKENS
from helpers import CORRUPTED_TOKENS as CORRUPTED
from helpers import FLORENCE as PROMPT
from helpers import TOY_TASK, dropout_model, has_bridge, hook_count, live_archs, module_modes
from torch import Tensor

import ra_lens
from ra_lens import capture, circuits, tasks
from ra_lens import ranking as rk
from ra_lens.capture import model_modules
from ra_lens.experiments.attention_patching import attention_patching
from ra_lens.experiments.head_ranking import head_ranking
from ra_lens.metrics import logit_diff, target_nll
from ra_lens.patching import last_token_means, mean_head_outputs
from ra_lens.toy_models import tiny_model

TARGETS = [30, 31]
NLL = target_nll(TARGETS)
DIFF = logit_diff([30, 31], [32, 33])


def _ra(memory: str, keep: str) -> Callable[..., Tensor]:
    def run(model, metric=NLL) -> Tensor:
        ra = ra_lens.reversed_attention(model, TOKENS, metric, memory=memory, keep=keep)
        kept = {"maps": ra.maps, "rows": ra.rows, "norms": ra.norms}[keep]
        return torch.cat([kept.flatten(), ra.norms.flatten(), ra.metric_values.flatten()])

    return run


def _attribution(method: str) -> Callable[..., Tensor]:
    def run(model, metric=DIFF) -> Tensor:
        att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, metric, method=method)
        return torch.cat([att.edges.flatten()] + [s.flatten() for s in att.by_position.values()])

    return run


def _patching(model) -> Tensor:
    result = attention_patching(
        model, TOY_TASK, shots=1, n_prompts=2, scales=[-4.0], progress=False
    )
    accs = [result.unpatched, *result.ra, *result.forward]
    return torch.cat([result.ra_maps.maps.flatten()] + [a.ranks.double() for a in accs])


def _dynamics(model, metric=NLL) -> Tensor:
    dyn = ra_lens.edit_dynamics(model, TOKENS, metric, lr=1e-2)
    return torch.cat([dyn.predicted.flatten(), dyn.actual.flatten()])


def _evaluate(model) -> Tensor:
    return tasks.evaluate(model, tasks.build_prompts(TOY_TASK, shots=1, seed=0)).ranks.double()


def _ablation_curve(model) -> Tensor:
    scores = rk.layer_ranking(model.cfg.n_layers, model.cfg.n_heads)
    curve = rk.ablation_curve(
        model, tasks.build_prompts(TOY_TASK, shots=1, seed=0), scores, (0, 0.5, 1)
    )
    return torch.cat([a.ranks.double() for a in curve.accuracies])


def _mean_ablation(model) -> Tensor:
    prompts = tasks.build_prompts(TOY_TASK, shots=1, seed=0)
    means = last_token_means(model, TOKENS)
    return rk.evaluate_ablated(model, prompts, [(0, 1), (1, 2)], means=means).ranks.double()


def _head_ranking(model) -> Tensor:
    result = head_ranking(
        model, TOY_TASK, shots=1, n_prompts=2, rankings=["forward"], fractions=[0.0, 1.0], n_boot=5,
        progress=False,
    )  # fmt: skip
    return torch.cat([s.flatten().double() for s in result.scores.values()])


def _circuit_scores(method: str) -> Callable[..., Tensor]:
    def run(model, metric=DIFF) -> Tensor:
        return circuits.attribute(model, TOKENS, CORRUPTED, metric, method=method, steps=2).scores

    return run


def _learned_mask(model, metric=DIFF) -> Tensor:
    return circuits.learn_mask(model, TOKENS, CORRUPTED, metric, steps=2).log_alpha


def _calibrated(model, metric=DIFF) -> Tensor:
    scores = circuits.attribute(model, TOKENS, CORRUPTED, DIFF, method="eap")
    chosen = circuits.calibrate_negatives(model, scores, TOKENS, CORRUPTED, metric, sizes=[0.5, 1])
    return torch.tensor(chosen.cmds)


def _discovered(model) -> Tensor:
    """No `metric` parameter: discover cuts the metric per half, so a plain callable (the raising
    one) is refused before any pass (tests/circuits/test_discover.py)."""
    metric = logit_diff([30, 31] * 2, [32, 33] * 2)
    clean, corrupted = TOKENS.repeat(2, 1), CORRUPTED.repeat(2, 1)
    return circuits.discover(model, clean, corrupted, metric, steps=2, ig_steps=1).scores


def _half_circuit(model, parity: int) -> circuits.Circuit:
    """Every other edge of the model's graph (those whose flat index has this parity)."""
    graph = circuits.Graph.from_model(model)
    every_other = (torch.arange(graph.real.numel()) % 2 == parity).view_as(graph.real)
    return circuits.Circuit(graph, graph.real & every_other)


def _faithfulness(model, metric=DIFF) -> Tensor:
    circuit = _half_circuit(model, 0)
    return circuits.faithfulness(model, circuit, TOKENS, CORRUPTED, metric).circuit_per_pair


def _evaluator_mean(model, metric=DIFF) -> Tensor:
    evaluate = circuits.FaithfulnessEvaluator(model, TOKENS, CORRUPTED, metric, ablation="mean")
    return evaluate(_half_circuit(model, 1)).circuit_per_pair


#: (name, function(model) -> tensor): every public function that runs a model.
CASES: list[tuple[str, Callable[..., Tensor]]] = [
    *[(f"ra-{m}-{k}", _ra(m, k)) for m in ("full", "layerwise") for k in ("maps", "norms", "rows")],
    ("attribution-exact", _attribution("exact")),
    ("attribution-linear", _attribution("linear")),
    ("attribution-exact-ig", _attribution("exact-ig")),
    ("attention_patching", _patching),
    ("evaluate", _evaluate),
    ("ra_ranking", lambda m: rk.ra_ranking(m, TOKENS, TARGETS, per_prompt=True)),
    ("ra_ranking-loss_row", lambda m: rk.ra_ranking(m, TOKENS, TARGETS, loss_row=True)),
    ("temperature_ranking", lambda m: rk.temperature_ranking(m, TOKENS, TARGETS)),
    ("forward_ranking", lambda m: rk.forward_ranking(m, TOKENS, per_prompt=True)),
    ("causal_mediation", lambda m: rk.causal_mediation(m, TOKENS, TARGETS, per_prompt=True)),
    ("first_order_mediation", lambda m: rk.first_order_mediation(m, TOKENS, TARGETS)),
    ("indirect_effect", lambda m: rk.indirect_effect(m, TOKENS, CORRUPTED, TARGETS)),
    ("activation_patching", lambda m: rk.activation_patching(m, TOKENS, CORRUPTED, TARGETS)),
    ("attribution_patching", lambda m: rk.attribution_patching(m, TOKENS, CORRUPTED, TARGETS)),
    ("exact_qk_attribution", lambda m: rk.exact_qk_attribution(m, TOKENS, CORRUPTED, TARGETS)),
    ("last_token_means", lambda m: last_token_means(m, TOKENS)),
    ("mean_head_outputs", lambda m: mean_head_outputs(m, TOKENS)),
    ("ablation_curve", _ablation_curve),
    ("evaluate_ablated-mean", _mean_ablation),
    ("head_ranking", _head_ranking),
    *[
        (f"circuits.attribute-{m}", _circuit_scores(m))
        for m in ("eap", "eap-ig", "exact", "eap-ig-act")
    ],
    ("circuits.learn_mask", _learned_mask),
    ("circuits.calibrate_negatives", _calibrated),
    ("circuits.discover", _discovered),
    ("circuits.faithfulness", _faithfulness),
    ("circuits.FaithfulnessEvaluator", _evaluator_mean),
]
if has_bridge():  # edit_dynamics refuses HookedTransformer (see ra_lens.dynamics.SUPPORTED)
    CASES.append(("edit_dynamics", _dynamics))


@pytest.fixture(scope="module")
def model():
    return dropout_model()


@pytest.mark.parametrize("run", [fn for _, fn in CASES], ids=[name for name, _ in CASES])
def test_train_mode_gives_the_eval_answer_and_restores_modes(model, run):
    model.train()
    modes = module_modes(model)
    assert all(training for _, training in modes)  # the HF modules too: dropout is live
    first, second = run(model), run(model)
    assert module_modes(model) == modes
    for module in model_modules(model):
        module.eval()
    try:
        reference = run(model)
    finally:
        model.train()
    torch.testing.assert_close(first, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)


def test_the_dropout_model_is_random_in_prompts_mode(model):
    if not has_bridge():
        pytest.skip("TransformerLens 2's HookedTransformer has no dropout")
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(TOKENS), model(TOKENS))


def _state(model) -> tuple:
    """Everything a call must leave as it was: module modes, requires_grad, .grad (the same
    tensor, with the same values), parameter values and the hooks on every hook point and module."""
    params = list(model.parameters())
    return (
        module_modes(model),
        [p.requires_grad for p in params],
        [None if p.grad is None else (id(p.grad), p.grad.clone()) for p in params],
        [p.detach().clone() for p in params],
        hook_count(model),
    )


@pytest.fixture(scope="module")
def pristine():
    """A dropout model never run nor changed: each test gets a deep copy (~0.02 s; a build
    takes ~0.2 s)."""
    return dropout_model()


@pytest.fixture
def mixed_model(pristine):
    """The dropout model in a state worth restoring: train mode with one module in eval mode,
    half the parameters frozen, one with a .grad already."""
    model = copy.deepcopy(pristine)
    modules = model_modules(model)
    modules[len(modules) // 2].eval()
    params = list(model.parameters())
    for p in params[::2]:
        p.requires_grad_(False)
    params[1].grad = torch.full_like(params[1], 7.0)
    with torch.no_grad():  # a bridge adds its own hooks on the first use of each hook point
        model.run_with_cache(TOKENS)
    return model


def _raises(logits):
    raise KeyError("metric failed")


@pytest.mark.parametrize("run", [fn for _, fn in CASES], ids=[name for name, _ in CASES])
def test_leaves_the_model_exactly_as_found(mixed_model, run):
    before = _state(mixed_model)
    run(mixed_model)
    if "metric" in inspect.signature(run).parameters:
        with pytest.raises(KeyError, match="metric failed"):
            run(mixed_model, metric=_raises)
    after = _state(mixed_model)
    assert after[0] == before[0] and after[1] == before[1] and after[4] == before[4]
    for found, kept in zip(after[2], before[2]):
        assert (found is None) == (kept is None)
        if found is not None:
            assert found[0] == kept[0] and torch.equal(found[1], kept[1])
    assert all(torch.equal(a, b) for a, b in zip(after[3], before[3]))


@pytest.fixture(scope="module", params=live_archs())
def tiny(request):
    return tiny_model(request.param, n_layers=2)


def test_mixed_train_eval_modes_come_back_module_by_module(tiny):
    """RA runs in eval mode and restores each submodule's own mode (not one mode for all)."""
    modules = list(tiny.modules())
    tiny.train()
    modules[len(modules) // 2].eval()
    before = [m.training for m in modules]
    seen = []
    hooks = [(capture.PATTERN.format(0), lambda x, hook: seen.append(tiny.training))]
    with tiny.hooks(fwd_hooks=hooks):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll(5))
    try:
        assert seen and not any(seen)  # every forward pass ran in eval mode
        assert [m.training for m in modules] == before
    finally:
        tiny.eval()
