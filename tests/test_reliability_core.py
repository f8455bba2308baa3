"""Bad input to RA, attribution and their results is refused with a clear error, and odd but
valid input gives the right answer (issue 19 items 4-8 and 10 for these modules)."""

from __future__ import annotations

import pytest
import torch
from helpers import arch_or_hooked, has_bridge

import ra_lens
from ra_lens.metrics import logit_diff, target_nll
from ra_lens.toy_models import tiny_model

TOKENS = torch.tensor([[0, 5, 9, 14, 20, 33, 7, 41, 12], [0, 8, 3, 14, 25, 33, 7, 40, 12]])
CORRUPTED = torch.tensor([[0, 5, 17, 14, 20, 61, 7, 41, 12], [0, 8, 3, 19, 25, 33, 70, 40, 12]])


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# item 4: positions must be integers


@pytest.mark.parametrize("rows_at", [torch.tensor([1.7, 2.9]), torch.tensor([True, False])])
def test_rows_at_refuses_non_integer_positions(model, rows_at):
    with pytest.raises(TypeError, match="rows_at must hold integer positions"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows", rows_at=rows_at)


def test_rows_at_takes_integer_positions(model):
    ra = ra_lens.reversed_attention(
        model, TOKENS, target_nll([5]), keep="rows", rows_at=torch.tensor([3, 4])
    )
    full = ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    torch.testing.assert_close(ra.rows[0], full.maps[0, :, :, 3])
    torch.testing.assert_close(ra.rows[1], full.maps[1, :, :, 4])


# --------------------------------------------------------------------------------------------
# item 10: a metric that runs the model itself


def _kl_to(model, reference_tokens, *, inside: bool):
    """KL(model(reference_tokens) || logits) at the last position; with inside=True the
    reference logits are computed inside the metric, under no_grad, by a second forward pass."""
    with torch.no_grad():
        fixed = model(reference_tokens).log_softmax(-1)[:, -1]

    def metric(logits):
        ref = fixed
        if inside:
            with torch.no_grad():
                ref = model(reference_tokens).log_softmax(-1)[:, -1]
        return (ref.exp() * (ref - logits[:, -1].log_softmax(-1))).sum(-1)

    return metric


@pytest.mark.parametrize("memory", ["full", "layerwise"])
def test_metric_running_the_model_gives_the_ra_of_precomputed_references(model, memory):
    expected = ra_lens.reversed_attention(model, TOKENS, _kl_to(model, CORRUPTED, inside=False))
    got = ra_lens.reversed_attention(
        model, TOKENS, _kl_to(model, CORRUPTED, inside=True), memory=memory
    )
    assert expected.maps.abs().max() > 1e-6
    torch.testing.assert_close(got.maps, expected.maps, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.patterns, expected.patterns, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["exact", "linear"])
def test_attribution_with_a_metric_running_the_model(model, method):
    other = TOKENS.flip(0)
    expected = ra_lens.attention_attribution(
        model, TOKENS, CORRUPTED, _kl_to(model, other, inside=False), method=method
    )
    got = ra_lens.attention_attribution(
        model, TOKENS, CORRUPTED, _kl_to(model, other, inside=True), method=method
    )
    assert expected.edges.abs().max() > 1e-8
    torch.testing.assert_close(got.edges, expected.edges, rtol=0, atol=1e-12)
    for kind in expected.nodes:
        torch.testing.assert_close(got.by_position[kind], expected.by_position[kind])
