"""The architecture matrix: every capability on tiny random float64 models of the architectures
researchers study, against ground truth read inside HuggingFace's own attention code
(`helpers.hf_attention_grads`), never against TransformerLens's hooks (which share the adapters'
assumptions). A capability is exact on an architecture or refuses naming the true cause."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from helpers import hf_attention_grads, hf_qk_factor

import ra_lens
from ra_lens.metrics import target_nll
from ra_lens.toy_models import MATRIX_ARCHITECTURES, hf_model, tiny_model

pytestmark = pytest.mark.tl4  # the matrix boots TransformerBridges (TL 2 has its own tests below)

PROMPT = "The quick brown fox jumps over"
TARGET = 5
#: Architectures whose TransformerBridge adapter itself fails in TransformerLens 4.3 (the plain
#: bridge forward raises): nothing ra-lens can do, listed so that the matrix says why.
BROKEN_ADAPTERS = {
    "stablelm": "TransformerLens 4.3's StableLM adapter fails its own forward pass",
}
#: MoE's grouped matmul has no float64 kernel: Mixtral runs in float32.
DTYPES = {"mixtral": torch.float32}


@cache
def pair(arch: str) -> tuple[Any, Any]:
    """(bridge, its plain HuggingFace twin), both float64 (float32 where noted), eval mode."""
    pytest.importorskip("transformer_lens.model_bridge")
    if arch in BROKEN_ADAPTERS:
        pytest.skip(BROKEN_ADAPTERS[arch])
    dtype = DTYPES.get(arch, torch.float64)
    bridge = tiny_model(arch, dtype=dtype, spread=True)
    return bridge, hf_model(arch, spread=True).to(dtype)


def tolerance(arch: str) -> float:
    return 1e-5 if DTYPES.get(arch) == torch.float32 else 1e-9


@pytest.mark.parametrize("memory", ["full", "layerwise"])
@pytest.mark.parametrize("convention", ["qk", "scores"])
@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_ra_is_the_gradient_inside_huggingfaces_attention(
    arch: str, convention: str, memory: str
) -> None:
    """RA ("qk") = dM/d(QK^T) at HF's QK matmul, "scores" = dM/d(softmax input): scale-free
    GPT-Neo, Gemma-2's soft-cap (through the tanh) and final logit cap, ALiBi, windows, qk-norms,
    MoE, partial rotary and parallel blocks; in one backward pass and layer by layer."""
    bridge, hf = pair(arch)
    tokens = bridge.to_tokens(PROMPT)
    metric = target_nll([TARGET])
    truth = hf_attention_grads(hf, tokens, metric)[convention]
    ra = ra_lens.reversed_attention(bridge, tokens, metric, convention=convention, memory=memory)
    assert ra.maps is not None and len(truth) == bridge.cfg.n_layers
    for layer, grad in enumerate(truth):
        factor = hf_qk_factor(hf, layer) if convention == "qk" else 1.0
        expected = grad[0].double() * factor
        if convention == "scores":  # masked entries: HF adds a finite minimum, A is 0 there
            expected = expected * (ra.patterns[0, layer] > 0)
        got = ra.maps[0, layer].double()
        assert got.shape == expected.shape
        scale = float(expected.abs().max())
        assert scale > 0
        # maps are float32: compare at float32 precision relative to the largest entry
        assert float((got - expected).abs().max()) <= max(1e-6, tolerance(arch)) * scale * 10
