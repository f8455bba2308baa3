"""Every public function that runs a model gives one answer in train mode: the answer of eval
mode, the same on every call, with each module's own mode (a bridge's HuggingFace modules
included) restored afterwards.

The model (`helpers.dropout_model`) is a tiny float64 GPT-2 bridge with dropout 0.3 held in train
mode, so any module left in train mode makes two calls differ. TransformerLens 2's
HookedTransformer has no dropout, so under TL 2 only the mode bookkeeping is exercised.

To cover a new function, append one (name, function(model) -> tensor) pair to `CASES`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import dropout_model, has_bridge, module_modes
from torch import Tensor

import ra_lens
from ra_lens import tasks
from ra_lens.capture import model_modules
from ra_lens.experiments.attention_patching import attention_patching
from ra_lens.metrics import logit_diff, target_nll

TOKENS = torch.tensor([[0, 5, 9, 14, 20, 33, 7, 41, 12], [0, 8, 3, 14, 25, 33, 7, 40, 12]])
CORRUPTED = torch.tensor([[0, 5, 17, 14, 20, 61, 7, 41, 12], [0, 8, 3, 19, 25, 33, 70, 40, 12]])
NLL = target_nll([30, 31])
DIFF = logit_diff([30, 31], [32, 33])
TOY = tasks.Task(
    "toy",
    [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"), ("s", "the")]
    + [("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")],
)


def _ra(memory: str, keep: str) -> Callable[[object], Tensor]:
    def run(model) -> Tensor:
        ra = ra_lens.reversed_attention(model, TOKENS, NLL, memory=memory, keep=keep)
        kept = {"maps": ra.maps, "rows": ra.rows, "norms": ra.norms}[keep]
        return torch.cat([kept.flatten(), ra.norms.flatten(), ra.metric_values.flatten()])

    return run


def _attribution(method: str) -> Callable[[object], Tensor]:
    def run(model) -> Tensor:
        att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, DIFF, method=method)
        return torch.cat([att.edges.flatten()] + [s.flatten() for s in att.by_position.values()])

    return run


def _patching(model) -> Tensor:
    result = attention_patching(model, TOY, shots=1, n_train=2, scales=[-4.0], progress=False)
    accs = [result.unpatched, *result.ra, *result.forward]
    return torch.cat([result.ra_maps.maps.flatten()] + [a.ranks.double() for a in accs])


def _dynamics(model) -> Tensor:
    dyn = ra_lens.edit_dynamics(model, TOKENS, NLL, lr=1e-2)
    return torch.cat([dyn.predicted.flatten(), dyn.actual.flatten()])


def _evaluate(model) -> Tensor:
    return tasks.evaluate(model, tasks.build_prompts(TOY, shots=1, seed=0)).ranks.double()


#: (name, function(model) -> tensor): every public function that runs a model.
CASES: list[tuple[str, Callable[[object], Tensor]]] = [
    *[(f"ra-{m}-{k}", _ra(m, k)) for m in ("full", "layerwise") for k in ("maps", "norms", "rows")],
    ("attribution-exact", _attribution("exact")),
    ("attribution-linear", _attribution("linear")),
    ("attention_patching", _patching),
    ("evaluate", _evaluate),
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


def test_the_dropout_model_is_random_in_train_mode(model):
    if not has_bridge():
        pytest.skip("TransformerLens 2's HookedTransformer has no dropout")
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(TOKENS), model(TOKENS))
