"""The claims that matter, on the embedded SmolLM2-135M-Instruct (marked real_model; run in CI)."""

from __future__ import annotations

import pytest
import torch

import ra_lens
from ra_lens.experiments import attention_patching
from ra_lens.metrics import target_nll

pytestmark = [pytest.mark.real_model, pytest.mark.tl4]

FIGURE_1 = "I like Italy and France. I visited the city of"


def florence_ra(model):
    target = model.to_tokens(" Florence", prepend_bos=False)[0, 0]
    return ra_lens.reversed_attention(model, FIGURE_1, target_nll([target]))


def test_figure_1_top_head_is_stable_and_points_at_italy(smollm2):
    first, second = florence_ra(smollm2), florence_ra(smollm2)
    assert first.top_heads(5) == second.top_heads(5)
    assert torch.equal(first.maps, second.maps)
    layer, head, norm = first.top_heads(1)[0]
    # The top head's loss row: gradient descent (-RA) raises attention to " Italy", lowers " France".
    row = first.head(layer, head)[-1]
    tokens = first.str_tokens[0]
    assert row[tokens.index(" Italy")] < 0 < row[tokens.index(" France")]
    assert norm > 5 * first.head_norms().median()
    # The RA map is far sparser than the forward map of the same head.
    forward = first.patterns[0, layer, head]
    assert (row.abs() > 0.1 * row.abs().max()).sum() < (forward[-1] > 0.1 * forward[-1].max()).sum() + 3


def test_attention_patching_lifts_zero_shot_antonyms(smollm2):
    result = attention_patching(
        smollm2, "antonym", shots=0, n_train=12, scales=[0.0, -10.0, 2.0], n_test=20, progress=False
    )
    unpatched, patched, positive = result.ra
    assert unpatched.top3 == result.unpatched.top3
    assert patched.top3 >= unpatched.top3 + 0.4
    assert positive.top3 <= unpatched.top3 + 0.05
    assert result.forward[1].top3 <= unpatched.top3 + 0.1
