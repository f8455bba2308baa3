"""attention_attribution on a HookedTransformer whose grouped-query keys are ungrouped
(`cfg.ungroup_grouped_query_attention=True`, EAP-IG's setting) is refused naming the flag, before
any pass; with the flag off it gives the grouped model's scores."""

from __future__ import annotations

import pytest
import torch
from helpers import has_bridge, snapshot

from ra_lens import attention_attribution
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import tiny_tokenizer_dir

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 52], [52, 294])


def _gqa(**overrides):
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        d_model=32, d_head=8, n_layers=2, n_heads=4, n_key_value_heads=2, n_ctx=64, d_vocab=300,
        act_fn="silu", gated_mlp=True, normalization_type="RMS",
        positional_embedding_type="rotary", seed=0, **overrides,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    return HookedTransformer(cfg, tokenizer=tokenizer).to(torch.float64).eval()


@pytest.mark.skipif(has_bridge(), reason="TransformerBridge has no ungrouped key/value heads")
def test_ungrouped_keys_are_refused_naming_the_flag():
    model = _gqa(ungroup_grouped_query_attention=True)
    before = snapshot(model)
    with pytest.raises(NotImplementedError) as error:
        attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    assert "model.set_ungroup_grouped_query_attention(False)" in str(error.value)
    assert "cfg.ungroup_grouped_query_attention=True" in str(error.value)
    after = snapshot(model)
    assert after[:2] == before[:2] and after[3] == before[3]  # modes, flags and grads as found
    model.set_ungroup_grouped_query_attention(False)  # the fix the message names
    fixed = attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    grouped = attention_attribution(_gqa(), CLEAN, CORRUPTED, METRIC)  # same seed, same weights
    assert fixed.scores["key"].shape == (2, 2)
    for kind in ("query", "key", "pattern"):
        torch.testing.assert_close(fixed.scores[kind], grouped.scores[kind], atol=1e-10, rtol=0)
