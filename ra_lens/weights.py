"""What edge patching needs to know of a model's weights, and the models it refuses.

`layer_weights`: one layer's attention weights in TransformerLens's per-head layout (the same in
both worlds), with the layer's `BlockLayout` and MLP-input hook from `contract.model_facts`.
`check_supported`: the refusals of `ra_lens.circuits` (post-norm blocks on HookedTransformer,
ungrouped grouped-query attention, shortformer embeddings, a biased output projection before a
post-norm), each naming why. Facts about the model, read once per call: they sit beside the
contract, below everything that patches edges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens.contract import (
    BlockLayout,
    HookedModel,
    ModelFacts,
    model_facts,
    refuse_ungrouped_kv,
)


@dataclass(repr=False)
class LayerWeights:
    """The attention weights of one layer in TransformerLens's per-head layout (k/v per key/value
    head), detached, and the layer's first norm (a callable module)."""

    ln1: Callable[[Tensor], Tensor]
    W_Q: Float[Tensor, "head d_model d_head"]
    b_Q: Float[Tensor, "head d_head"]
    W_K: Float[Tensor, "kv_head d_model d_head"]
    b_K: Float[Tensor, "kv_head d_head"]
    W_V: Float[Tensor, "kv_head d_model d_head"]
    b_V: Float[Tensor, "kv_head d_head"]
    W_O: Float[Tensor, "head d_head d_model"]
    # Where the block's norms sit and what its MLP reads (read once per call).
    layout: BlockLayout
    # Post-norm blocks: the norm after the attention (the HuggingFace module: calling it fires
    # no TransformerLens hook); None in pre-norm blocks.
    post_attn: Any = None
    # The hook where the MLP's input is rewritten (`ModelFacts.mlp_in`).
    mlp_in: str = ""


def layer_weights(model: HookedModel, layer: int, facts: ModelFacts | None = None) -> LayerWeights:
    """Read one layer's weights the same way in both worlds: HookedTransformer keeps grouped
    k/v weights as `_W_K`/`_W_V` (`W_K` repeats them per query head), TransformerBridge as `W_K`
    per key/value head; a missing bias is zero. `facts`: the model's `contract.model_facts`
    where the caller has read them (once per call), else read here."""
    block = model.blocks[layer]
    attn = block.attn

    def weight(name: str) -> Tensor:
        grouped = getattr(attn, "_" + name, None)  # TL 2 grouped-query attention
        value = grouped if isinstance(grouped, Tensor) else getattr(attn, name)
        return value.detach()

    def bias(name: str, like: Tensor) -> Tensor:
        value = weight(name) if _has(attn, name) else None
        if value is None:
            return torch.zeros(like.shape[0], like.shape[2], dtype=like.dtype, device=like.device)
        return value

    W_Q, W_K, W_V = weight("W_Q"), weight("W_K"), weight("W_V")
    facts = model_facts(model) if facts is None else facts
    layout = facts.layouts[layer]
    return LayerWeights(
        ln1=layout.pre_norm or torch.nn.Identity(),  # OLMo-2: no pre-norm
        W_Q=W_Q,
        b_Q=bias("b_Q", W_Q),
        W_K=W_K,
        b_K=bias("b_K", W_K),
        W_V=W_V,
        b_V=bias("b_V", W_V),
        W_O=weight("W_O"),
        post_attn=layout.post_attn_norm,
        layout=layout,
        mlp_in=facts.mlp_in[layer],
    )


def _has(attn: Any, name: str) -> bool:
    try:
        return getattr(attn, "_" + name, None) is not None or getattr(attn, name) is not None
    except AttributeError:
        return False


def check_supported(model: HookedModel, facts: ModelFacts | None = None) -> None:
    """Refuse models whose readers this module cannot rewrite, naming why (`facts`: the
    model's `contract.model_facts`, read here when not given)."""
    facts = model_facts(model) if facts is None else facts
    if facts.shape.norm_before_and_after:
        raise NotImplementedError(
            "post-norm blocks on HookedTransformer (TransformerLens 2's Gemma-2/3): their norm "
            "after the attention has no input hook here, so a head's share of it cannot be "
            "taken; load the model as a TransformerBridge (TransformerLens >= 3), where "
            "ra_lens.circuits supports post-norm blocks"
        )
    for layer, layout in enumerate(facts.layouts):
        if layout.post_attn_norm is not None:
            _check_post_norm(model, layer)
    refuse_ungrouped_kv(
        facts,
        "ra_lens.circuits patches and scores key/value inputs",
        "; circuit files still list key/value edges per query head, as EAP-IG reads them",
    )
    if facts.shape.positions == "shortformer":
        raise NotImplementedError(
            "shortformer positional embeddings (added to q/k inputs only) are not supported by "
            "ra_lens.circuits: the attention input is not the residual stream"
        )


def _check_post_norm(model: HookedModel, layer: int) -> None:
    """A post-norm block's output projection must be bias-free: a bias passes through the norm
    with the heads, and no writer would own it."""
    b_O = getattr(model.blocks[layer].attn, "b_O", None)
    if isinstance(b_O, Tensor) and bool(b_O.detach().ne(0).any()):
        raise NotImplementedError(
            f"layer {layer}: a post-norm block whose output projection has a bias: the bias "
            "passes through the norm with the heads' outputs, so no writer owns it"
        )
