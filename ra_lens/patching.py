"""TransformerLens hook functions: attention patching with RA, its forward baseline, head ablation
(zero, or mean: `mean_head_outputs`, or Todd et al.'s `last_token_means` aligned at the last token).

Every function returns a plain list of `(hook_name, hook_fn)` pairs, so it composes with
`model.hooks(fwd_hooks=...)`, `model.run_with_hooks(...)`, `transformer_lens.patching` and other
people's hooks on the same points (`model`: a tiny random model, `ra_lens.toy_models.tiny_model`):

    >>> from ra_lens import metrics, reversed_attention
    >>> tokens = model.to_tokens("The capital of France is")
    >>> ra = reversed_attention(model, tokens, metrics.target_nll([294]))
    >>> with model.hooks(fwd_hooks=attention_patch_hooks(ra.mean_maps(), -16.0)):
    ...     logits = model(tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, HookedModel, Z
from ra_lens.checks import check_count
from ra_lens.math import upcast
from ra_lens.pairs import chunks
from ra_lens.result import ReversedAttention
from ra_lens.types import Hook, Tokens

Align = Literal["right", "strict"]
Heads = Validated[Iterable[tuple[int, int]] | Bool[Tensor, "layer head"]]
#: Mean head outputs for mean ablation: one vector per head (`mean_head_outputs`, used at every
#: position) or one per position counted back from the last token (`last_token_means`).
HeadMeans = Validated[Float[Tensor, "layer head d_head"] | Float[Tensor, "layer head pos d_head"]]


def attention_patch_hooks(
    maps: Validated[Float[Tensor, "layer head query key"] | ReversedAttention],
    scale: Validated[float | Float[Tensor, "layer head"]],
    *,
    layers: Validated[Sequence[int]] | None = None,
    heads: Heads | None = None,
    align: Validated[Align] = "right",
    model: HookedModel | None = None,
) -> list[Hook]:
    """Hooks adding `scale * maps[l, h]` to `blocks.{l}.attn.hook_pattern`, after the softmax.

    This is the paper's attention patching: with RA maps (dL/d(QK^T) of the loss), a negative
    scale moves attention in the gradient-descent direction; rows keep summing to one because
    RA rows sum to zero. Nothing is renormalised.

    Args:
        maps: Float[Tensor, "layer head query key"] covering every layer of the model (e.g.
            `ra.mean_maps()` of a call with all layers), or a ReversedAttention (its mean maps,
            placed at its own layers).
        scale: one number, or Float[Tensor, "layer head"] per head.
        layers: patch only these layers (default: all the maps cover).
        heads: patch only these (layer, head) pairs, or a Bool[Tensor, "layer head"] mask.
        align: prompts shorter or longer than the maps: "right" lines up the last positions
            (the paper's prompts end where the answer is predicted); "strict" raises.
        model: if given, first check that edits at hook_pattern reach the output in your own
            forward pass (on adapters that delegate attention to HuggingFace, such as OPT, only
            inside `ra_lens.live_attention(model)`) and raise if not.

    Returns:
        [(hook_name, hook_fn)] for `model.hooks(fwd_hooks=...)` or `run_with_hooks`.

    The patched pattern is A + scale * RA, and a small step along -RA lowers the loss (here
    in the last layer only, so that its A is the unpatched one):

    >>> from ra_lens import metrics, reversed_attention
    >>> tokens, metric = model.to_tokens("The capital of France is"), metrics.target_nll([294])
    >>> ra, name = reversed_attention(model, tokens, metric), PATTERN.format(1)
    >>> with model.hooks(fwd_hooks=attention_patch_hooks(ra, -1.0, layers=[1])):
    ...     with capture.recorded(model, [name]) as seen:
    ...         patched = metric(model(tokens))
    >>> torch.allclose(seen[name], ra.patterns[:, 1] - ra.maps[:, 1], atol=1e-6)
    True
    >>> bool(patched < ra.metric_values)
    True
    """
    if model is not None and isinstance(maps, Tensor) and maps.ndim == 4:
        n_layers = capture.model_shape(model).n_layers
        if maps.shape[0] != n_layers:
            raise ValueError(
                f"maps cover {maps.shape[0]} layers but the model has {n_layers}: pass maps for "
                "every layer (ra.mean_maps() of a call with all layers) or the ReversedAttention"
            )
    return _patch_hooks(_maps_by_layer(maps), scale, layers, heads, align, model)


def forward_patch_hooks(
    ra: ReversedAttention,
    scale: Validated[float | Float[Tensor, "layer head"]],
    *,
    layers: Validated[Sequence[int]] | None = None,
    heads: Heads | None = None,
    align: Validated[Align] = "right",
    model: HookedModel | None = None,
) -> list[Hook]:
    """The paper's baseline: add `scale * mean forward pattern` instead of RA (rows then sum to
    1 + scale). Same arguments as attention_patch_hooks.

    >>> from ra_lens import metrics, reversed_attention
    >>> tokens, name = model.to_tokens("The capital of France is"), PATTERN.format(0)
    >>> ra = reversed_attention(model, tokens, metrics.target_nll([294]))
    >>> with model.hooks(fwd_hooks=forward_patch_hooks(ra, 0.5, heads=[(0, 1)])):
    ...     with capture.recorded(model, [name]) as seen:
    ...         _ = model(tokens)
    >>> seen[name].sum(-1)[0, :, -1]  # rows of head 1 sum to 1.5, the others' to 1
    tensor([1.0000, 1.5000, 1.0000, 1.0000])
    """
    by_layer = _at_layers(ra.mean_patterns(), ra.layers)
    return _patch_hooks(by_layer, scale, layers, heads, align, model)


def _patch_hooks(
    by_layer: dict[int, Tensor],
    scale: Validated[float | Tensor],
    layers: Validated[Sequence[int]] | None,
    heads: Heads | None,
    align: Validated[Align],
    model: HookedModel | None,
) -> list[Hook]:
    if align not in ("right", "strict"):
        raise ValueError(f"unknown align {align!r}: choose 'right' or 'strict'")
    chosen = sorted(by_layer) if layers is None else capture.check_layer_list(layers)
    missing = [layer for layer in chosen if layer not in by_layer]
    if missing:
        raise ValueError(f"no maps for layers {missing}: the maps cover {sorted(by_layer)}")
    n_heads = next(iter(by_layer.values())).shape[0]
    scales = _per_head(scale, max(by_layer) + 1, n_heads, "scale")
    mask = _head_mask(heads, max(by_layer) + 1, n_heads)
    if model is not None:
        _check_shapes(model, by_layer)
        capture.require_live_patterns(
            model, chosen, "attention patching would silently do nothing", in_call=False
        )
    hooks = []
    for layer in chosen:
        delta = by_layer[layer] * (scales[layer] * mask[layer])[:, None, None]
        hooks.append((PATTERN.format(layer), _add_to_pattern(delta, align)))
    return hooks


def head_ablation_hooks(
    heads: Heads,
    *,
    mode: Validated[Literal["zero", "mean"]] = "zero",
    means: HeadMeans | None = None,
    lengths: Int[Tensor, "batch"] | None = None,
    model: HookedModel | None = None,
) -> list[Hook]:
    """Hooks that replace chosen heads' outputs at `blocks.{l}.attn.hook_z`.

    Args:
        heads: (layer, head) pairs or a Bool[Tensor, "layer head"] mask of heads to ablate.
        mode: "zero" sets the head output to zero; "mean" replaces it by `means`.
        means: Float[Tensor, "layer head d_head"] (`mean_head_outputs`: one vector per head, at
            every position) or Float[Tensor, "layer head pos d_head"] (`last_token_means`:
            position by position, lined up with each prompt's last real token).
        lengths: real length of each row of the batch the hooks will see (right padding);
            default: every row is unpadded. Position-aligned means need it for padded batches.
        model: if given, heads and layers are checked against it here rather than in the
            forward pass (they are always checked against `means`, and negative ones refused).

    Raises:
        ValueError: a negative head or layer, or one outside the model (or the means).

    >>> name = Z.format(1)
    >>> with model.hooks(fwd_hooks=head_ablation_hooks([(1, 2)])):
    ...     with capture.recorded(model, [name]) as z:
    ...         _ = model(model.to_tokens("Q: hot"))
    >>> z[name].shape, z[name][:, :, 2].abs().max().item(), bool(z[name][:, :, 3].abs().max() > 0)
    (torch.Size([1, 7, 4, 8]), 0.0, True)
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"unknown mode {mode!r}: choose 'zero' or 'mean'")
    if mode == "mean" and means is None:
        raise ValueError("mode='mean' needs means: pass means=mean_head_outputs(model, tokens)")
    chosen = means if mode == "mean" else None
    n_layers = n_heads = None
    if model is not None:
        shape = capture.model_shape(model)
        n_layers, n_heads = shape.n_layers, shape.n_heads
        check_means(chosen, n_layers, n_heads)
    elif chosen is not None:
        check_means(chosen, None, None)
        n_layers, n_heads = int(chosen.shape[0]), int(chosen.shape[1])
    by_layer: dict[int, list[int]] = {}
    for layer, head in _checked_heads(_pairs(heads), n_layers, n_heads):
        by_layer.setdefault(layer, []).append(head)

    def ablate(layer: int, picked: list[int]) -> Callable[[Tensor, Any], Tensor]:
        index = torch.tensor(picked)

        def hook(z: Tensor, hook: Any) -> Tensor:
            if max(picked) >= z.shape[2]:
                raise ValueError(
                    f"head {max(picked)} of layer {layer} does not exist: the layer has "
                    f"{z.shape[2]} heads (0..{z.shape[2] - 1})"
                )
            z = z.clone()
            if chosen is None:
                z[:, :, index] = 0.0
            else:
                rows = (
                    torch.full((z.shape[0],), z.shape[1], dtype=torch.long)
                    if lengths is None
                    else lengths
                )
                value = ablation_values(chosen[layer, index], rows, z.shape[1])
                z[:, :, index] = value.to(z.device, z.dtype)
            return z

        return hook

    return [(Z.format(layer), ablate(layer, picked)) for layer, picked in sorted(by_layer.items())]


def ablation_hooks(
    heads: Heads,
    *,
    means: HeadMeans | None = None,
    lengths: Int[Tensor, "batch"] | None = None,
    model: HookedModel | None = None,
) -> list[Hook]:
    """`head_ablation_hooks` with the mode read from `means`: zero ablation without them, mean
    ablation with them.

    >>> [name for name, _ in ablation_hooks([(1, 2), (0, 1), (1, 0)])]
    ['blocks.0.attn.hook_z', 'blocks.1.attn.hook_z']
    >>> with torch.no_grad(), model.hooks(fwd_hooks=ablation_hooks([(1, 2)])):
    ...     with capture.recorded(model, [Z.format(1)]) as z:
    ...         _ = model(model.to_tokens("I like Italy"))
    >>> bool((z[Z.format(1)][:, :, 2] == 0).all()), bool((z[Z.format(1)][:, :, 1] != 0).any())
    (True, True)
    """
    mode: Literal["zero", "mean"] = "zero" if means is None else "mean"
    return head_ablation_hooks(heads, mode=mode, means=means, lengths=lengths, model=model)


def check_means(means: HeadMeans | None, n_layers: int | None, n_heads: int | None) -> None:
    """Means of the right rank (and, given a shape, the model's layers and heads), or an error."""
    if means is None:
        return
    if not isinstance(means, Tensor) or means.ndim not in (3, 4):
        raise ValueError(
            "means must be Float[Tensor, 'layer head d_head'] (patching.mean_head_outputs) or "
            "Float[Tensor, 'layer head pos d_head'] (patching.last_token_means)"
        )
    if n_layers is not None and (means.shape[0] != n_layers or means.shape[1] != n_heads):
        raise ValueError(
            f"means of shape {tuple(means.shape)} do not fit a model of {n_layers} layers x "
            f"{n_heads} heads: compute them on this model"
        )


def ablation_values(
    means: Float[Tensor, "head d_head"] | Float[Tensor, "head mean_pos d_head"],
    lengths: Int[Tensor, "batch"],
    n_pos: int,
) -> Float[Tensor, "batch pos head d_head"]:
    """The value each ablated position takes: one vector per head, or the position-aligned mean
    counted back from each row's last real token. Positions further back than the means reach
    take the mean over the positions they cover; padding after the last token (which no real
    position can see) takes the last token's mean."""
    if means.ndim == 2:
        return means[None, None].expand(lengths.shape[0], n_pos, *means.shape)
    m = means.shape[1]
    table = torch.cat([means.flip(1), means.mean(1, keepdim=True)], dim=1)  # [head m+1 d]
    offset = lengths.cpu()[:, None] - 1 - torch.arange(n_pos)[None, :]
    index = offset.clamp(0, m)  # m = "further back than the means reach"
    return table[:, index].permute(1, 2, 0, 3)


def mean_head_outputs(model: HookedModel, tokens: Tokens) -> Float[Tensor, "layer head d_head"]:
    """Each head's output at hook_z, averaged over prompts and real positions (for mean ablation).

    >>> means = mean_head_outputs(model, "Q: hot")
    >>> with capture.recorded(model, [Z.format(0)]) as z:
    ...     _ = model(model.to_tokens("Q: hot"))
    >>> means.shape, torch.allclose(means[0], z[Z.format(0)][0].mean(0), atol=1e-6)
    (torch.Size([2, 4, 8]), True)
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    real = batch.real_mask()[:, :, None, None]
    names = [Z.format(layer) for layer in range(shape.n_layers)]
    with capture.preserved_state(model), torch.no_grad(), capture.recorded(model, names) as z:
        model(batch.tokens)
    means = [(z[name].float() * real).sum((0, 1)) / real.sum() for name in names]
    return torch.stack(means).cpu()


def last_token_means(
    model: HookedModel, tokens: Tokens, *, batch_size: int = 16
) -> Float[Tensor, "layer head pos d_head"]:
    """Each head's hook_z output averaged over prompts position by position, counted back from
    each prompt's last real token (Todd et al.'s alignment for function vectors).

    means[l, h, -1] is the mean output at the last token, means[l, h, -2] one token earlier, and
    so on; entry -1 - j averages the prompts that are longer than j tokens. Use it with
    `ablation_hooks` (mean ablation) on held-out prompts of the same task; `mean_head_outputs`
    (one mean over all real positions) is the position-free alternative.

    Returns:
        Float[Tensor, "layer head pos d_head"] on the CPU, pos = the longest prompt's length.

    >>> prompts = ["I like Italy and France", "Q: hot"]
    >>> [model.to_tokens(p).shape[1] for p in prompts]
    [11, 7]
    >>> means = last_token_means(model, prompts)  # [layer head pos d_head]
    >>> means.shape
    torch.Size([2, 4, 11, 8])
    >>> with torch.no_grad(), capture.recorded(model, [Z.format(0)]) as z:
    ...     _ = model(model.to_tokens(prompts[0]))
    >>> torch.allclose(means[0, :, 0], z[Z.format(0)][0, 0])  # only prompt 0 reaches back 11
    True
    """
    check_count(batch_size, "batch_size")
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    m = int(batch.lengths.max())
    sums = torch.zeros(shape.n_layers, shape.n_heads, m, shape.d_head, dtype=torch.float64)
    counts = torch.zeros(m, dtype=torch.float64)
    names = [Z.format(la) for la in range(shape.n_layers)]
    with capture.preserved_state(model):
        for rows in chunks(batch.tokens.shape[0], batch_size):
            part = batch.rows(rows, trim=True)
            lengths, tokens_part = part.lengths, part.tokens
            # offset[i, p] = how many tokens position p lies before prompt i's last token
            offset = lengths.cpu()[:, None] - 1 - torch.arange(tokens_part.shape[1])[None, :]
            real = offset >= 0
            slot = (m - 1 - offset).clamp(0, m - 1)  # where position p lands on the aligned axis
            with torch.no_grad(), capture.recorded(model, names) as acts:
                model(tokens_part)
            for layer, name in enumerate(names):
                values = upcast(acts.pop(name)).double().cpu() * real[:, :, None, None]
                flat = values.permute(1, 0, 2, 3).reshape(-1, shape.n_heads, shape.d_head)
                aligned = torch.zeros(m, shape.n_heads, shape.d_head, dtype=torch.float64)
                aligned.index_add_(0, slot.T.reshape(-1), flat)  # [m head d], summed over prompts
                sums[layer] += aligned.permute(1, 0, 2)
            counts.index_add_(0, slot[real], torch.ones(int(real.sum()), dtype=torch.float64))
    return (sums / counts[None, None, :, None]).float()


def _maps_by_layer(maps: Validated[Tensor | ReversedAttention]) -> dict[int, Tensor]:
    if isinstance(maps, ReversedAttention):
        return _at_layers(maps.mean_maps(), maps.layers)
    if not isinstance(maps, Tensor) or maps.ndim != 4 or maps.shape[-1] != maps.shape[-2]:
        shape = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        raise ValueError(
            f"maps must be Float[Tensor, 'layer head query key'] with as many queries as keys "
            f"(ra.mean_maps() of prompts of one length), got {shape}"
        )
    return _at_layers(maps, list(range(maps.shape[0])))


def _at_layers(maps: Tensor, layers: list[int]) -> dict[int, Tensor]:
    if not torch.isfinite(maps).all():
        raise ValueError("maps contain NaN or inf: refusing to patch them into the model")
    return {layer: maps[i].float() for i, layer in enumerate(layers)}


def _per_head(value: Validated[float | Tensor], n_layers: int, n_heads: int, name: str) -> Tensor:
    if isinstance(value, Tensor) and value.ndim > 0:
        if value.shape != (n_layers, n_heads):
            raise ValueError(
                f"{name} must be a number or [{n_layers}, {n_heads}], got {tuple(value.shape)}"
            )
        values = value.detach().float().cpu()
    else:
        values = torch.full((n_layers, n_heads), float(value))
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} must be finite, got NaN or inf: it would make the logits NaN")
    return values


def _head_mask(heads: Heads | None, n_layers: int, n_heads: int) -> Tensor:
    if heads is None:
        return torch.ones(n_layers, n_heads)
    mask = torch.zeros(n_layers, n_heads)
    for layer, head in _pairs(heads):
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ValueError(f"head ({layer}, {head}) outside the maps' {n_layers} x {n_heads}")
        mask[layer, head] = 1.0
    return mask


def _pairs(heads: Heads) -> list[tuple[int, int]]:
    if isinstance(heads, Tensor):
        if heads.ndim != 2:
            raise ValueError(
                f"a head mask must be Bool[Tensor, 'layer head'], got {tuple(heads.shape)}"
            )
        return [(int(la), int(h)) for la, h in heads.nonzero().tolist()]
    pairs = list(heads)
    if not all(isinstance(p, (tuple, list, Tensor)) and len(p) == 2 for p in pairs):
        raise ValueError(
            f"heads must be (layer, head) pairs, got {heads!r}: for one head write "
            "heads=[(layer, head)], or pass a Bool[Tensor, 'layer head'] mask"
        )
    return [(int(la), int(h)) for la, h in pairs]


def _checked_heads(
    pairs: list[tuple[int, int]], n_layers: int | None, n_heads: int | None
) -> list[tuple[int, int]]:
    """Pairs with no negative index and, given the shape, none outside it."""
    for layer, head in pairs:
        negative = layer < 0 or head < 0
        outside = (
            n_layers is not None
            and n_heads is not None
            and not (layer < n_layers and head < n_heads)
        )
        if negative or outside:
            where = (
                f"the model has layers 0..{n_layers - 1} of heads 0..{n_heads - 1}"
                if n_layers is not None and n_heads is not None
                else "indices count from 0 (a negative one does not count from the end)"
            )
            raise ValueError(f"head ({layer}, {head}) does not exist: {where}")
    return pairs


def _check_shapes(model: HookedModel, by_layer: dict[int, Tensor]) -> None:
    shape = capture.model_shape(model)
    n_heads = next(iter(by_layer.values())).shape[0]
    if max(by_layer) >= shape.n_layers or n_heads != shape.n_heads:
        raise ValueError(
            f"maps cover layers up to {max(by_layer)} with {n_heads} heads, but the model has "
            f"{shape.n_layers} layers of {shape.n_heads} heads: compute them on this model"
        )


def _add_to_pattern(delta: Tensor, align: Align) -> Callable[[Tensor, Any], Tensor]:
    """delta: [head, m, m]; added to the last min(n, m) query/key positions of the pattern."""
    m = delta.shape[-1]

    def hook(pattern: Tensor, hook: Any) -> Tensor:
        n = pattern.shape[-1]
        if pattern.shape[1] != delta.shape[0]:
            raise ValueError(
                f"maps have {delta.shape[0]} heads but the model's pattern has {pattern.shape[1]}: "
                "compute the maps on this model"
            )
        if n != m and align == "strict":
            raise ValueError(
                f"prompt of {n} tokens but maps of {m} (align='strict'): use prompts of the maps' "
                "length or align='right'"
            )
        k = min(n, m)
        patched = pattern.clone()
        patched[..., n - k :, n - k :] += delta[:, m - k :, m - k :].to(
            pattern.device, pattern.dtype
        )
        return patched

    # Aligned to the last positions of the whole tensor, so a right-padded batch would be
    # patched at the wrong places: tasks.evaluate batches such hooks by token length.
    hook.aligned_to_end = True  # type: ignore[attr-defined]
    return hook
