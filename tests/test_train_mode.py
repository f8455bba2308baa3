"""Every ranking and every ablation evaluation gives one answer in train mode: the answer of eval
mode, the same on every call, with each module's own mode restored afterwards. The engine
(`ranking.engine.rank`, `capture.preserved_state`) decides the mode for all of them.

The model is a tiny float64 GPT-2 bridge with dropout 0.3 held in train mode, so a ranking run in
the caller's mode differs between two calls. TransformerLens 2's HookedTransformer has no dropout,
so under TL 2 only the mode bookkeeping is exercised.

To cover a new function, append one (name, function(model) -> tensor) pair to `CASES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import has_bridge
from torch import Tensor

from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens.experiments.head_ranking import head_ranking
from ra_lens.patching import last_token_means, mean_head_outputs
from ra_lens.toy_models import tiny_model

TOKENS = torch.tensor([[0, 5, 9, 14, 20, 33, 7, 41, 12], [0, 8, 3, 14, 25, 33, 7, 40, 12]])
CORRUPTED = torch.tensor([[0, 5, 17, 14, 20, 61, 7, 41, 12], [0, 8, 3, 19, 25, 33, 70, 40, 12]])
TARGETS = [30, 31]
TOY = tasks.Task(
    "toy",
    [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"), ("s", "the")]
    + [("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")],
)
PROMPTS = tasks.build_prompts(TOY, shots=1, seed=0)


def _dropout_model() -> Any:
    """A tiny float64 model in train mode: under TL 4 a GPT-2 bridge whose dropout modules (in
    its blocks) drop 30%; under TL 2 the plain tiny HookedTransformer (no dropout)."""
    if not has_bridge():
        return tiny_model("hooked", dtype=torch.float64).train()
    model = tiny_model("gpt2", dtype=torch.float64)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.3
    return model.train()


def _modes(model: Any) -> list[bool]:
    return [m.training for m in model.modules()]


def _ablation_curve(model: Any) -> Tensor:
    scores = rk.layer_ranking(model.cfg.n_layers, model.cfg.n_heads)
    curve = rk.ablation_curve(model, PROMPTS, scores, (0.0, 0.5, 1.0))
    return torch.cat([a.ranks.double() for a in curve.accuracies])


def _mean_ablation(model: Any) -> Tensor:
    means = last_token_means(model, TOKENS)
    return rk.evaluate_ablated(model, PROMPTS, [(0, 1), (1, 2)], means=means).ranks.double()


def _head_ranking(model: Any) -> Tensor:
    result = head_ranking(
        model, TOY, shots=1, n_prompts=2, rankings=["forward"], fractions=[0.0, 1.0], n_boot=5,
        progress=False,
    )  # fmt: skip
    return torch.cat([s.flatten().double() for s in result.scores.values()])


#: (name, function(model) -> tensor): every ranking and ablation evaluation that runs a model.
CASES: list[tuple[str, Callable[[Any], Tensor]]] = [
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
]


@pytest.fixture(scope="module")
def model():
    return _dropout_model()


def _state_covers_hf_modules() -> bool:
    """Whether `capture.preserved_state` also switches a bridge's HuggingFace modules (those
    outside `model.modules()`, e.g. `original_model`) to eval mode."""
    if not has_bridge():
        return True
    model = tiny_model("gpt2").train()
    with capture.preserved_state(model):
        return not model.original_model.training


#: TransformerLens 4's own activation patching checks every module, the HuggingFace ones too.
NEEDS_HF_MODES = {"activation_patching"}


def _params() -> list[Any]:
    covered = _state_covers_hf_modules()
    mark = pytest.mark.xfail(
        not covered,
        reason="capture.preserved_state leaves original_model in train mode",
        strict=True,
    )
    return [
        pytest.param(fn, id=name, marks=mark if name in NEEDS_HF_MODES else ())
        for name, fn in CASES
    ]


@pytest.mark.parametrize("run", _params())
def test_train_mode_gives_the_eval_answer_and_restores_modes(model, run):
    model.train()
    modes = _modes(model)
    first, second = run(model), run(model)
    assert _modes(model) == modes
    model.eval()
    try:
        reference = run(model)
    finally:
        model.train()
    torch.testing.assert_close(first, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)


def test_the_dropout_model_is_random_in_train_mode(model):
    if not has_bridge():
        pytest.skip("TransformerLens 2's HookedTransformer has no dropout")
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(TOKENS), model(TOKENS))
