"""The model contract's checks (ra_lens.contract): a model whose weights were never loaded gets
one clear error up front, from every call that runs it, and is left as found; the attention scale
ra-lens reads is the one the model's forward pass uses."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CLEAN_TOKENS,
    CORRUPTED_TOKENS,
    arch_or_hooked,
    has_bridge,
    hook_count,
    hooked_toy,
)

import ra_lens
from ra_lens import circuits
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model

METRIC = target_nll([5, 7])
META = (
    r"^the model's weights are on the meta device \(the model was built without them\): load "
    r"them first, e.g. with ra_lens.load_model, or model.to_empty\(device=...\) then "
    r"model.load_state_dict\(...\) \(weights accelerate offloads with device_map are fine\); "
    r"\d+ of \d+ weights and buffers hold no numbers, e.g. '.+'$"
)


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 7]


CALLS = {
    "reversed_attention": lambda m: ra_lens.reversed_attention(m, CLEAN_TOKENS, METRIC),
    "layerwise": lambda m: ra_lens.reversed_attention(m, CLEAN_TOKENS, METRIC, memory="layerwise"),
    "to_batch": lambda m: ra_lens.to_batch(m, CLEAN_TOKENS),
    "live_attention": lambda m: ra_lens.live_attention(m).__enter__(),
    "pair_scores": lambda m: circuits.pair_scores(m, CLEAN_TOKENS, CORRUPTED_TOKENS, logit_diff),
    "attribute": lambda m: circuits.attribute(
        m, CLEAN_TOKENS, CORRUPTED_TOKENS, logit_diff, method="eap"
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_model_on_the_meta_device_is_refused_up_front(call: str) -> None:
    """Before the check, reversed_attention, the layerwise route, live_attention and pair_scores
    ended in torch's own errors ("Tensor.item() cannot be called on meta tensors", "The
    register_meta function for torch.nonzero() ...")."""
    model = tiny_model(arch_or_hooked("gpt2")).to("meta")
    hooks = hook_count(model)
    with pytest.raises(ValueError, match=META):
        CALLS[call](model)
    assert hook_count(model) == hooks and not model.training
    assert all(p.is_meta and p.grad is None for p in model.parameters())


def test_a_model_with_some_weights_left_on_the_meta_device_is_refused() -> None:
    """One unloaded tensor is enough to refuse, and the message names it."""
    model = tiny_model(arch_or_hooked("gpt2"))
    name, weight = list(model.named_parameters())[-1]
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(weight.to("meta"))
    with pytest.raises(
        ValueError, match=rf"; 1 of \d+ weights and buffers hold no numbers, e.g. '{name}'$"
    ):
        ra_lens.reversed_attention(model, CLEAN_TOKENS, METRIC)


def test_a_model_whose_first_weight_accelerate_offloads_is_refused_up_front() -> None:
    """accelerate's cpu_offload leaves every weight on the meta device, the embeddings too, and
    loads each module's in a hook around its forward; ra-lens puts its inputs on the first
    weight's device (meta), so such a model ended in "Tensor.item() cannot be called on meta
    tensors". It is refused by name, and accelerate's hooks stay as they were. (A model whose
    embeddings stay on a real device runs: tests/core/test_layerwise.py. TL 4: the bridge's
    HuggingFace model is offloaded, as from_pretrained(device_map=...) would; Llama, whose
    embeddings are not tied, which cpu_offload cannot handle.)"""
    accelerate = pytest.importorskip("accelerate")
    if has_bridge():
        model = tiny_model("llama")
        accelerate.cpu_offload(model.original_model, execution_device="cpu")
    else:
        model = hooked_toy()
        accelerate.cpu_offload(model, execution_device="cpu")
    first = next(iter(model.named_parameters()))[0]
    message = (
        rf"^the model's first weight \('{first}'\) is offloaded by accelerate \(on the meta "
        r"device\), and ra-lens puts its inputs on the first weight's device: keep the embeddings "
        r"on a real device \(e.g. device_map=\{'model.embed_tokens': 'cpu', ...\}\) and offload "
        r"later layers only$"
    )
    hooks = hook_count(model)
    with pytest.raises(ValueError, match=message):
        ra_lens.reversed_attention(model, CLEAN_TOKENS, METRIC)
    with pytest.raises(ValueError, match=message):
        circuits.pair_scores(model, CLEAN_TOKENS, CORRUPTED_TOKENS, logit_diff)
    assert hook_count(model) == hooks
    assert all(p.is_meta and p.grad is None for p in model.parameters())


def gpt2_bridge(**settings: object) -> tuple[object, object]:
    """(a TransformerBridge of a tiny float64 GPT-2 with these config settings, an independent
    copy of the HuggingFace model: booting reroutes the wrapped model's own attention)."""
    import copy
    import tempfile

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ra_lens.models import hub_offline
    from ra_lens.toy_models import hf_config, tiny_tokenizer_dir

    torch.manual_seed(0)
    cfg = hf_config("gpt2", 300, 32, 2, 4, 64, 0.0)
    cfg._attn_implementation = "eager"
    for name, value in settings.items():
        setattr(cfg, name, value)
    hf = AutoModelForCausalLM.from_config(cfg).eval().double()
    reference = copy.deepcopy(hf)
    folder = tempfile.mkdtemp(prefix="ra_lens_test_gpt2_scale_")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with hub_offline():
        bridge = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tokenizer)
    return bridge.to(torch.float64).eval(), reference


@pytest.mark.tl4  # the TransformerBridge (TL >= 3) wraps the HuggingFace module it disagrees with
def test_a_bridge_whose_attention_scale_disagrees_with_the_checkpoint_is_refused() -> None:
    """GPT-2 with scale_attn_weights=False: HuggingFace computes QK^T / 1, TL 4.3's bridge QK^T /
    sqrt(8). Before the check, RA read HuggingFace's scale and the bridge's softmax gradient:
    "qk" came out 2.83x HuggingFace's dL/d(QK^T), silently. Refused by name, model as found."""
    from helpers import hf_attention_grads

    model, reference = gpt2_bridge(scale_attn_weights=False)
    with torch.no_grad():  # the bridge is not the checkpoint: its logits differ
        gap = (model(CLEAN_TOKENS) - reference(CLEAN_TOKENS).logits).abs().max()
    assert float(gap) > 1e-3
    hooks = hook_count(model)
    with pytest.raises(NotImplementedError) as error:
        ra_lens.reversed_attention(model, CLEAN_TOKENS, METRIC)
    assert str(error.value).startswith(
        "layer 0: the TransformerBridge's JointQKVAttentionBridge computes QK^T / 2.82843 "
        "(TransformerLens fixes 1/sqrt(d_head)) while the HuggingFace GPT2Attention it wraps "
        "computes QK^T / 1 (its config: scale_attn_weights=False, "
        "scale_attn_by_inverse_layer_idx=False): the bridge runs another model than the "
        "checkpoint, and its attention (and a 'qk' map) would be off by 2.828x;"
    )
    assert hook_count(model) == hooks
    # the way out the message names: nnsight runs HuggingFace's own attention, exactly
    pytest.importorskip("nnsight.modeling")  # not "nnsight": tests/nnsight would import as it
    import nnsight

    wrapped = nnsight.TransformersModel(reference, tokenizer=model.tokenizer)
    ra = ra_lens.reversed_attention(wrapped, CLEAN_TOKENS, METRIC)
    truth = hf_attention_grads(reference, CLEAN_TOKENS, METRIC)["qk"]
    assert ra.maps is not None
    for layer in range(2):
        torch.testing.assert_close(ra.maps[:, layer].double(), truth[layer], rtol=1e-5, atol=1e-9)


@pytest.mark.tl4  # as above
def test_a_bridge_scaled_as_its_checkpoint_passes_by_layer_too() -> None:
    """scale_attn_by_inverse_layer_idx: both HuggingFace and the bridge divide layer l's QK^T by
    sqrt(d_head) (l + 1), so RA is not refused, and "qk" is HuggingFace's dL/d(QK^T)."""
    from helpers import hf_attention_grads

    model, reference = gpt2_bridge(scale_attn_by_inverse_layer_idx=True)
    ra = ra_lens.reversed_attention(model, CLEAN_TOKENS, METRIC)
    truth = hf_attention_grads(reference, CLEAN_TOKENS, METRIC)["qk"]
    assert ra.scales == pytest.approx([8**0.5, 2 * 8**0.5])
    assert ra.maps is not None
    for layer in range(2):
        torch.testing.assert_close(ra.maps[:, layer].double(), truth[layer], rtol=1e-4, atol=1e-9)
