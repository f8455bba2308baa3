"""memory="layerwise": the backward pass of reversed_attention one transformer block at a time.

The default route keeps the whole autograd graph, every layer's attention pattern included
(layers x heads x pos^2 floats). Here one forward pass runs without autograd and keeps only what
each block was called with (its residual input and keyword arguments such as the attention mask
and the rotary cos/sin: O(layers x pos x d_model)). Then the head (ln_final + unembed) is
recomputed with autograd from the final residual to get dL/d(resid_final), and, from the last
block down to the first chosen one, each block is called again with autograd on and the incoming
gradient is pushed through it to its input. The RA hooks fire inside each recomputed block exactly
as in one pass; only one block's graph is alive at a time.

Both passes go through the model's own modules, so hooks already on the model (an enclosing
`model.hooks(...)`) apply in both. Nothing here knows how RA is read from a block: the caller
passes a context manager that activates its hooks for the recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ra_lens.capture import HookedModel, output_softcap
from ra_lens.progress import tqdm

LossFn = Callable[[Tensor], tuple[Tensor, Tensor]]

_UNSUPPORTED = "use memory='full' (the default) for this model"


def layerwise_backward(
    model: HookedModel,
    tokens: Int[Tensor, "batch pos"],
    first_layer: int,
    loss_fn: LossFn,
    grad_hooks: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Float[Tensor, "..."]:
    """Run the metric's backward pass through blocks first_layer..n_layers-1, one at a time.

    Args:
        model: a TransformerLens model with `blocks`, `unembed` and (if it normalises) `ln_final`.
        tokens: Int[Tensor, "batch pos"] on the model's device.
        first_layer: the lowest block whose attention is wanted; the backward pass stops at its
            input (no gradient goes further down, as with the default route's gradient leaf).
        loss_fn: logits Float[Tensor, "batch pos vocab"] -> (per-prompt values, scalar loss).
        grad_hooks: returns a context manager that activates the hooks reading RA; it is entered
            for the recomputation only, never for the forward pass without autograd.

    Returns:
        The per-prompt metric values (with their graph, as loss_fn returned them).

    Raises:
        RuntimeError: the model's blocks cannot be recomputed one by one (not called back to
            back on the residual stream, or a head that is not ln_final -> unembed).

    `reversed_attention(..., memory="layerwise")` calls it, with the same result as one pass
    (`model`: a tiny random model, `ra_lens.toy_models.tiny_model`):

    >>> from ra_lens import metrics, reversed_attention
    >>> tokens, metric = model.to_tokens("The capital of France is"), metrics.target_nll([294])
    >>> full = reversed_attention(model, tokens, metric)
    >>> layerwise = reversed_attention(model, tokens, metric, memory="layerwise")
    >>> torch.allclose(layerwise.maps, full.maps, atol=1e-6)
    True
    """
    blocks = _blocks(model)
    head = _head(model)
    calls, final = _record(model, tokens, blocks, first_layer, head[0])
    # The metric runs before the RA hooks are on: it may run the model itself.
    with torch.enable_grad():
        values, grad = _head_backward(head, final, loss_fn, output_softcap(model))
    del final
    with grad_hooks(), torch.enable_grad():
        for index in tqdm(
            range(len(blocks) - 1, first_layer - 1, -1), desc="layerwise", leave=False, disable=None
        ):
            args, kwargs = calls.pop(index)
            grad = _block_backward(blocks[index], index, args, kwargs, grad)
    return values


def _blocks(model: HookedModel) -> list[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) != int(model.cfg.n_layers):
        raise RuntimeError(
            f"{type(model).__name__} has no `blocks` list of {model.cfg.n_layers} layers to "
            f"recompute one by one: {_UNSUPPORTED}"
        )
    return list(blocks)


def _head(model: HookedModel) -> tuple[nn.Module, nn.Module | None]:
    """(the module that receives the final residual, the unembedding or None if it is that)."""
    unembed = getattr(model, "unembed", None)
    if unembed is None:
        raise RuntimeError(f"{type(model).__name__} has no `unembed` module: {_UNSUPPORTED}")
    ln_final = getattr(model, "ln_final", None)
    return (ln_final, unembed) if isinstance(ln_final, torch.nn.Module) else (unembed, None)


def _residual(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return cast(Tensor, args[0] if args else kwargs["hidden_states"])


def _with_residual(
    args: tuple[Any, ...], kwargs: dict[str, Any], x: Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _is_cache(value: Any) -> bool:
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def _first_tensor(output: Any) -> Tensor:
    return cast(Tensor, output[0] if isinstance(output, (tuple, list)) else output)


def _record(
    model: HookedModel,
    tokens: Tensor,
    blocks: list[nn.Module],
    first_layer: int,
    head_input: nn.Module,
) -> tuple[dict[int, tuple[tuple[Any, ...], dict[str, Any]]], dict[str, Tensor]]:
    """Forward without autograd, keeping each chosen block's call and the head's input.

    Also checks the assumption the backward pass relies on: each block's input is the previous
    block's output, and the head's input is the last block's output (nothing in between).
    """
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    previous: dict[str, Tensor] = {}
    final: dict[str, Tensor] = {}

    def check_link(where: str, x: Tensor) -> None:
        before = previous.pop("out", None)
        if before is not None and x is not before and not torch.equal(x, before):
            raise RuntimeError(
                f"the input of {where} is not the previous block's output: the blocks are not "
                f"composed back to back on the residual stream, so they cannot be recomputed "
                f"one by one: {_UNSUPPORTED}"
            )

    def before_block(index: int) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = _residual(args, kwargs)
            check_link(f"block {index}", x)
            # The model made a fresh key/value cache for this forward pass (reversed_attention
            # passes tokens only); recomputing with it would append the keys again, so the
            # recomputation runs without one.
            kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
            calls[index] = (args, kwargs)

        return hook

    def after_block(
        module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        previous["out"] = _first_tensor(output)

    def before_head(module: Any, args: tuple[Any, ...]) -> None:
        check_link("the final layer norm / unembedding", args[0])
        final["resid"] = args[0]

    handles = [head_input.register_forward_pre_hook(before_head)]
    for index in range(first_layer, len(blocks)):
        block = blocks[index]
        handles.append(block.register_forward_pre_hook(before_block(index), with_kwargs=True))
        handles.append(block.register_forward_hook(after_block, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    if "resid" not in final or len(calls) != len(blocks) - first_layer:
        raise RuntimeError(
            "the forward pass did not call every block and the head once: "
            f"{type(model).__name__} cannot be recomputed block by block: {_UNSUPPORTED}"
        )
    # Kept to check that ln_final -> unembed reproduces the model's own logits.
    final["last_logits"] = logits[:, -1].clone()
    return calls, final


def _head_backward(
    head: tuple[nn.Module, nn.Module | None],
    final: dict[str, Tensor],
    loss_fn: LossFn,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The metric and dL/d(final residual), recomputing only the head with autograd (and the
    final logit soft-cap, c tanh(logits / c), where the model has one)."""
    resid = final["resid"].detach().requires_grad_(True)
    logits = head[0](resid) if head[1] is None else head[1](head[0](resid))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = final["last_logits"]
    if logits.shape[:1] + logits.shape[2:] != expected.shape or not torch.allclose(
        logits[:, -1].detach(), expected, rtol=1e-5, atol=1e-6
    ):
        raise RuntimeError(
            "the model's logits are not unembed(ln_final(last block's output)) (for example a "
            f"logit soft-cap after the unembedding): {_UNSUPPORTED}"
        )
    values, loss = loss_fn(logits)
    (grad,) = torch.autograd.grad(loss, [resid], allow_unused=True)
    if grad is None:
        raise ValueError(
            "the metric does not depend on the attention of the chosen layers "
            "(no gradient path): compute it from the logits the model returns"
        )
    return values, grad


def _block_backward(
    block: nn.Module, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], grad: Tensor
) -> Tensor:
    """Call one block again with autograd and return dL/d(its residual input)."""
    x = _residual(args, kwargs).detach().requires_grad_(True)
    args, kwargs = _with_residual(args, kwargs, x)
    out = _first_tensor(block(*args, **kwargs))
    (x_grad,) = torch.autograd.grad(out, [x], grad_outputs=[grad.to(out.device)], allow_unused=True)
    if x_grad is None:
        raise RuntimeError(f"block {index}'s output does not depend on its residual input")
    return x_grad
