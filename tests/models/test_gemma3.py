"""The second real model, Gemma-3-270M (marked real_model through the gemma3 fixture; run in CI).

Gemma-3 is the hardest real case ra-lens meets: 18 layers, 4 query heads on 1 key/value head,
qk-norm, pre- and post-norms, sliding windows of 512 tokens in five of every six layers, and an
attention scale of query_pre_attn_scalar**-0.5 (not d_head**-0.5; here both are 1/16).

RA is checked against a reference that uses no TransformerLens and no ra-lens: the HuggingFace
model itself (eager attention), with a zero tensor that requires grad added to the softmax input
inside every Gemma3Attention; the gradient there is dL/dS for the scaled, masked scores
S = QK^T * scaling + mask, so dL/d(QK^T) = dL/dS * scaling (scaling = query_pre_attn_scalar**-0.5;
Gemma-3 has no attention soft-cap).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ra_lens
from ra_lens import gemma3 as gemma3_module
from ra_lens import models
from ra_lens.capture import attention_scale
from ra_lens.metrics import target_nll

pytestmark = pytest.mark.real_model

IOI = "When Mary and John went to the store, John gave a drink to"
# Longer than the sliding window (512): the windowed layers mask keys the full layers see.
LONG = "The quick brown fox jumps over the lazy dog. " * 52 + IOI  # 535 tokens


@contextlib.contextmanager
def softmax_input_probes(hf_model: Any) -> Iterator[dict[int, torch.Tensor]]:
    """Add a zero tensor that requires grad to the softmax input of every Gemma3Attention.

    Yields ``{layer: zero}``, filled by the next forward pass; after ``backward`` each
    ``zero.grad`` is dL/d(softmax input), ``[batch, head, query, key]``. Forward pre-hooks and
    hooks mark which attention module is running; ``torch.nn.functional.softmax`` is wrapped
    for the duration (it is what HuggingFace's eager attention calls) and probed only inside one.
    """
    probes: dict[int, torch.Tensor] = {}
    current: list[int] = []
    real_softmax = torch.nn.functional.softmax

    def probed_softmax(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if current:
            layer = current[-1]
            assert layer not in probes, f"two softmax calls in layer {layer}'s attention"
            probes[layer] = torch.zeros_like(x, requires_grad=True)
            x = x + probes[layer]
        return real_softmax(x, *args, **kwargs)

    def leave(module: Any, args: Any, output: Any) -> None:
        current.pop()

    handles = []
    for index, layer in enumerate(hf_model.model.layers):
        attn = layer.self_attn
        assert type(attn).__name__ == "Gemma3Attention"
        handles.append(attn.register_forward_pre_hook(lambda m, a, i=index: current.append(i)))
        handles.append(attn.register_forward_hook(leave))
    torch.nn.functional.softmax = probed_softmax
    try:
        yield probes
    finally:
        torch.nn.functional.softmax = real_softmax
        for handle in handles:
            handle.remove()


def huggingface_ra(hf_model: Any, tokens: torch.Tensor, target: int) -> torch.Tensor:
    """dL/d(QK^T) of every layer and head from HuggingFace's own attention, L = -log p(target)
    at the last position: ``[layer, head, query, key]``."""
    with softmax_input_probes(hf_model) as probes:
        logits = hf_model(tokens).logits
    loss = -logits[0, -1].log_softmax(-1)[target]
    loss.backward()
    n_layers = len(hf_model.model.layers)
    assert sorted(probes) == list(range(n_layers))
    scalings = [layer.self_attn.scaling for layer in hf_model.model.layers]
    return torch.stack([probes[i].grad[0] * scalings[i] for i in range(n_layers)])


@pytest.fixture(scope="module")
def hf_gemma3() -> Any:
    """The plain HuggingFace Gemma-3-270M from the same cached copy (eager attention, float32)."""
    hf_model, _ = models.load_hf(models.gemma3_hf_dir(), torch.float32)
    assert hf_model.config._attn_implementation == "eager"
    assert hf_model.config.attn_logit_softcapping is None
    return hf_model


def test_gemma3_loads_offline_with_its_geometry_and_knows_paris(gemma3: Any, hf_gemma3: Any):
    cfg = gemma3.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (18, 4, 1, 256)
    assert (cfg.d_vocab, cfg.n_ctx) == (262144, 32768)
    for layer in range(18):
        assert attention_scale(gemma3, layer) == 16.0  # query_pre_attn_scalar ** 0.5
    gemma3_module.check_tokenizer(gemma3.tokenizer)  # Gemma-3's own ids, in both environments
    tokens = gemma3.to_tokens("The Eiffel Tower is in the city of")
    assert gemma3.to_str_tokens(tokens)[:2] == ["<bos>", "The"]  # one BOS, not two
    with torch.no_grad():
        logits = gemma3(tokens)
        reference = hf_gemma3(tokens).logits
    assert gemma3.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
    # The base model at Q4_K_M puts " Paris" third after "The capital of France is".
    capital = gemma3.to_tokens("The capital of France is")
    with torch.no_grad():
        top3 = gemma3(capital)[0, -1].topk(3).indices
    assert " Paris" in [gemma3.tokenizer.decode(i) for i in top3]
    assert float((logits - reference).abs().max()) <= 1e-3


@pytest.mark.parametrize("prompt", [IOI, LONG], ids=["ioi", "past-the-window"])
def test_ra_matches_huggingface_attention_internals(gemma3: Any, hf_gemma3: Any, prompt: str):
    tokens = gemma3.to_tokens(prompt)
    target = int(gemma3.to_tokens(" Mary", prepend_bos=False)[0, 0])
    ra = ra_lens.reversed_attention(gemma3, tokens, target_nll([target]), convention="qk")
    reference = huggingface_ra(hf_gemma3, tokens, target)
    maps = ra.maps[0].double()
    assert maps.shape == reference.shape == (18, 4, tokens.shape[1], tokens.shape[1])
    if prompt == LONG:  # windows: a sliding layer's last query sees the last 512 keys only
        assert tokens.shape[1] == 535
        assert maps[0, :, -1, :-512].abs().max() == 0 and maps[5, :, -1, :-512].abs().max() > 0
    error = (maps - reference.double()).abs().max() / reference.abs().max()
    relative = (maps - reference.double()).norm() / reference.double().norm()
    print(
        f"{tokens.shape[1]} tokens: max error {error:.2e} of the largest entry, {relative:.2e} rel"
    )
    if type(gemma3).__name__ == "TransformerBridge":
        # The bridge runs HuggingFace's own modules: float32 rounding (measured 9e-8).
        assert error <= 1e-6 and relative <= 1e-6
    else:
        # TL 2's HookedTransformer recomputes Gemma-3 with its own components: its logits differ
        # from HuggingFace's by 2.7e-5, RA by 4e-5 of the largest entry, 8e-5 relative (measured;
        # the same with fold_ln=False). That is float32 rounding, amplified by a confident
        # prediction (p(" Mary") = 0.85): the HF reference itself moves by 4.4e-5 when only its
        # last row of logits is computed (logits_to_keep=1, another matmul).
        assert error <= 2e-4 and relative <= 2e-4
