"""The seam between nnsight models and ra-lens's model contract.

An nnsight model (`nnsight.TransformersModel`, or `LanguageModel`, its deprecated alias) wraps a
HuggingFace causal LM. Each layer's attention module is found by what it is (the child of each
decoder block whose class is an attention module); under eager attention it returns
(output, weights), and `weights` is the softmax output A, Float[Tensor, "batch head query key"],
checked once per model on a probe prompt (shape, rows summing to one). The softmax call itself
(needed to edit A before it meets the values, and to read soft-capped scores) is found among the
attention forward's operations by what its output is, never by its label: the labels move between
nnsight and transformers releases.

The per-architecture facts (scale, soft-cap) are the contract's own readers of HuggingFace
attention modules (`contract.hf_attention_scale`, `contract.hf_attention_softcap`), the ones
`attention_scale` / `attention_softcap` apply to a TransformerBridge's modules.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from ra_lens import contract

#: What the probe found, per wrapped HuggingFace model (dropped with the model).
FOUND: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


@runtime_checkable
class NnsightModel(Protocol):
    """What ra-lens needs of an nnsight model: an Envoy that traces (0.8's `TransformersModel`,
    or `LanguageModel`) wrapping a HuggingFace causal LM, with its tokenizer where strings are
    given. The nnsight counterpart of `contract.HookedModel`."""

    def trace(self, *args: Any, **kwargs: Any) -> Any: ...


def is_nnsight_model(model: object) -> bool:
    """True for an nnsight model (an Envoy wrapping a module), without importing nnsight."""
    return any(
        c.__module__.startswith("nnsight.") and c.__name__ == "Envoy" for c in type(model).__mro__
    )


def as_nnsight(model: object) -> NnsightModel | None:
    """The model, typed as an nnsight model, if it is one (`is_nnsight_model`); else None."""
    return cast(NnsightModel, model) if is_nnsight_model(model) else None


@dataclass
class Layout:
    """Where a wrapped HuggingFace model keeps what RA needs.

    attention_paths: per layer, the dotted path of its attention module from the root.
    embed_path: the input embedding module's path.
    softmax_path: the softmax call, from an attention module (e.g.
        "source.attention_interface_1.source.nn_functional_softmax_0"), or None until needed.
    """

    attention_paths: list[str]
    embed_path: str
    softmax_path: str | None = None


def hf_module(model: NnsightModel) -> nn.Module:
    """The HuggingFace model inside an nnsight model."""
    inner = getattr(model, "_module", None)
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise TypeError(
            f"{type(model).__name__} does not wrap a HuggingFace model: ra-lens reads nnsight "
            "models built as nnsight.TransformersModel(hf_model, tokenizer=...)"
        )
    return inner


def layout(model: NnsightModel) -> Layout:
    """The model's `Layout` (paths checked against eager attention), found once per model.

    Raises:
        ValueError: attention other than eager (SDPA, flash), which returns no weights.
        TypeError: no decoder block list or no attention module in a block.
    """
    hf: Any = hf_module(model)  # a HuggingFace model: config, get_input_embeddings()
    implementation = getattr(hf.config, "_attn_implementation", None)
    if implementation != "eager":
        raise ValueError(
            f"the model runs {implementation!r} attention, which returns no attention weights: "
            'load it with attn_implementation="eager" (e.g. AutoModelForCausalLM.'
            'from_pretrained(name, attn_implementation="eager")) before wrapping it in nnsight'
        )
    if hf in FOUND:
        return FOUND[hf]
    names = {module: name for name, module in hf.named_modules()}
    blocks = _decoder_blocks(hf)
    paths = []
    for i, block in enumerate(blocks):
        attn = _attention_children(block)
        if len(attn) != 1:
            raise TypeError(
                f"block {i} ({type(block).__name__}) has {len(attn)} attention modules: ra-lens "
                "reads one self-attention module per decoder block"
            )
        # A wrapper holding one attention module (GPT-Neo's GPTNeoAttention): the inner one
        # computes the scores and carries their scale.
        while len(_attention_children(attn[0])) == 1:
            attn = _attention_children(attn[0])
        paths.append(names[attn[0]])
    found = Layout(paths, names[hf.get_input_embeddings()])
    FOUND[hf] = found
    return found


def _attention_children(module: nn.Module) -> list[nn.Module]:
    return [c for c in module.children() if type(c).__name__.endswith("Attention")]


def _decoder_blocks(hf: Any) -> nn.ModuleList:  # a HuggingFace model (reads hf.config)
    n = hf.config.num_hidden_layers
    lists = [m for m in hf.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise TypeError(
            f"found no list of {n} decoder blocks in {type(hf).__name__}: ra-lens reads "
            "HuggingFace causal LMs whose blocks sit in one nn.ModuleList"
        )
    return lists[0]


def scale_and_softcap(model: NnsightModel, path: str) -> tuple[float, float | None]:
    """The contract's attention scale s and soft-cap c of the attention module at `path`."""
    attn = hf_module(model).get_submodule(path)
    layer = layout(model).attention_paths.index(path)
    return contract.hf_attention_scale(attn, layer), contract.hf_attention_softcap(attn)


def resolve(root: Any, path: str) -> Any:
    """root.a.b.3.c: attributes, digits indexing module lists."""
    node = root
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@contextlib.contextmanager
def preserved(model: NnsightModel) -> Iterator[None]:
    """Eval mode, parameters frozen for the call (so no .grad accumulates); afterwards every
    module's mode, every requires_grad flag and every .grad restored as found."""
    hf = hf_module(model)
    modes = [(m, m.training) for m in hf.modules()]
    params = list(hf.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "ra-lens needs autograd, and this call runs inside torch.inference_mode(): call it "
            "outside that block"
        )
    try:
        hf.eval()
        for p in params:
            p.requires_grad_(False)
        with torch.enable_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        for p, flag, grad in zip(params, flags, grads):
            p.requires_grad_(flag)
            p.grad = grad


def softmax_path(model: NnsightModel) -> str:
    """The softmax call inside each attention module, found by what its output is, once per
    model: among the operations of the first layer's attention forward, the last one whose
    output holds the module's weights is the attention call (none: the forward computes
    attention itself); inside it, the first operation whose output is a [batch, head, query,
    key] tensor of non-negative rows summing to one is the softmax. Then checked on every layer.

    Raises:
        TypeError: no such operation (nnsight cannot trace this attention's source).
    """
    found = layout(model)
    if found.softmax_path is not None:
        return found.softmax_path
    probe = torch.tensor([[1, 2, 3, 4]], device=input_device(model))
    first = resolve(model, found.attention_paths[0])
    try:
        names = list(first.source.names)
    except Exception as error:  # nnsight's SourceNotAvailable and the like
        raise TypeError(f"nnsight cannot trace the attention's source: {error}") from error
    weights = _probe(model, probe, [lambda: first.output[1]])[0]
    call = next(
        (n for n in reversed(names) if _holds(_probe_op(model, probe, first, n), weights)), None
    )
    if call is None:  # the softmax sits in the forward itself (BLOOM)
        inner, prefix = names, "source"
    else:
        inner = _probe(model, probe, [lambda: list(getattr(first.source, call).source.names)])[0]
        prefix = f"source.{call}.source"
    for name in inner:
        path = f"{prefix}.{name}"
        if _is_softmax(_probe_op(model, probe, first, path), weights):
            _check_every_layer(model, probe, path)
            found.softmax_path = path
            return path
    raise TypeError(_NOT_FOUND)


_NOT_FOUND = (
    "found no softmax call inside the attention forward whose output is the attention weights: "
    "ra-lens reads HuggingFace attention modules whose eager path calls a softmax"
)


def input_device(model: NnsightModel) -> torch.device:
    """Where the model's inputs go: the device of its first weight."""
    return next(hf_module(model).parameters()).device


def _probe(model: NnsightModel, tokens: torch.Tensor, readers: list[Any]) -> list[Any]:
    """Run one trace and return each reader's value (readers run in forward order)."""
    # Filled in place: nnsight hands back only what the body saves or mutates outside itself.
    kept: list[Any] = []
    with torch.no_grad(), model.trace(tokens):
        for reader in readers:
            kept.append(reader())
    return kept


def _probe_op(model: NnsightModel, tokens: torch.Tensor, attn: Any, path: str) -> Any:
    """The output of one operation of the attention forward, or None where it does not run."""
    full = path if path.startswith("source.") else f"source.{path}"
    try:  # resolved inside the trace: nested `.source` exists only there
        return _probe(model, tokens, [lambda: resolve(attn, full).output])[0]
    except Exception:  # the operation did not run on this path (a branch not taken)
        return None


def _holds(value: Any, weights: torch.Tensor) -> bool:
    return isinstance(value, tuple) and any(
        isinstance(v, torch.Tensor) and v.shape == weights.shape and torch.equal(v, weights)
        for v in value
    )


def _is_softmax(value: Any, weights: torch.Tensor) -> bool:
    if not isinstance(value, torch.Tensor) or value.shape != weights.shape:
        return False
    rows = value.double().sum(-1)
    return bool((value >= 0).all()) and torch.allclose(rows, torch.ones_like(rows), atol=1e-3)


def _check_every_layer(model: NnsightModel, tokens: torch.Tensor, path: str) -> None:
    attns = [resolve(model, p) for p in layout(model).attention_paths]
    readers = []
    for attn in attns:
        readers += [lambda a=attn: resolve(a, path).output, lambda a=attn: a.output[1]]
    got = _probe(model, tokens, readers)
    for i in range(len(attns)):
        if not torch.equal(got[2 * i].to(got[2 * i + 1].dtype), got[2 * i + 1]):
            raise TypeError(f"layer {i}: {_NOT_FOUND}")
