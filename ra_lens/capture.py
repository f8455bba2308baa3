"""The model contract: everything ra-lens knows about a model lives here and in `ra_lens.contract`.

State, tokenisation and recording here; hook names and attention geometry in `ra_lens.contract`,
re-exported below. The rest of the package speaks TransformerLens hook names only (those
constants), so any HookedRootModule works (TL 2.x/3.x HookedTransformer, TL 3.x/4.x
TransformerBridge): `HookedModel` says what is used. Nothing here leaves state behind:
`preserved_state` restores train/eval mode, requires_grad flags and parameter .grad; every hook is
scoped by a context manager.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ra_lens._typing import Validated

# The fixed part of the contract lives in ra_lens.contract; every name stays importable from here.
from ra_lens.contract import (  # noqa: F401
    ATTN_IN,
    COS,
    K_IN,
    MLP_IN,
    PATTERN,
    POST_ATTN_IN,
    Q_IN,
    RESID_PRE,
    ROT_K,
    ROT_Q,
    SCORES,
    SIN,
    AttentionFacts,
    BlockLayout,
    HookedModel,
    K,
    ModelShape,
    Q,
    V,
    Z,
    attention_facts,
    attention_scale,
    attention_softcap,
    block_layout,
    check_layer_list,
    check_layers,
    check_model,
    key_hook_name,
    model_shape,
    output_softcap,
    query_hook_name,
    recompute_tolerance,
)

# Liveness of hook_pattern lives in ra_lens.liveness; its names stay importable from here.
from ra_lens.liveness import (  # noqa: E402, F401
    forget_probe,
    live_attention,
    live_pattern_layers,
    require_live_patterns,
)

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


@contextlib.contextmanager
def preserved_state(model: HookedModel) -> Iterator[None]:
    """Run in eval mode; afterwards restore mode, requires_grad flags and every .grad as found.

    Eval mode reaches every module that takes part (`model_modules`: a bridge's HuggingFace
    modules included), so dropout never makes a result random; each module gets its own mode
    back.

    Also claims the model for this thread (`exclusive`), makes `hook_pattern` live on adapters
    that delegate attention to HuggingFace (`live_attention`), and refuses inference mode, where
    autograd cannot run.

    >>> _ = model.train()
    >>> with preserved_state(model):
    ...     model.training
    False
    >>> model.training
    True
    """
    require_autograd()
    with exclusive(model), _restored(model), live_attention(model):
        yield


def require_autograd() -> None:
    """Refuse to run inside torch.inference_mode(), where no graph can be built."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "ra-lens needs autograd, and this call runs inside torch.inference_mode(): call it "
            "outside that block (torch.no_grad() around it is fine: ra-lens re-enables grad)"
        )


@contextlib.contextmanager
def _restored(model: HookedModel) -> Iterator[None]:
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    try:
        with _eval_mode(model):
            yield
    finally:
        for p, flag, grad in zip(params, flags, grads):
            p.requires_grad_(flag)
            p.grad = grad


@contextlib.contextmanager
def eval_mode(model: HookedModel) -> Iterator[None]:
    """Run every module that takes part in eval mode (`model_modules`), for forward passes that
    need no autograd; afterwards each module gets its own mode back. Claims the model for this
    thread (`exclusive`) and makes `hook_pattern` live where the adapter delegates attention
    (`live_attention`), so head ablation and patching hooks reach the output.

    >>> _ = model.train()
    >>> with eval_mode(model):
    ...     any(m.training for m in model_modules(model))
    False
    >>> model.training
    True
    """
    with exclusive(model), _eval_mode(model), live_attention(model):
        yield


@contextlib.contextmanager
def _eval_mode(model: HookedModel) -> Iterator[None]:
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
def raw_input_hooks(
    model: HookedModel,
    forward: dict[str, Callable[[Tensor], None]],
    backward: dict[str, Callable[[Tensor], None]],
) -> Iterator[None]:
    """See what reaches a HookPoint before any TransformerLens hook on it (a user's edit
    included) runs: `forward[name](x)` gets its input, `backward[name](grad)` the total gradient
    of the loss with respect to that input, whatever the hooks after it do with it.

    PyTorch forward pre-hooks run before every forward hook, and a tensor hook on the input
    accumulates the gradient of all its uses. Both see the tensor in TransformerLens's layout
    (a bridge's `hook_conversion` is applied). A gradient that never arrives (a user hook
    replaced the tensor) means the gradient is zero. Removed on exit.

    The forward hook sees the softmax output even when a user's hook zeroes the pattern:

    >>> seen, name = {}, PATTERN.format(0)
    >>> with raw_input_hooks(model, {name: lambda a: seen.setdefault(name, a)}, {}):
    ...     with model.hooks(fwd_hooks=[(name, lambda a, hook: a * 0)]):
    ...         _ = model(model.to_tokens("Q: hot"))
    >>> torch.allclose(seen[name].sum(-1), torch.ones(1, 4, 7))  # rows of A sum to one
    True
    """
    handles = []
    points = model.hook_dict  # a bridge builds this dict afresh on every access: read it once

    def pre_hook(name: str) -> Callable[[Any, tuple[Any, ...]], None]:
        point = points[name]

        def hook(module: Any, args: tuple[Any, ...]) -> None:
            raw = args[0]
            conversion = getattr(point, "hook_conversion", None)
            convert = conversion.convert if conversion is not None else (lambda t: t)
            if name in forward:
                forward[name](convert(raw))
            if name in backward and raw.requires_grad:
                raw.register_hook(lambda grad: backward[name](convert(grad)))

        return hook

    try:
        for name in dict.fromkeys([*forward, *backward]):
            handles.append(points[name].register_forward_pre_hook(pre_hook(name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


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
        def hook(value: Tensor, hook: Any) -> None:
            if name not in store:
                store[name] = value.detach().clone()

        return hook

    points = model.hook_dict  # built afresh on every access by a bridge
    present = [name for name in dict.fromkeys(names) if name in points]
    hooks = [(name, keep(name)) for name in present]
    with model.hooks(**{"bwd_hooks" if grad else "fwd_hooks": hooks}):
        yield store


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
    from ra_lens.math import rotate_half

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


def _device(model: HookedModel) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class Batch:
    """Right-padded token ids and each prompt's real length.

    >>> batch = to_batch(model, ["I like Italy", "Q: hot"])  # 8 and 7 tokens
    >>> batch.lengths.tolist(), batch.padded, batch.real_mask().sum(1).tolist()
    ([8, 7], True, [8, 7])
    """

    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, "batch"]

    @property
    def padded(self) -> bool:
        return bool((self.lengths < self.tokens.shape[1]).any())

    def real_mask(self) -> Bool[Tensor, "batch pos"]:
        """True at each prompt's real (non-pad) positions.

        >>> to_batch(model, ["Q: big", "Q: hot"]).real_mask()  # 6 and 7 tokens
        tensor([[ True,  True,  True,  True,  True,  True, False],
                [ True,  True,  True,  True,  True,  True,  True]])
        """
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return positions[None, :] < self.lengths.to(self.tokens.device)[:, None]

    def rows(self, rows: slice, *, trim: bool = False) -> Batch:
        """Prompts `rows` of the batch, the one way every batched loop cuts a batch.

        Kept at full padded width by default, so a metric that holds token tensors of the whole
        batch (`ra_lens.metrics.completion`) still lines up; `trim=True` cuts the padding columns
        none of these prompts needs (the rankings, where each chunk runs at its own length).

        >>> batch = to_batch(model, ["I like Italy", "Q: hot", "Q: big"])  # 8, 7 and 6 tokens
        >>> batch.rows(slice(1, 3)).tokens.shape, batch.rows(slice(1, 3), trim=True).tokens.shape
        (torch.Size([2, 8]), torch.Size([2, 7]))
        """
        if not isinstance(rows, slice):
            raise TypeError(f"rows must be a slice of prompts, not {type(rows).__name__}")
        if not range(self.tokens.shape[0])[rows]:
            raise IndexError(f"prompts {rows} of a batch of {self.tokens.shape[0]}: none selected")
        lengths = self.lengths[rows]
        width = int(lengths.max()) if trim else self.tokens.shape[1]
        return Batch(self.tokens[rows, :width], lengths)


def to_batch(
    model: HookedModel,
    tokens: Validated[Batch | Tensor | str | Sequence[str]],
    *,
    prepend_bos: bool | None = None,
) -> Batch:
    """Tokenise strings with the model's tokenizer (right padding) or check a token tensor.

    Right padding keeps every real position exactly where it is unpadded, so causal attention
    never lets a real token see a pad: RA of a padded batch equals RA of each prompt alone.

    >>> batch = to_batch(model, ["Q: big", "Q: hot"])
    >>> batch.tokens.tolist()  # "Q: big" padded with the tokenizer's pad id (2)
    [[0, 51, 28, 288, 75, 73, 2], [0, 51, 28, 223, 74, 81, 86]]
    >>> to_batch(model, "x " * 100)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: 201 tokens exceed the model's context of n_ctx=64: ...
    """
    shape = check_model(model)  # a model that cannot run is refused before anything runs it
    if isinstance(tokens, str):
        tokens = [tokens]
    if isinstance(tokens, Batch):
        ids, lengths = tokens.tokens, tokens.lengths
        _check_batch(ids, lengths)
    elif isinstance(tokens, Tensor):
        if tokens.ndim not in (1, 2):
            raise ValueError(
                f"tokens must be Int[Tensor, 'batch pos'] (or one prompt's 'pos'), got shape "
                f"{tuple(tokens.shape)}: pass model.to_tokens(prompts)"
            )
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
        # truncate=False: TransformerLens cuts long text to n_ctx by default, silently; the
        # check below says so instead.
        rows = [model.to_tokens(p, prepend_bos=prepend_bos, truncate=False)[0] for p in prompts]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        pad = _pad_id(model)
        ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"empty batch: tokens have shape {tuple(ids.shape)}")
    if shape.n_ctx is not None and ids.shape[1] > shape.n_ctx:
        raise ValueError(
            f"{ids.shape[1]} tokens exceed the model's context of n_ctx={shape.n_ctx}: shorten "
            f"the prompts to at most {shape.n_ctx} tokens (nothing is cut silently)"
        )
    check_token_ids(model, ids)
    return Batch(ids.to(_device(model)), lengths.to(_device(model)))


def _check_batch(ids: Tensor, lengths: Tensor) -> None:
    if ids.ndim != 2 or lengths.ndim != 1 or lengths.shape[0] != ids.shape[0]:
        raise ValueError(
            f"a Batch needs tokens [batch, pos] and one length per prompt, got tokens "
            f"{tuple(ids.shape)} and lengths {tuple(lengths.shape)}: build it with ra_lens.to_batch"
        )
    if bool(((lengths < 1) | (lengths > ids.shape[1])).any()):
        raise ValueError(
            f"Batch lengths {lengths.tolist()} must lie in 1..{ids.shape[1]} (the padded token "
            "length): build it with ra_lens.to_batch"
        )


def check_token_ids(model: HookedModel, ids: Tensor) -> None:
    """Raise a ValueError naming the vocabulary size for ids outside it (the embedding would
    otherwise fail with 'index out of range in self').

    >>> check_token_ids(model, torch.tensor([[0, 299]]))  # the tiny model has 300 tokens
    >>> check_token_ids(model, torch.tensor([[0, 300]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: token ids must lie in 0..299 (the model's vocabulary), got ids from 0 to 300: ...
    """
    vocab = getattr(model.cfg, "d_vocab", None)
    if vocab is None or ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= int(vocab):
        raise ValueError(
            f"token ids must lie in 0..{int(vocab) - 1} (the model's vocabulary), got ids from "
            f"{low} to {high}: tokenise with this model's tokenizer (model.to_tokens)"
        )


def str_tokens(model: HookedModel, batch: Batch) -> list[list[str]] | None:
    """Each prompt's tokens as text, cut to its real length; None without a tokenizer.

    >>> str_tokens(model, to_batch(model, ["Q: big", "Q: hot"]))
    [['<|endoftext|>', 'Q', ':', ' b', 'i', 'g'], ['<|endoftext|>', 'Q', ':', ' ', 'h', 'o', 't']]
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    return [
        [tokenizer.decode([t]) for t in row[: int(n)].tolist()]
        for row, n in zip(batch.tokens.cpu(), batch.lengths.cpu())
    ]


def _pad_id(model: HookedModel) -> int:
    tokenizer = getattr(model, "tokenizer", None)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0
