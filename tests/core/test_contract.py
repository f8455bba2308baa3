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
    r"^the model's weights are on the meta device \(the model was built without them, or "
    r"accelerate offloaded them\): load them first, e.g. with ra_lens.load_model, or "
    r"model.to_empty\(device=...\) then model.load_state_dict\(...\); ra-lens runs a model whose "
    r"weights are all in memory \(no accelerate disk/meta offload\); \d+ of \d+ weights and "
    r"buffers hold no numbers, e.g. '.+'$"
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


def test_a_model_offloaded_by_accelerate_is_refused_up_front() -> None:
    """accelerate's cpu_offload leaves the weights on the meta device and loads each module's in
    a hook around its forward; ra-lens's inputs follow the weights' device (meta), so such a model
    ended in "Tensor.item() cannot be called on meta tensors". It is refused by name, and
    accelerate's hooks stay as they were. (TL 4: the bridge's HuggingFace model is offloaded, as
    from_pretrained(device_map=...) would; Llama, whose embeddings are not tied, which
    cpu_offload cannot handle.)"""
    accelerate = pytest.importorskip("accelerate")
    if has_bridge():
        model = tiny_model("llama")
        accelerate.cpu_offload(model.original_model, execution_device="cpu")
    else:
        model = hooked_toy()
        accelerate.cpu_offload(model, execution_device="cpu")
    hooks = hook_count(model)
    with pytest.raises(ValueError, match=META):
        ra_lens.reversed_attention(model, CLEAN_TOKENS, METRIC)
    with pytest.raises(ValueError, match=META):
        circuits.pair_scores(model, CLEAN_TOKENS, CORRUPTED_TOKENS, logit_diff)
    assert hook_count(model) == hooks
    assert all(p.is_meta and p.grad is None for p in model.parameters())
