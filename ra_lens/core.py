"""reversed_attention: RA of every head from one forward and one backward pass.

Hooks read the forward pattern A and the gradient R = dL/dA on the raw input of `hook_pattern`
(before any user hook edits it); the softmax VJP turns R into RA inside the gradient hook, layer by
layer, so with keep="norms" no map outlives its hook. Where `hook_pattern` is not in the autograd graph (OPT-style adapters), R is rebuilt from
the gradient at `hook_z` and the values at `hook_v` instead: R = G V^T.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, RESID_PRE, SCORES, Batch, HookedModel, V, Z
from ra_lens.checks import check_ra_options
from ra_lens.layerwise import layerwise_backward
from ra_lens.math import (
    Convention,
    convert,
    frobenius_norms,
    pattern_grad_from_z,
    softcap_slope,
    upcast,
)
from ra_lens.metrics import call_metric
from ra_lens.result import ReversedAttention, stack_layers
from ra_lens.types import MetricFn

Keep = Literal["maps", "norms", "rows"]
Memory = Literal["full", "layerwise"]
RawHook = Callable[[Tensor], None]


def reversed_attention(
    model: Validated[HookedModel],
    tokens: Validated[Int[Tensor, "batch pos"] | Batch | str | Sequence[str]],
    metric: MetricFn,
    *,
    layers: Validated[Sequence[int]] | None = None,
    keep: Validated[Keep] = "maps",
    convention: Validated[Convention] = "qk",
    memory: Validated[Memory] = "full",
    rows_at: Validated[Int[Tensor, "batch"]] | None = None,
    remote: bool | str = False,
) -> ReversedAttention:
    """Reversed Attention dL/d(QK^T) of every head, for each prompt's own metric.

    Args:
        model: a TransformerLens model (TransformerBridge or HookedTransformer).
        tokens: Int[Tensor, "batch pos"], a Batch, a string or a list of strings (tokenised with
            the model's tokenizer, right-padded).
        metric: logits Float[Tensor, "batch pos vocab"] -> Float[Tensor, "batch"] (one value per
            prompt; summed before the single backward pass, so maps[i] is the RA of prompt i's own
            metric) or a scalar (differentiated as is). If it accepts `lengths`, it receives each
            prompt's real length (all of `ra_lens.metrics` do).
        layers: layers to compute (default all); the backward pass stops at the first of them.
        keep: "maps" keeps maps and patterns; "norms" keeps only per-head norms (memory
            O(layer x head) rather than O(batch x layer x head x pos^2)); "rows" keeps the norms
            and each prompt's RA row at its loss position, `ra.rows` (O(batch x layer x head x
            pos)).
        convention: "qk" (the paper's RA), "scores" (dL/d pre-softmax scores = s * RA) or
            "pattern" (dL/dA, masked to the causal triangle).
        memory: "full" keeps the whole autograd graph (one forward + one backward); "layerwise"
            runs the forward without autograd, then recomputes one block at a time from the last
            down (about one forward more; peak memory one block's attention instead of every
            layer's). Same result; see `ra_lens.layerwise`.
        rows_at: with keep="rows", the query position of each prompt's row, Int[Tensor, "batch"]
            (default: each prompt's last real position, where the ra_lens.metrics read by default).
        remote: nnsight models only: False runs the trace here; True sends it to NDIF as one
            request reduced on the server; "local" runs that request offline in a fresh process
            that cannot import ra_lens (see `ra_lens.nnsight.remote`).

    Also takes an nnsight model (`nnsight.TransformersModel` wrapping a HuggingFace causal LM
    with attn_implementation="eager"): the same result, read through nnsight (memory="full").

    Returns:
        ReversedAttention with maps Float[Tensor, "batch layer head query key"] (CPU, float32).

    Examples (`model`: a tiny random 2-layer x 4-head model, `ra_lens.toy_models.tiny_model`):

    >>> from ra_lens.metrics import target_nll
    >>> ra = reversed_attention(model, ["I like Italy and France", "Q: hot"], target_nll([5, 7]))
    >>> ra.maps.shape  # [batch layer head query key], right-padded to the longer prompt
    torch.Size([2, 2, 4, 11, 11])
    >>> torch.allclose(ra.maps.sum(-1), torch.zeros(()), atol=1e-6)  # every row sums to zero
    True

    convention="scores" is autograd's gradient at `hook_attn_scores` (the "qk" maps are it / s):

    >>> tokens, metric = model.to_tokens("I like Italy"), target_nll([5])
    >>> ra = reversed_attention(model, tokens, metric, convention="scores")
    >>> name, kept = capture.SCORES.format(1), {}
    >>> with model.hooks(fwd_hooks=[(name, lambda x, hook: kept.setdefault(name, x))]):
    ...     (grad,) = torch.autograd.grad(metric(model(tokens)).sum(), kept[name])
    >>> torch.allclose(ra.maps[:, 1], grad, atol=1e-6)
    True
    """
    from ra_lens.nnsight.adapter import as_nnsight

    nnsight_model = as_nnsight(model)
    if nnsight_model is not None:
        if memory != "full":
            raise ValueError(
                "nnsight models run memory='full' only (nnsight cannot re-run one block): drop "
                "memory=; docs/nnsight_memory.md gives the peak memory and the longest prompt "
                "that fits"
            )
        from ra_lens.nnsight.route import reversed_attention as through_nnsight

        return through_nnsight(
            nnsight_model, tokens, metric, layers=layers, keep=keep, convention=convention,
            rows_at=rows_at, remote=remote,
        )  # fmt: skip
    if remote is not False:
        raise ValueError("remote= is for nnsight models: this is a TransformerLens model")
    check_ra_options(keep, convention, rows_at)
    if memory not in ("full", "layerwise"):
        raise ValueError(f"unknown memory {memory!r}: choose 'full' or 'layerwise'")
    shape = capture.model_shape(model)
    chosen = capture.check_layers(layers, shape.n_layers)
    batch = capture.to_batch(model, tokens)
    live = capture.live_pattern_layers(model)
    routes = ["pattern" if live[layer] else "z" for layer in chosen]
    if "z" in routes:
        _check_z_route(model, [layer for layer, r in zip(chosen, routes) if r == "z"])
    scales = [capture.attention_scale(model, layer) for layer in chosen]
    caps = [capture.attention_softcap(model, layer) for layer in chosen]

    collector = _Collector(batch, chosen, routes, scales, convention, keep, rows_at, caps)
    if memory == "layerwise":
        with capture.preserved_state(model):
            values = layerwise_backward(
                model,
                batch.tokens,
                chosen[0],
                lambda logits: metric_loss(metric, logits, batch),
                lambda: _collecting(model, collector),
            )
        return collector.result(values.detach().float().cpu(), capture.str_tokens(model, batch))
    store: dict[str, Tensor] = {}
    leaf = [(RESID_PRE.format(chosen[0]), capture.gradient_leaf_hook(store))]
    with capture.preserved_state(model), torch.enable_grad():
        with _collecting(model, collector), model.hooks(fwd_hooks=leaf):
            logits = model(batch.tokens)
        # The hooks are off before the metric runs: a metric may run the model itself (e.g.
        # reference logits under no_grad), and that forward must not replace the gradient leaf
        # or the saved patterns. The backward hooks live on this forward's tensors.
        values, loss = metric_loss(metric, logits, batch)
        (leaf_grad,) = torch.autograd.grad(loss, [store["leaf"]], allow_unused=True)
    if leaf_grad is None:
        raise ValueError(
            "the metric does not depend on the attention of the chosen layers "
            "(no gradient path): compute it from the logits the model returns"
        )
    return collector.result(values.detach().float().cpu(), capture.str_tokens(model, batch))


@contextlib.contextmanager
def _collecting(model: HookedModel, collector: _Collector) -> Iterator[None]:
    """The collector's hooks, on for the forward (and backward) passes inside the block."""
    with capture.raw_input_hooks(model, *collector.raw_hooks()):
        with model.hooks(fwd_hooks=collector.fwd_hooks()):
            yield


def _check_z_route(model: HookedModel, layers: list[int]) -> None:
    points = model.hook_dict  # built afresh on every access by a bridge
    missing = [n.format(la) for la in layers for n in (Z, V) if n.format(la) not in points]
    if missing:
        raise RuntimeError(
            f"hook_pattern is not in the autograd graph of layers {layers} and the hook_z/hook_v "
            f"route is unavailable (missing {missing[:2]}): this adapter cannot give Reversed "
            "Attention; boot the model with an adapter that computes attention itself"
        )


def metric_loss(metric: MetricFn, logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """(per-prompt values, the scalar to differentiate): the metric checked and summed."""
    values = call_metric(metric, logits, batch)
    return values, _to_loss(values, batch)


def _to_loss(values: Any, batch: Batch) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(f"the metric returned {type(values).__name__}: it must return a tensor")
    n = batch.tokens.shape[0]
    if values.ndim > 1 or (values.ndim == 1 and values.shape[0] != n):
        raise ValueError(
            f"the metric returned shape {tuple(values.shape)}: it must return one value per "
            f"prompt, Float[Tensor, '{n}'], or a scalar"
        )
    if not bool(torch.isfinite(values.detach()).all()):
        raise ValueError(
            f"the metric returned non-finite values {values.detach().flatten()[:8].tolist()}: RA "
            "of a NaN or infinite loss is meaningless; check the targets and the logits (e.g. "
            "log of a zero probability: use target_nll rather than log(target_prob))"
        )
    if not values.requires_grad:
        raise ValueError(
            "the metric's value has no gradient path to the model: compute it from the logits "
            "without .detach(), .item() or torch.no_grad()"
        )
    return values.sum()


class _Collector:
    """Hook functions and per-layer storage for one reversed_attention call."""

    def __init__(
        self,
        batch: Batch,
        layers: list[int],
        routes: list[str],
        scales: list[float],
        convention: Convention,
        keep: Keep,
        rows_at: Tensor | None = None,
        caps: list[float | None] | None = None,
    ):
        self.batch, self.layers, self.routes, self.scales = batch, layers, routes, scales
        # Soft-capped layers (Gemma-2): "qk" needs the capped scores for the tanh's slope.
        self.caps = caps if caps is not None else [None] * len(layers)
        self.capped_scores: dict[int, Tensor] = {}
        self.convention, self.keep = convention, keep
        # keep="rows": the query position of each prompt's row (its loss position).
        self.row_positions = batch.row_positions(rows_at) if keep == "rows" else None
        self.rows: dict[int, Tensor] = {}
        self.patterns: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.norms: dict[int, Tensor] = {}
        self.pattern_norms: dict[int, Tensor] = {}
        self.finished: set[int] = set()
        # keep="maps": filled layer by layer, allocated at the first layer's backward hook;
        # stacking per-layer maps at the end would copy every map once more.
        self.maps: Tensor | None = None
        # keep="norms"/"rows": the one map every layer's RA is written into (see _slot).
        self.scratch: Tensor | None = None
        # keep="maps": each layer's forward pattern as the result will hold it (see _finish).
        self.kept_patterns: dict[int, Tensor] = {}
        # Real (non-pad) positions; RA at pads is zero by causality, the mask makes it exact.
        self.real: Tensor | None = batch.real_mask() if batch.padded else None

    def fwd_hooks(self) -> list[tuple[str, Callable[..., Any]]]:
        """TransformerLens hooks, run after any user hook: the values z was computed from."""
        return [
            (V.format(layer), self._save_values(layer))
            for layer, route in zip(self.layers, self.routes)
            if route == "z"
        ]

    def raw_hooks(self) -> tuple[dict[str, RawHook], dict[str, RawHook]]:
        """(forward, backward) hooks on the raw inputs of hook_pattern (and hook_z on the z
        route), before any user hook edits them. The gradient is read on those raw tensors, so
        it is the true dL/dA of the softmax output (through whatever a user's hook does to it),
        and the softmax VJP is taken at the softmax output, never at an edited pattern."""
        forward: dict[str, RawHook] = {}
        backward: dict[str, RawHook] = {}
        for layer, route, cap in zip(self.layers, self.routes, self.caps):
            forward[PATTERN.format(layer)] = self._save_pattern(layer)
            if cap is not None and self.convention == "qk":
                forward[SCORES.format(layer)] = partial(self.capped_scores.__setitem__, layer)
            if route == "pattern":
                backward[PATTERN.format(layer)] = partial(self._finish, layer)
            else:
                backward[Z.format(layer)] = self._from_z_grad(layer)
        return forward, backward

    def _save_pattern(self, layer: int) -> RawHook:
        def hook(pattern: Tensor) -> None:
            # A reference, not a copy: autograd keeps the same tensor alive anyway.
            self.patterns[layer] = pattern.detach()

        return hook

    def _from_z_grad(self, layer: int) -> RawHook:
        def hook(grad: Tensor) -> None:
            self._finish(layer, pattern_grad_from_z(grad, self.values.pop(layer)))

        return hook

    def _save_values(self, layer: int) -> Callable[[Tensor, Any], None]:
        def hook(values: Tensor, hook: Any) -> None:
            self.values[layer] = values.detach()

        return hook

    def _finish(self, layer: int, pattern_grad: Tensor) -> None:
        pattern = self.patterns.pop(layer)
        self.finished.add(layer)
        i = self.layers.index(layer)
        slot = self._slot(i, pattern)
        cap, slope = self.caps[i], None
        if cap is not None and self.convention == "qk":
            slope = softcap_slope(self.capped_scores.pop(layer).detach(), cap)
        maps = convert(
            pattern, pattern_grad, self.convention, self.scales[i], out=slot, slope=slope
        )
        pattern = upcast(pattern)
        if self.real is not None:
            # .to: on a model split across devices, this layer may sit elsewhere than the tokens.
            real = self.real.to(maps.device)
            keep = real[:, None, :, None] & real[:, None, None, :]
            maps = maps * keep
            pattern = pattern * keep
        # Left on the layer's device until `result`: a copy to the CPU here would make the GPU
        # wait for it twice per layer inside the backward pass.
        self.norms[layer] = frobenius_norms(maps).to(torch.float32)
        self.pattern_norms[layer] = frobenius_norms(pattern).to(torch.float32)
        if self.row_positions is not None:
            prompts = torch.arange(maps.shape[0], device=maps.device)
            rows = maps[prompts, :, self.row_positions.to(maps.device)]
            self.rows[layer] = rows.to(torch.float32)
        if self.maps is not None:
            if maps is not slot:
                self.maps[:, i].copy_(maps)
            # The forward's own tensor, not a copy (a CPU float32 one where the model runs
            # elsewhere or in half precision): no later forward writes into it, and the result
            # stacks the layers only if `patterns` is read.
            self.kept_patterns[layer] = _whole(pattern.to("cpu", torch.float32))

    def _slot(self, i: int, pattern: Tensor) -> Tensor | None:
        """Where layer i's RA is written. keep="maps": the buffer slice for layer i when RA can
        be written into it directly (CPU, float32), one copy of every map fewer. Otherwise one
        scratch map that every layer reuses (its norms and rows are taken before the next
        layer's hook runs): at long lengths a fresh map per layer costs more in page faults than
        the arithmetic."""
        if self.keep != "maps":
            if self.convention == "pattern":  # not written by softmax_vjp
                return None
            dtype = upcast(pattern).dtype
            if self.scratch is None or (self.scratch.shape, self.scratch.dtype, self.scratch.device) != (pattern.shape, dtype, pattern.device):  # fmt: skip
                self.scratch = torch.empty(pattern.shape, dtype=dtype, device=pattern.device)
            return self.scratch
        if self.maps is None:
            shape = (pattern.shape[0], len(self.layers), *pattern.shape[1:])
            self.maps = torch.empty(shape, dtype=torch.float32)
        direct = (
            pattern.device.type == "cpu"
            and upcast(pattern).dtype == torch.float32
            and self.convention != "pattern"
        )
        return self.maps[:, i] if direct else None

    def result(
        self, metric_values: Tensor, str_tokens: list[list[str]] | None
    ) -> ReversedAttention:
        for layer in self.layers:
            if layer not in self.finished and layer in self.patterns:
                # The forward pass ran but no gradient reached this raw pattern: a user hook
                # replaced it (e.g. a constant pattern), so dL/dA, hence RA, is exactly zero.
                self._finish(layer, torch.zeros_like(self.patterns[layer]))
        missing = [layer for layer in self.layers if layer not in self.norms]
        if missing:
            raise RuntimeError(
                f"no gradient reached the attention of layers {missing}: the metric must depend "
                "on the logits at positions these layers feed"
            )
        patterns = [self.kept_patterns[la] for la in self.layers] if self.maps is not None else None
        return ReversedAttention(
            norms=_stacked_on_cpu(self.norms, self.layers),
            pattern_norms=_stacked_on_cpu(self.pattern_norms, self.layers),
            tokens=self.batch.tokens.cpu(),
            lengths=self.batch.lengths.cpu(),
            metric_values=metric_values,
            layers=list(self.layers),
            convention=self.convention,
            scales=list(self.scales),
            routes=list(self.routes),
            maps=self.maps,
            patterns=patterns,
            rows=_stacked_on_cpu(self.rows, self.layers) if self.rows else None,
            row_positions=None if self.row_positions is None else self.row_positions.cpu(),
            str_tokens=str_tokens,
        )


def _whole(tensor: Tensor) -> Tensor:
    """`tensor` itself, or a compact copy where it is a view into a larger storage: a result
    that kept the view would keep all of that storage alive."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _stacked_on_cpu(per_layer: dict[int, Tensor], layers: list[int]) -> Tensor:
    """The layers' tensors gathered on the CPU once the backward pass is over (a split model's
    layers sit on several devices)."""
    return stack_layers([per_layer[la].to("cpu") for la in layers])
