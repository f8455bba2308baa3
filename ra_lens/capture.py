"""The model contract: everything ra-lens knows about a model lives here, in `ra_lens.contract`
and in `ra_lens.state`.

Tokenisation, the scoped state of a call (`preserved_state`, `eval_mode`) and raw input hooks
here; hook names and attention geometry in `ra_lens.contract`, the state pieces in
`ra_lens.state` and liveness in `ra_lens.liveness`, all re-exported below. The rest of the package speaks TransformerLens hook names only (those
constants), so any HookedRootModule works (TL 2.x/3.x HookedTransformer, TL 3.x/4.x
TransformerBridge): `HookedModel` says what is used. Nothing here leaves state behind:
`preserved_state` restores train/eval mode, requires_grad flags and parameter .grad; every hook is
scoped by a context manager.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ra_lens._typing import Validated

# The fixed part of the contract lives in ra_lens.contract; every name stays importable from here.
from ra_lens.checks import check_layer_list, check_layers  # noqa: F401
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

# The state a call takes and gives back lives in ra_lens.state; its names stay importable from here.
from ra_lens.state import (  # noqa: E402, F401
    CLAIMS,
    CLAIMS_LOCK,
    exclusive,
    gradient_leaf_hook,
    model_modules,
    modules_in_eval,
    recorded,
    require_autograd,
    restored,
)


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
    with exclusive(model), restored(model), live_attention(model):
        yield


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
    with exclusive(model), modules_in_eval(model), live_attention(model):
        yield


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

    def row_positions(self, rows_at: Tensor | None) -> Int[Tensor, " batch"]:
        """Each prompt's row position for keep="rows" (default: its last real token), checked
        against its real length."""
        if rows_at is None:
            return self.lengths - 1
        given = torch.as_tensor(rows_at)
        if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
            raise TypeError(
                f"rows_at must hold integer positions, got {given.dtype} {given.tolist()}: pass e.g. "
                "torch.tensor([5, 7]) (nothing is rounded silently)"
            )
        positions = given.to(torch.long).reshape(-1).to(self.lengths.device)
        if positions.shape[0] != self.lengths.shape[0] or bool(
            ((positions < 0) | (positions >= self.lengths)).any()
        ):
            raise ValueError(
                f"rows_at {positions.tolist()} must give one position per prompt inside its real "
                f"length {self.lengths.tolist()}"
            )
        return positions


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
