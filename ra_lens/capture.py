"""Everything ra-lens knows about the model: hook names, geometry, state, tokenisation.

The rest of the package speaks TransformerLens hook names only, so any HookedRootModule works
(TL 2.x/3.x HookedTransformer, TL 3.x/4.x TransformerBridge). The model is duck-typed: `hook_dict`,
`hooks()`, `cfg`, `to_tokens`. Nothing here leaves state behind: `preserved_state` restores
train/eval mode, requires_grad flags and parameter .grad.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

PATTERN = "blocks.{}.attn.hook_pattern"
SCORES = "blocks.{}.attn.hook_attn_scores"
Z = "blocks.{}.attn.hook_z"
V = "blocks.{}.attn.hook_v"
RESID_PRE = "blocks.{}.hook_resid_pre"

_NOT_TL = (
    "ra_lens needs a TransformerLens model (HookedTransformer or TransformerBridge), "
    "e.g. ra_lens.load_model() or TransformerBridge.boot_transformers(name)"
)


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a model, read from its config."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    n_ctx: int | None


def model_shape(model: Any) -> ModelShape:
    """Read the attention geometry and check that the hooks ra-lens needs exist.

    Raises:
        TypeError: the model is not a TransformerLens model or lacks attention hooks.
    """
    hook_dict = getattr(model, "hook_dict", None)
    cfg = getattr(model, "cfg", None)
    if hook_dict is None or cfg is None or not hasattr(model, "hooks"):
        raise TypeError(f"{type(model).__name__} has no hook_dict/cfg/hooks(): {_NOT_TL}")
    n_layers = int(cfg.n_layers)
    for layer in range(n_layers):
        for name in (PATTERN.format(layer), RESID_PRE.format(layer)):
            if name not in hook_dict:
                raise TypeError(f"model has no hook {name!r}: {_NOT_TL}")
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
    n_ctx = getattr(cfg, "n_ctx", None)
    return ModelShape(n_layers, n_heads, int(n_kv), int(cfg.d_head), int(n_ctx) if n_ctx else None)


def check_layers(layers: Sequence[int] | None, n_layers: int) -> list[int]:
    """Sorted, de-duplicated layer indices; None means all layers. Raises on out-of-range."""
    if layers is None:
        return list(range(n_layers))
    chosen = sorted({int(layer) for layer in layers})
    bad = [layer for layer in chosen if not 0 <= layer < n_layers]
    if bad or not chosen:
        raise ValueError(
            f"layers {list(layers)} out of range: the model has layers 0..{n_layers - 1}"
        )
    return chosen


def attention_scale(model: Any, layer: int) -> float:
    """The divisor s in S = QK^T / s for one layer, read from the model rather than assumed.

    TL 2 keeps it as `attn.attn_scale`; TL-native bridges as `attn.original_component.scale`;
    HuggingFace attention modules as the multiplier `scaling`.
    """
    attn = model.blocks[layer].attn
    if isinstance(getattr(attn, "attn_scale", None), (int, float)):
        return float(attn.attn_scale)
    inner = getattr(attn, "original_component", None)
    if isinstance(getattr(inner, "scale", None), (int, float)):
        return float(inner.scale)
    if isinstance(getattr(inner, "scaling", None), (int, float)):
        scale = 1.0 / float(inner.scaling)
        if getattr(getattr(inner, "config", None), "scale_attn_by_inverse_layer_idx", False):
            scale *= layer + 1
        return scale
    cfg = model.cfg
    if getattr(cfg, "use_attn_scale", True) is False:
        return 1.0
    attn_scale = float(getattr(cfg, "attn_scale", -1.0))
    return attn_scale if attn_scale > 0 else math.sqrt(cfg.d_head)


@contextlib.contextmanager
def preserved_state(model: Any) -> Iterator[None]:
    """Run in eval mode; afterwards restore mode, requires_grad flags and every .grad as found."""
    was_training = model.training
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    # TL 4's GPT-2 attention bridge caches its last pattern; ours would keep our graph alive.
    cached = {m: m._pattern for m in model.modules() if hasattr(m, "_pattern")}
    model.eval()
    try:
        yield
    finally:
        for p, flag, grad in zip(params, flags, grads):
            p.requires_grad_(flag)
            p.grad = grad
        for module, pattern in cached.items():
            module._pattern = pattern
        model.train(was_training)


def gradient_leaf_hook(store: dict[str, Tensor]):
    """Forward hook that turns an activation into a fresh leaf that requires grad.

    This is how a frozen model (requires_grad False everywhere) still gets a graph, and why no
    parameter gradient is ever computed: the backward pass stops at this leaf.
    """

    def hook(activation: Tensor, hook: Any) -> Tensor:
        leaf = activation.detach().requires_grad_(True)
        store["leaf"] = leaf
        return leaf

    return hook


_LIVE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def live_pattern_layers(model: Any) -> list[bool]:
    """For each layer, whether `hook_pattern` is in the autograd graph of the output.

    On TransformerBridge adapters that delegate attention to HuggingFace (OPT and others) the
    pattern hook fires after the fact: edits are discarded and no gradient arrives. One tiny
    forward+backward pass finds out; the answer is cached per model.
    """
    if model in _LIVE_CACHE:
        return _LIVE_CACHE[model]
    shape = model_shape(model)
    reached = [False] * shape.n_layers
    store: dict[str, Tensor] = {}

    def arrived(layer: int):
        def hook(grad: Tensor, hook: Any) -> None:
            reached[layer] = True

        return hook

    tokens = torch.zeros(1, 3, dtype=torch.long, device=_device(model))
    with preserved_state(model), torch.enable_grad():
        with model.hooks(
            fwd_hooks=[(RESID_PRE.format(0), gradient_leaf_hook(store))],
            bwd_hooks=[(PATTERN.format(layer), arrived(layer)) for layer in range(shape.n_layers)],
        ):
            logits = model(tokens)
            torch.autograd.grad(logits.float().sum(), [store["leaf"]], allow_unused=True)
    _LIVE_CACHE[model] = reached
    return reached


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class Batch:
    """Right-padded token ids and each prompt's real length."""

    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, "batch"]

    @property
    def padded(self) -> bool:
        return bool((self.lengths < self.tokens.shape[1]).any())


def to_batch(
    model: Any, tokens: Batch | Tensor | str | Sequence[str], *, prepend_bos: bool | None = None
) -> Batch:
    """Tokenise strings with the model's tokenizer (right padding) or check a token tensor.

    Right padding keeps every real position exactly where it is unpadded, so causal attention
    never lets a real token see a pad: RA of a padded batch equals RA of each prompt alone.
    """
    shape = model_shape(model)
    if isinstance(tokens, str):
        tokens = [tokens]
    if isinstance(tokens, Batch):
        ids, lengths = tokens.tokens, tokens.lengths
    elif isinstance(tokens, Tensor):
        ids = tokens if tokens.ndim == 2 else tokens.unsqueeze(0)
        if ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise TypeError(f"tokens must be integer ids, got {ids.dtype}")
        lengths = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)
    else:
        prompts = list(tokens)
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError("tokens must be an Int[Tensor, 'batch pos'], a string or strings")
        if not prompts:
            raise ValueError("empty batch: pass at least one prompt")
        rows = [model.to_tokens(p, prepend_bos=prepend_bos)[0] for p in prompts]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        pad = _pad_id(model)
        ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"empty batch: tokens have shape {tuple(ids.shape)}")
    if shape.n_ctx is not None and ids.shape[1] > shape.n_ctx:
        raise ValueError(
            f"{ids.shape[1]} tokens exceed the model's context of {shape.n_ctx}: "
            "shorten the prompts"
        )
    return Batch(ids.to(_device(model)), lengths.to(_device(model)))


def _pad_id(model: Any) -> int:
    tokenizer = getattr(model, "tokenizer", None)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0
