"""The one node-patching ground truth (ranking/node_patching.py) against TransformerLens's own
patching code and a hand-written loop, and the model left as found."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_CORRUPTED as CORRUPTED
from helpers import TOY_TARGETS as TARGETS
from helpers import arch_or_hooked, clean_z

from ra_lens import ranking as rk
from ra_lens.capture import Z, to_batch
from ra_lens.metrics import target_nll, target_prob
from ra_lens.ranking.node_patching import patching_effects
from ra_lens.toy_models import tiny_model


def test_head_outputs_patched_equal_transformer_lens_activation_patching():
    model = tiny_model(arch_or_hooked("llama"), n_layers=2)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    jobs = [("output", la, h, None) for la in range(n_layers) for h in range(n_heads)]
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    effects = patching_effects(
        model, clean, corrupted, target_prob(TARGETS), jobs, max_rows=5, progress=False
    )
    expected = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS)
    torch.testing.assert_close(
        effects.mean(1).reshape(n_layers, n_heads).float(), expected, rtol=1e-4, atol=1e-7
    )


def test_one_output_job_equals_a_hand_written_hook():
    model = tiny_model(arch_or_hooked("llama"), n_layers=2)
    layer, head = 1, 2
    clean, corrupted = model.to_tokens(CLEAN[0]), model.to_tokens(CORRUPTED[0])
    source = clean_z(model, clean)[layer]

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = source[:, :, head]
        return z

    def nll(logits: torch.Tensor) -> float:
        return -float(logits[0, -1].double().log_softmax(-1)[TARGETS[0]])

    with torch.no_grad():
        base = nll(model(corrupted))
        with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
            patched = nll(model(corrupted))
    effects = patching_effects(
        model,
        to_batch(model, CLEAN[:1]),
        to_batch(model, CORRUPTED[:1]),
        target_nll(TARGETS[:1]),
        [("output", layer, head, None)],
        progress=False,
    )
    assert float(effects[0, 0]) == pytest.approx(patched - base, abs=1e-6)
    assert abs(patched - base) > 1e-3  # the head matters: the check is not vacuous


def test_the_model_is_left_in_the_mode_it_was_found_in():
    model = tiny_model(arch_or_hooked("gpt2"), n_layers=2).train()
    jobs = [("pattern", 0, 1, None), ("query", 1, 0, 2)]
    patching_effects(
        model,
        to_batch(model, CLEAN[:1]),
        to_batch(model, CORRUPTED[:1]),
        target_prob(TARGETS[:1]),
        jobs,
        progress=False,
    )
    assert model.training and not model.hook_dict[Z.format(0)].fwd_hooks
