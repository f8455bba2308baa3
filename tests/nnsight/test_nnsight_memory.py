"""memory="layerwise" on nnsight models: refused, naming docs/nnsight_memory.md; the page's
formula (ra_lens.nnsight.memory) term by term."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "nnsight.modeling",
    reason="nnsight 0.8.1 needs transformers >= 5: installed in .venv (TL 4) only",
)
import nnsight  # noqa: E402

import ra_lens  # noqa: E402
from ra_lens.metrics import target_nll  # noqa: E402
from ra_lens.nnsight.memory import LLAMA_31_8B, longest_prompt, peak_bytes  # noqa: E402
from ra_lens.toy_models import hf_model, tiny_tokenizer_dir  # noqa: E402


def test_layerwise_is_refused_naming_the_memory_page() -> None:
    hf = hf_model("llama", spread=True).float()
    hf.train()
    from transformers import AutoTokenizer

    model = nnsight.TransformersModel(
        hf, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    )
    flags = [p.requires_grad for p in hf.parameters()]
    with pytest.raises(ValueError, match="docs/nnsight_memory.md"):
        ra_lens.reversed_attention(
            model, torch.tensor([[0, 5, 9]]), target_nll([5]), keep="norms", memory="layerwise"
        )
    assert hf.training and [p.requires_grad for p in hf.parameters()] == flags


def test_the_formula_of_the_page_at_8b_and_1024_tokens() -> None:
    terms = peak_bytes(LLAMA_31_8B, 1024, 2)
    square = 32 * 32 * 1024 * 1024  # layers x heads x tokens^2
    assert terms["weights"] == 2 * 8.03e9
    assert terms["attention"] == square * (4 + 2)  # float32 softmax output + its bf16 copy
    assert terms["grads"] == square * 2
    assert terms["saved"] == 32 * 1024 * (3 * 4096 * 2 + 2 * 4096 * 4 + 3 * 14336 * 2)
    assert round(terms["total"] / 1e9, 2) == 30.01
    # The page's "longest prompt on one 80 GB GPU".
    fits = longest_prompt(LLAMA_31_8B, 80e9)
    assert (
        peak_bytes(LLAMA_31_8B, fits)["total"] <= 80e9 < peak_bytes(LLAMA_31_8B, fits + 1)["total"]
    )
    assert fits == 2462
