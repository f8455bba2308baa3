"""What an ra-lens call does to a model's state, and how it gives it back.

The claim that one thread at a time is inside an ra-lens call on a model (`exclusive`, with its
process-wide table `CLAIMS`), train/eval mode, requires_grad flags and parameter .grad restored
as found (`restored`, `modules_in_eval`), the modules a forward pass reaches (`model_modules`),
recording hook values (`recorded`) and the gradient leaf that gives a frozen model a graph
(`gradient_leaf_hook`). Below `liveness` and `capture`, which build their context managers from
these; it imports only the contract's `HookedModel`.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from ra_lens._typing import no_type_check
from ra_lens.contract import LN2_IN, PATTERN, RESID_PRE, HookedModel  # noqa: F401  (doctests use them)

#: Which thread holds each model inside an ra-lens call, and how deeply (`exclusive`), held
#: weakly. Process-wide on purpose: a claim made in one thread must be seen by every other.
CLAIMS: weakref.WeakKeyDictionary[HookedModel, tuple[int, int]] = weakref.WeakKeyDictionary()


#: Guards `CLAIMS` (a check and a claim are one step).
CLAIMS_LOCK = threading.Lock()


@contextlib.contextmanager
def exclusive(model: HookedModel) -> Iterator[None]:
    """Claim the model for this thread; a second thread gets a clear error instead of hooks
    firing in the wrong call. Re-entrant within one thread (ra-lens functions call each other).

    Raises:
        RuntimeError: another thread is inside an ra-lens call on this model.
    """
    me = threading.get_ident()
    with CLAIMS_LOCK:
        owner, depth = CLAIMS.get(model, (None, 0))
        if owner is not None and owner != me:
            raise RuntimeError(
                "this model is already in use by an ra-lens call in another thread: ra-lens adds "
                "hooks to the model, so it allows one call at a time per model. Run the calls "
                "one after another, or give each thread its own copy (copy.deepcopy(model))"
            )
        CLAIMS[model] = (me, depth + 1)
    try:
        yield
    finally:
        with CLAIMS_LOCK:
            owner, depth = CLAIMS[model]
            if depth == 1:
                del CLAIMS[model]
            else:
                CLAIMS[model] = (owner, depth - 1)


def require_autograd() -> None:
    """Refuse to run inside torch.inference_mode(), where no graph can be built."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "ra-lens needs autograd, and this call runs inside torch.inference_mode(): call it "
            "outside that block (torch.no_grad() around it is fine: ra-lens re-enables grad)"
        )


@contextlib.contextmanager
def restored(model: HookedModel) -> Iterator[None]:
    """Run in eval mode (`modules_in_eval`); afterwards restore requires_grad flags, every
    parameter's .grad and the config switches ra-lens turns on for a call (`CFG_SWITCHES`) as
    found. No claim and no liveness: `capture.preserved_state` adds those."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    switches = {k: getattr(model.cfg, k) for k in CFG_SWITCHES if hasattr(model.cfg, k)}
    try:
        with modules_in_eval(model):
            yield
    finally:
        for p, flag, grad in zip(params, flags, grads):
            p.requires_grad_(flag)
            p.grad = grad
        for key, value in switches.items():
            setattr(model.cfg, key, value)


#: Config switches a call may turn on (HookedTransformer's hook_mlp_in, for edge patching) and
#: `restored` gives back.
CFG_SWITCHES: tuple[str, ...] = ("use_hook_mlp_in",)


def enable_mlp_in(model: HookedModel) -> None:
    """HookedTransformer fires `hook_mlp_in` only with cfg.use_hook_mlp_in: switch it on, inside
    `capture.preserved_state`, which gives the flag back as found (on an error too);
    TransformerBridge uses ln2.hook_in and needs nothing."""
    if (
        LN2_IN.format(0) in model.hook_dict
        or not hasattr(model, "set_use_hook_mlp_in")
        or getattr(model.cfg, "attn_only", False)
    ):
        return
    if model not in CLAIMS:
        raise RuntimeError(
            "enable_mlp_in switches cfg.use_hook_mlp_in on for a call: run it inside "
            "capture.preserved_state(model), which switches it back"
        )
    model.set_use_hook_mlp_in(True)


@contextlib.contextmanager
def modules_in_eval(model: HookedModel) -> Iterator[None]:
    """Put every module that takes part (`model_modules`) in eval mode; afterwards each gets
    its own mode back."""
    modules = model_modules(model)
    modes = [m.training for m in modules]
    # TL 4's GPT-2 attention bridge caches its last pattern; ours would keep our graph alive.
    cached = {m: m._pattern for m in modules if hasattr(m, "_pattern")}
    # Module.train() walks every submodule through the bridge's slow __setattr__ (about 0.25 s
    # on SmolLM2, most of an RA ranking's time on a GPU): touch only the modules that change.
    for module, mode in zip(modules, modes):
        if mode:
            module.training = False
    try:
        yield
    finally:
        for module, pattern in cached.items():
            module._pattern = pattern
        for module, mode in zip(modules, modes):
            if module.training != mode:
                module.training = mode


def model_modules(model: HookedModel) -> list[torch.nn.Module]:
    """Every module that takes part in the model's forward pass, each once.

    A TransformerBridge registers its adapters as submodules but holds the HuggingFace model in
    `original_model` without registering it: the HF root and modules only it calls (GPT-2's
    embedding dropout `transformer.drop`) are missing from `model.modules()`, so `model.eval()`
    leaves them in train mode.

    >>> len(model_modules(model)) >= len(list(model.modules()))
    True
    """
    found: dict[int, torch.nn.Module] = {id(m): m for m in model.modules()}
    hf = getattr(model, "original_model", None)
    if isinstance(hf, torch.nn.Module):
        for module in hf.modules():
            found.setdefault(id(module), module)
    return list(found.values())


@contextlib.contextmanager
def recorded(
    model: HookedModel, names: Iterable[str], *, grad: bool = False
) -> Iterator[dict[str, Tensor]]:
    """Record the forward value of each named hook point into the yielded dict; with grad=True,
    the gradient that reaches it in a backward pass run inside the block instead.

    Values are detached copies (some adapters hand hooks a view that their attention code
    reuses). The first value is kept: a hook point that fires twice does not overwrite it. Names
    the model lacks are skipped (check the dict). Hooks are removed on exit.

    >>> with recorded(model, [PATTERN.format(0), "no.such.hook"]) as acts:
    ...     _ = model(model.to_tokens("Q: hot"))  # 7 tokens
    >>> {name: tuple(value.shape) for name, value in acts.items()}
    {'blocks.0.attn.hook_pattern': (1, 4, 7, 7)}
    """
    store: dict[str, Tensor] = {}

    def keep(name: str) -> Callable[[Tensor, Any], None]:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> None:
            if name not in store:
                store[name] = value.detach().clone()

        return hook

    points = model.hook_dict  # built afresh on every access by a bridge
    present = [name for name in dict.fromkeys(names) if name in points]
    hooks = [(name, keep(name)) for name in present]
    with model.hooks(**{"bwd_hooks" if grad else "fwd_hooks": hooks}):
        yield store


def gradient_leaf_hook(store: dict[str, Tensor]) -> Callable[[Tensor, Any], Tensor]:
    """Forward hook that turns an activation into a fresh leaf that requires grad.

    This is how a frozen model (requires_grad False everywhere) still gets a graph, and why no
    parameter gradient is ever computed: the backward pass stops at this leaf.

    >>> store = {}
    >>> with model.hooks(fwd_hooks=[(RESID_PRE.format(1), gradient_leaf_hook(store))]):
    ...     logits = model(model.to_tokens("Q: hot"))
    >>> (grad,) = torch.autograd.grad(logits[0, -1, 5], store["leaf"])
    >>> grad.shape  # dL/d resid_pre of layer 1: [batch pos d_model]
    torch.Size([1, 7, 32])
    """

    def hook(activation: Tensor, hook: Any) -> Tensor:
        leaf = activation.detach().requires_grad_(True)
        store["leaf"] = leaf
        return leaf

    return hook
