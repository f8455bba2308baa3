"""A layer's attention redone from its recorded queries and keys, and checked against the model.

The one place ra-lens recomputes attention: the rotary embedding as the model applies it
(`rotary_function`, `rotation_matrices`, `fill_rotated`), each key/value head repeated for the
query heads that read it (`per_query_head`), the attention logits through the layer's
`AttentionFacts` (`attention_logits`: scale, soft-cap, ALiBi, window), and the checks that make a
recomputation safe to use: every hook it needs fired (`require_fired`), and the softmax of the
recomputed logits equals `hook_pattern` within one tolerance (`check_recomputed`,
`contract.recompute_tolerance`). Attribution, circuits and edit dynamics use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens.contract import (
    COS,
    ROT_K,
    ROT_Q,
    SIN,
    AttentionFacts,
    HookedModel,
    K,
    Q,
    recompute_tolerance,
)
from ra_lens.math import rotate_half


def per_query_head(keys: Tensor, group: int, dim: int = 2) -> Tensor:
    """Each key/value head repeated for the `group` query heads that read it (query head h reads
    key/value head h // group), along `dim` (the head axis).

    >>> per_query_head(torch.arange(2.0).reshape(1, 1, 2, 1), 2).flatten().tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    return keys if group == 1 else keys.repeat_interleave(group, dim=dim)


def attention_logits(
    q: Float[Tensor, "batch query head d_head"],
    k: Float[Tensor, "batch key kv_head d_head"],
    facts: AttentionFacts,
) -> Float[Tensor, "batch head query key"]:
    """The layer's attention logits from its queries and keys (after any rotation): q k^T per
    query head through `facts.logits` (scale, soft-cap, ALiBi). The causal mask and window are
    `facts.mask`'s."""
    keys = per_query_head(k, q.shape[2] // k.shape[2])
    return facts.logits(torch.einsum("bqhd,bkhd->bhqk", q, keys))


def require_fired(names: Sequence[str], acts: dict[str, Tensor], unable: str) -> None:
    """Refuse when a hook the recomputation needs never fired; `unable` says what cannot be done
    and what to use instead."""
    silent = [name for name in names if name not in acts]
    if silent:
        raise RuntimeError(
            f"hook {silent[0]!r} never fired during the forward pass: this adapter rotates q/k "
            "inside HuggingFace's attention and exposes neither the rotated queries and keys nor "
            f"its cos/sin tables (GPT-J's interleaved rotary), so {unable}"
        )


def check_recomputed(
    layer: int,
    recomputed: Float[Tensor, "batch head query key"],
    pattern: Float[Tensor, "batch head query key"],
    rows: Tensor,
    facts: AttentionFacts,
    advice: str,
    error: type[Exception] = ValueError,
) -> None:
    """Refuse when the recomputed softmax differs from the recorded `hook_pattern` on real rows
    (`rows`, broadcast to [batch head query key]) by more than `recompute_tolerance` of the
    pattern's dtype; the error (`error`: edit dynamics, whose contract is "this form of attention
    is not supported", raises NotImplementedError) names the facts used, their known cause, and
    `advice`."""
    mismatch = float(((recomputed.double() - pattern.double()).abs() * rows).max())
    if mismatch > recompute_tolerance(pattern.dtype):
        cause = facts.refusal() or "this attention is not modelled (q/k edited by another hook?)"
        raise error(
            f"layer {layer}: the recomputed softmax ({facts}) differs from hook_pattern by "
            f"{mismatch:.2g}: {cause}; {advice}"
        )


def check_rotation(
    layer: int,
    rotate: Callable[[Tensor], Tensor],
    q: Float[Tensor, "batch pos head d_head"],
    rotated: Float[Tensor, "batch pos head d_head"],
    advice: str,
) -> None:
    """Refuse when `rotate(q)` differs from the model's own rotated queries by more than
    `recompute_tolerance` of q's dtype, relative to q's largest entry (queries are not bounded
    the way softmax rows are); the error ends with `advice`."""
    q64 = q.double()
    error = float((rotate(q64) - rotated.double()).abs().max())
    if error > recompute_tolerance(q.dtype) * max(1.0, float(q64.abs().max())):
        raise ValueError(
            f"layer {layer}: the rotary embedding could not be reproduced (error {error:.2g}); "
            f"{advice}"
        )


def rotary_function(
    model: HookedModel, layer: int, acts: dict[str, Tensor]
) -> Callable[[Tensor], Tensor] | None:
    """The layer's rotary embedding as a function of Float[Tensor, "... pos head d_head"]
    (positions from 0), or None where the layer has none; `acts` holds recorded values by hook
    name (`rotation_hooks`).

    - TransformerBridge with hook_cos/hook_sin: HuggingFace's rotate-half with those tables
      (partial rotary: the first cos.shape[-1] dims);
    - GPT-J (TL 4 fires no rotation hook there): HuggingFace's own interleaved rotation
      (`rotate_every_two`) with its sinusoids, on the first `rotary_dim` dims;
    - HookedTransformer: the attention module's `apply_rotary`.
    """
    cos, sin = acts.get(COS.format(layer)), acts.get(SIN.format(layer))
    if cos is not None and sin is not None:
        return lambda x: rotate_half(x, cos, sin)
    attn = model.blocks[layer].attn
    inner: Any = getattr(attn, "original_component", None)
    if type(inner).__name__ == "GPTJAttention":
        return partial(_gptj_rotate, int(inner.rotary_dim or inner.head_dim))
    if inner is None and hasattr(attn, "apply_rotary") and ROT_Q.format(layer) in acts:
        return partial(_hooked_rotate, attn)
    return None


def _gptj_rotate(rotary_dim: int, x: Tensor) -> Tensor:
    from transformers.models.gptj.modeling_gptj import (
        apply_rotary_pos_emb,
        create_sinusoidal_positions,
    )

    sincos = create_sinusoidal_positions(x.shape[-3], rotary_dim).to(x)
    sin, cos = sincos[:, : rotary_dim // 2], sincos[:, rotary_dim // 2 :]
    flat = x.reshape(-1, *x.shape[-3:])
    part = apply_rotary_pos_emb(flat[..., :rotary_dim], sin[None], cos[None])
    return torch.cat([part, flat[..., rotary_dim:]], dim=-1).reshape(x.shape)


def _hooked_rotate(attn: Any, x: Tensor) -> Tensor:
    flat = x.reshape(-1, *x.shape[-3:])
    turned: Tensor = attn.apply_rotary(flat.to(attn.rotary_sin.dtype), 0)
    return turned.to(x.dtype).reshape(x.shape)


def rotation_matrices(
    rotate: Callable[[Tensor], Tensor], n_pos: int, d_head: int, device: Any = None
) -> Tensor:
    """A rotary embedding (linear per position) as Float[Tensor, "pos d_head d_head"], float64:
    rotate(v) at position p is v @ M[p]; read off by rotating the unit vectors."""
    eye = torch.eye(d_head, dtype=torch.float64, device=device)
    units = eye[:, None, None, :].expand(d_head, n_pos, 1, d_head)  # [i pos head=1 e]
    return rotate(units)[:, :, 0].permute(1, 0, 2).contiguous()


def rotation_hooks(layers: Iterable[int]) -> list[str]:
    """The hook names `fill_rotated` reads: hook_q, hook_k, hook_cos, hook_sin of each layer."""
    return [name.format(layer) for layer in layers for name in (Q, K, COS, SIN)]


def fill_rotated(model: HookedModel, acts: dict[str, Tensor], layers: Iterable[int]) -> None:
    """Put the rotated queries and keys into `acts` (recorded values by hook name) where the
    adapter rotates q/k but never fires hook_rot_q/hook_rot_k (TL 4's joint-qkv adapters:
    GPT-NeoX/Pythia, Phi-3, Falcon; GPT-J, whose rotation happens inside HuggingFace's
    attention): recomputed from hook_q/hook_k with `rotary_function`. Callers check the result
    against hook_pattern (the softmax they recompute), so a different rotation is refused there,
    not used. Layers whose rotation fired, or that have none, are left as they are.
    """
    for layer in layers:
        if ROT_Q.format(layer) in acts or ROT_Q.format(layer) not in model.hook_dict:
            continue
        rotate = rotary_function(model, layer, acts)
        if rotate is None:
            continue
        for plain, rotated in ((Q, ROT_Q), (K, ROT_K)):
            if plain.format(layer) in acts:
                acts[rotated.format(layer)] = rotate(acts[plain.format(layer)])
