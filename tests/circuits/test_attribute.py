"""`circuits.attribute`, `faithfulness` and `learn_mask` read the model's per-layer facts once per call;
eap-ig-act's bad input is refused naming the fix and leaves the model as found."""

from __future__ import annotations

import math
from typing import Any, Literal

import pytest
import torch
from helpers import (
    PAIR_CLEAN,
    PAIR_CORRUPTED,
    PAIR_METRIC,
    count_fact_reads,
    has_bridge,
    hooked_toy,
    snapshot,
)

from ra_lens import pairs
from ra_lens.capture import to_batch
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.faithfulness import faithfulness
from ra_lens.circuits.masks import learn_mask
from ra_lens.circuits.scores import EdgeScores
from ra_lens.toy_models import tiny_model

CLEAN, CORRUPTED, METRIC = PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC  # right-padded: unequal lengths


@pytest.mark.parametrize("method", ["exact-ig", "eap", "eap-ig-act"])
def test_attribute_reads_each_layers_facts_once(
    monkeypatch: pytest.MonkeyPatch, method: Literal["exact-ig", "eap", "eap-ig-act"]
) -> None:
    """One `attribute` call (3 integrated-gradient steps, 2 batches) reads block_layout and
    attention_facts at most once per layer (before: block_layout ~4 times per layer and pass,
    attention_facts per step and layer)."""
    model = tiny_model("llama", dtype=torch.float64) if has_bridge() else hooked_toy()
    n_layers = int(model.cfg.n_layers)
    calls = count_fact_reads(monkeypatch)
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method=method, steps=3, batch_size=1)
    assert isinstance(scores, EdgeScores) and bool(scores.scores.abs().sum() > 0)
    assert calls["block_layout"] <= n_layers, calls
    assert calls["attention_facts"] <= n_layers, calls


def test_faithfulness_reads_each_layers_facts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("gpt2", dtype=torch.float64) if has_bridge() else hooked_toy()
    n_layers = int(model.cfg.n_layers)
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap")
    assert isinstance(scores, EdgeScores)
    calls = count_fact_reads(monkeypatch)
    result = faithfulness(model, scores.top(5), CLEAN, CORRUPTED, METRIC, batch_size=1)
    clean = to_batch(model, CLEAN)
    with torch.no_grad():  # the clean run is the model's own (no edge patched there)
        expected = float(pairs.metric_values(METRIC, model(clean.tokens), clean).mean())
    assert result.clean_metric == pytest.approx(expected, rel=1e-9)
    assert calls["block_layout"] <= n_layers, calls
    assert calls["attention_facts"] <= n_layers, calls


def test_learn_mask_reads_each_layers_facts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two training steps over two batches (the warm start given, so no `attribute` inside)."""
    model = tiny_model("llama", dtype=torch.float64) if has_bridge() else hooked_toy()
    n_layers = int(model.cfg.n_layers)
    warm = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap")
    assert isinstance(warm, EdgeScores)
    calls = count_fact_reads(monkeypatch)
    learned = learn_mask(model, CLEAN, CORRUPTED, METRIC, steps=2, warm_start=warm, batch_size=1)
    assert len(learned.losses) == 2 and all(math.isfinite(loss) for loss in learned.losses)
    assert calls["block_layout"] <= n_layers, calls
    assert calls["attention_facts"] <= n_layers, calls


def _model_in_odd_state() -> Any:
    """A grouped-query toy in train mode, one parameter frozen and one with a .grad: what
    `attribute` must leave exactly so."""
    model = tiny_model("llama", dtype=torch.float64) if has_bridge() else hooked_toy(
        positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS"
    )  # fmt: skip
    with torch.no_grad():  # a bridge adds its own norm hooks on its first forward pass
        model(to_batch(model, CLEAN).tokens)
    params = list(model.parameters())
    params[0].requires_grad_(False)
    params[1].grad = torch.ones_like(params[1])
    return model.train()


def _as_found(model: Any, before: tuple[Any, ...]) -> bool:
    """Mode, requires_grad flags, every .grad (tensors compared by value) and hooks as before."""
    after = snapshot(model)
    grads = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(after[2], before[2], strict=True)
    )
    return after[0] == before[0] and after[1] == before[1] and grads and after[3] == before[3]


def test_eap_ig_act_refuses_bad_input_and_leaves_the_model() -> None:
    model = _model_in_odd_state()
    before = snapshot(model)
    with pytest.raises(ValueError, match="steps"):
        attribute(model, CLEAN, CORRUPTED, METRIC, method="eap-ig-act", steps=0)
    assert _as_found(model, before)

    def detached(logits: torch.Tensor, lengths: Any = None) -> torch.Tensor:
        return METRIC(logits, lengths=lengths).detach()

    with pytest.raises(ValueError, match="no gradient path to the logits"):
        attribute(model, CLEAN, CORRUPTED, detached, method="eap-ig-act", batch_size=2)
    assert _as_found(model, before)
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap-ig-act", steps=2)
    assert _as_found(model, before) and model.training
    assert bool(scores.scores.abs().gt(0).any()) and scores.ungrouped_scores is not None
