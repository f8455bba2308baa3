"""live_attention's seam and copies of the model: a deep copy made inside the block is an
independent model (its attention runs its own modules), and deep-copying calls (edit_dynamics)
work inside the block as outside. OPT's adapter is the one that delegates attention to
HuggingFace, so these need TransformerBridge (TL >= 3): marked tl4."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CLEAN_TOKENS, bridge_model

import ra_lens
from ra_lens.dynamics import edit_dynamics
from ra_lens.metrics import target_nll

SEAM = ("forward", "accepts_pattern_fn", "__getstate__")


def seam_attrs(model) -> list[set[str]]:
    """The seam's instance attributes on each layer's HuggingFace attention module."""
    return [set(SEAM) & set(vars(b.attn.original_component)) for b in model.blocks]


@pytest.mark.tl4
def test_deepcopy_inside_live_attention_is_independent() -> None:
    """Zeroing the clone's q/k/v changes the clone's output and not the original's (before the
    fix, the clone's attention ran the original's modules: it changed by 0, even after the
    block); the clone carries no seam, and the original's is removed on exit."""
    model = bridge_model("opt", dtype=torch.float64)
    tokens = CLEAN_TOKENS[:1]
    with torch.no_grad():
        before = model(tokens)
    with ra_lens.live_attention(model):
        assert seam_attrs(model) == [set(SEAM)] * model.cfg.n_layers
        clone = copy.deepcopy(model)
        assert seam_attrs(clone) == [set()] * model.cfg.n_layers
        with torch.no_grad():
            torch.testing.assert_close(clone(tokens), before, rtol=0, atol=1e-12)
            for block in clone.blocks:
                for name in ("q", "k", "v"):
                    getattr(block.attn, name).original_component.weight.zero_()
            inside = float((clone(tokens) - before).abs().max())
            assert torch.equal(model(tokens), before)
    with torch.no_grad():
        after = float((clone(tokens) - before).abs().max())
        assert torch.equal(model(tokens), before)
    assert inside > 1e-2 and after == inside
    assert seam_attrs(model) == [set()] * model.cfg.n_layers


@pytest.mark.tl4
def test_deepcopy_inside_live_attention_keeps_a_forward_the_module_had() -> None:
    """A module with its own instance forward (accelerate's dispatch) gives the clone a copy of
    that forward, bound to the clone's module, not the seam's."""
    model = bridge_model("opt", dtype=torch.float64)
    inner = model.blocks[0].attn.original_component
    inner.forward = inner.forward  # a bound method on the instance, as accelerate stores it
    with ra_lens.live_attention(model):
        clone = copy.deepcopy(model)
    cloned = clone.blocks[0].attn.original_component
    assert set(vars(cloned)) & set(SEAM) == {"forward"}
    assert cloned.forward.__self__ is cloned and cloned.forward.__func__ is type(inner).forward


@pytest.mark.tl4
def test_edit_dynamics_on_opt_inside_live_attention() -> None:
    """edit_dynamics steps a deep copy; inside the block that copy used to run the original's
    attention, so OPT was refused ("did not fire the hooks ... supported: ... OPT"). It now gives
    the same answer as outside the block."""
    model = bridge_model("opt", dtype=torch.float64)
    metric = target_nll([5, 7])
    outside = edit_dynamics(model, CLEAN_TOKENS, metric, 1e-3)
    with ra_lens.live_attention(model):
        inside = edit_dynamics(model, CLEAN_TOKENS, metric, 1e-3)
    assert float(inside.cosine.min()) > 0.99
    torch.testing.assert_close(inside.predicted, outside.predicted, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(inside.actual, outside.actual, rtol=1e-9, atol=1e-12)
