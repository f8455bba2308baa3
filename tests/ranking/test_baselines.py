"""The baseline rankings (ranking/baselines.py: forward, random, layer) and the head order."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_TARGETS as TARGETS
from helpers import live_archs

import ra_lens
from ra_lens import ranking as rk
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def model(request):
    return tiny_model(request.param, n_layers=2)


def test_forward_ranking_equals_forward_norms(model):
    reference = ra_lens.reversed_attention(model, CLEAN, target_nll(TARGETS)).forward_norms()
    scores = rk.forward_ranking(model, CLEAN, batch_size=2)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-6)


def test_random_ranking_is_seeded():
    a = rk.random_ranking(3, 4, seed=1)
    torch.manual_seed(123)
    b = rk.random_ranking(3, 4, seed=1)
    assert a.shape == (3, 4)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, rk.random_ranking(3, 4, seed=2))


def test_layer_ranking_and_head_order():
    scores = rk.layer_ranking(3, 2)
    assert scores.tolist() == [[0, 0], [1, 1], [2, 2]]
    assert rk.head_order(scores) == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert rk.head_order(scores, reverse=True) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    scores = torch.tensor([[0.1, 0.9], [0.5, -1.0]])
    assert rk.head_order(scores) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    assert rk.kept_heads(scores, 0.5) == [(0, 1), (1, 0)]
    assert rk.kept_heads(scores, 0.5, reverse=True) == [(1, 1), (0, 0)]
