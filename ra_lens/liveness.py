"""Is `hook_pattern` in the autograd graph, and making it so where an adapter delegates attention.

TransformerLens 4's plain `AttentionBridge` (GPT-Neo, GPT-J, OPT, ...) calls HuggingFace's
attention module and fires `hook_pattern` afterwards on the weights it returns: an edit there is
discarded and no gradient arrives. The bridge has a seam for modules that run the pattern through
the hook themselves (`accepts_pattern_fn`: it then passes `pattern_fn=hook_pattern` and skips the
after-the-fact firing). `live_attention` uses it: for the duration of the block, the HuggingFace
module's softmax output (the first [.., query, key] softmax of its forward) goes through
`hook_pattern` inside the computation, so edits reach the output and dL/dA exists. Every ra-lens
call enters it (`capture.preserved_state`); wrap your own runs in it to patch such models with
`attention_patch_hooks`.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ra_lens import state
from ra_lens.contract import PATTERN, RESID_PRE, HookedModel, check_model

#: What the probe found, per model: for each layer, whether hook_pattern is in the autograd graph
#: of the output as the model was found. `_probe` learns it by a tiny silent forward+backward
#: pass (the model's state restored), which costs a pass, and the answer depends only on the
#: model's modules, which ra-lens never swaps: so it runs once per model and is kept here, held
#: weakly (a collected model leaves no entry). After swapping a model's attention modules or its
#: attention implementation, call `forget_probe(model)`.
PROBED: weakref.WeakKeyDictionary[HookedModel, list[bool]] = weakref.WeakKeyDictionary()
#: The layers `live_attention`'s seam makes live, per model (the probe run with the seam in
#: place; kept and forgotten with `PROBED`).
SEAMED: weakref.WeakKeyDictionary[HookedModel, set[int]] = weakref.WeakKeyDictionary()
#: How many `live_attention` blocks are open on each model (re-entrant: only the outermost one
#: installs and removes the seam).
OPEN_BLOCKS: weakref.WeakKeyDictionary[HookedModel, int] = weakref.WeakKeyDictionary()
_SOFTMAXES = (torch.softmax, F.softmax, Tensor.softmax)
#: What the seam sets on each HuggingFace module's instance (and puts back or removes on exit).
#: `__getstate__` keeps the rest out of copies: deepcopy and pickle of the model inside a block
#: read a module's state from it, so a clone gets the module as it was before the seam (not a
#: closure still running the original module's forward).
_SEAM_ATTRS = ("forward", "accepts_pattern_fn", "__getstate__")


def live_pattern_layers(model: HookedModel, *, in_call: bool = True) -> list[bool]:
    """For each layer, whether `hook_pattern` is in the autograd graph of the output.

    Args:
        in_call: inside an ra-lens call, which runs under `live_attention` (True), or in the
            caller's own forward pass (False: live as the adapter computes it, or through a
            `live_attention` block that is open now).

    A tiny forward+backward pass finds out (with and without the seam), once per model (`PROBED`;
    `forget_probe` drops it).

    >>> live_pattern_layers(model)  # GPT-2 and HookedTransformer compute attention themselves
    [True, True]
    """
    if model not in PROBED:
        PROBED[model] = _probe(model)
    seamed = _seamable(model) if in_call or OPEN_BLOCKS.get(model, 0) else set()
    return [live or layer in seamed for layer, live in enumerate(PROBED[model])]


def forget_probe(model: HookedModel) -> None:
    """Drop what the probe found for `model` (`PROBED`, `SEAMED`), so the next call probes again:
    after swapping its attention modules or its attention implementation.

    >>> _ = live_pattern_layers(model)
    >>> model in PROBED, forget_probe(model), model in PROBED
    (True, None, False)
    """
    PROBED.pop(model, None)
    SEAMED.pop(model, None)


def _seamable(model: HookedModel) -> set[int]:
    """The layers `live_attention` makes live: the delegating layers (`_seam_layers`) where a
    probe with the seam installed finds hook_pattern in the graph. Probed once per model; under
    torch.inference_mode(), where no probe can run, none (the model is used as found)."""
    if model not in SEAMED:
        if torch.is_inference_mode_enabled():
            return set()
        candidates = _seam_layers(model)
        reached: list[bool] = []
        if candidates:
            undo = _install(model, candidates)
            try:
                reached = _probe(model)
            finally:
                for restore in undo:
                    restore()
        SEAMED[model] = {layer for layer in candidates if reached[layer]}
    return SEAMED[model]


def require_live_patterns(
    model: HookedModel, layers: Sequence[int], needed_for: str, *, in_call: bool = True
) -> None:
    """Raise unless `hook_pattern` of every chosen layer is in the autograd graph of the output
    (`live_pattern_layers`): there, edits reach the output and dL/dA exists.

    Args:
        needed_for: what the caller would get wrong otherwise, for the message (e.g. "attention
            patching would silently do nothing").
        in_call: as for `live_pattern_layers`.

    Raises:
        RuntimeError: naming the layers, the reason (the adapter delegates attention to
            HuggingFace), `needed_for` and the way out (`live_attention`, where it applies).

    >>> require_live_patterns(model, [0, 1], "patching would do nothing")  # GPT-2: passes
    """
    live = live_pattern_layers(model, in_call=in_call)
    dead = [layer for layer in layers if not live[layer]]
    if not dead:
        return
    way_out = (
        "wrap the run in `with ra_lens.live_attention(model):`, which routes HuggingFace's "
        "softmax through hook_pattern"
        if _seamable(model) >= set(dead)
        else "use a model that computes attention through its hooks (GPT-2/Llama-style "
        "TransformerBridge, boot_native, HookedTransformer)"
    )
    raise RuntimeError(
        f"hook_pattern of layers {dead} is not in the autograd graph of the output (the "
        "adapter delegates attention to HuggingFace), so edits there do not reach the output "
        f"and no dL/dA arrives: {needed_for}; {way_out}"
    )


@contextlib.contextmanager
def live_attention(model: HookedModel) -> Iterator[None]:
    """Make `hook_pattern` live on the layers whose adapter delegates attention to HuggingFace
    (module docstring); other layers, and models without such layers, are untouched. Restored on
    exit; re-entrant. A `copy.deepcopy` of the model made inside the block is a model as found
    (without the seam), independent of this one.

    >>> with live_attention(model):  # GPT-2: already live, nothing to do
    ...     live_pattern_layers(model)
    [True, True]
    """
    check_model(model)  # a model without weights is refused here too, not at its first call
    layers = _seamable(model)
    if not layers:
        yield
        return
    opened = OPEN_BLOCKS.get(model, 0) == 0
    undo = _install(model, layers) if opened else []
    OPEN_BLOCKS[model] = OPEN_BLOCKS.get(model, 0) + 1
    try:
        yield
    finally:
        OPEN_BLOCKS[model] -= 1
        if opened:
            for restore in undo:
                restore()


def _seam_layers(model: HookedModel) -> set[int]:
    """Layers whose attention is a bridge that delegates to a HuggingFace module and whose
    hook_pattern is not live as found: where the seam can help (HookedTransformer: none, and
    no probe)."""
    blocks = model.blocks
    modules = [getattr(block.attn, "original_component", None) for block in blocks]
    wrapped = [
        layer
        for layer, (block, inner) in enumerate(zip(blocks, modules))
        if isinstance(inner, torch.nn.Module) and hasattr(block.attn, "hook_pattern")
    ]
    if not wrapped:
        return set()
    if model not in PROBED:
        PROBED[model] = _probe(model)
    return {layer for layer in wrapped if not PROBED[model][layer]}


def _install(model: HookedModel, layers: set[int]) -> list[Callable[[], None]]:
    """Give each layer's HuggingFace module the bridge's pattern seam; returns the undo steps."""
    undo: list[Callable[[], None]] = []
    for layer in sorted(layers):
        inner = model.blocks[layer].attn.original_component
        forward = inner.forward
        # instance attributes the module already had (e.g. accelerate's forward): put back
        saved = {name: vars(inner)[name] for name in _SEAM_ATTRS if name in vars(inner)}

        def seamed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            pattern_fn = kwargs.pop("pattern_fn", None)
            if pattern_fn is None:
                return _forward(*args, **kwargs)
            with _PatternThrough(pattern_fn):
                return _forward(*args, **kwargs)

        inner.forward = seamed
        inner.accepts_pattern_fn = True
        inner.__getstate__ = functools.partial(_state_without_seam, inner, saved)

        def restore(inner: Any = inner, saved: dict[str, Any] = saved) -> None:
            for name in _SEAM_ATTRS:
                if name in saved:
                    setattr(inner, name, saved[name])
                else:
                    vars(inner).pop(name, None)

        undo.append(restore)
    return undo


def _state_without_seam(inner: torch.nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """The module's state as copy.deepcopy and pickle see it, minus the seam: the instance
    attributes the seam replaced are those it had before (`saved`), the ones it added are absent.
    Without this a deep copy made inside `live_attention` keeps `forward` = the closure over the
    original module, so the clone computes attention with the original's weights."""
    getstate = saved.get("__getstate__", functools.partial(type(inner).__getstate__, inner))
    state = dict(getstate())
    for name in _SEAM_ATTRS:
        state.pop(name, None)
        if name in saved:
            state[name] = saved[name]
    return state


class _PatternThrough(TorchFunctionMode):
    """Inside one HuggingFace attention forward: the first softmax over a [.., query, key] tensor
    (the pattern) goes through `pattern_fn` (the bridge's hook_pattern)."""

    def __init__(self, pattern_fn: Callable[[Tensor], Tensor]):
        super().__init__()
        self.pattern_fn, self.done = pattern_fn, False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.done and func in _SOFTMAXES and isinstance(out, Tensor) and out.ndim == 4:
            self.done = True
            return self.pattern_fn(out)
        return out


def _probe(model: HookedModel) -> list[bool]:
    """One tiny forward+backward: which layers' hook_pattern receive a gradient."""
    state.require_autograd()
    names = [PATTERN.format(layer) for layer in range(check_model(model).n_layers)]
    store: dict[str, Tensor] = {}
    device = next(model.parameters()).device
    tokens = torch.zeros(1, 3, dtype=torch.long, device=device)
    with state.exclusive(model), state.restored(model), torch.enable_grad():
        with (
            model.hooks(fwd_hooks=[(RESID_PRE.format(0), state.gradient_leaf_hook(store))]),
            state.recorded(model, names, grad=True) as grads,
        ):
            logits = model(tokens)
            torch.autograd.grad(logits.float().sum(), [store["leaf"]], allow_unused=True)
    return [name in grads for name in names]
