"""edit_dynamics: Reversed Attention predicts how one SGD step on W_q, W_k moves the attention.

Per head, with X the input of the q/k projections (fixed: the step is on one layer only, so
nothing upstream moves), Q = rot(X W_q + b_q), K = rot(X W_k + b_k) and Z = Q K^T:

    dL/dQ = RA K,   dL/dK = RA^T Q                      (RA = dL/dZ, the "qk" convention)
    dL/dW_q = sum_batch X^T rot^T(dL/dQ),   dL/db_q = sum_batch,pos rot^T(dL/dQ)   (same for k)
    after W <- W - lr dL/dW:   dQ = rot(-lr (X dL/dW_q + dL/db_q)),   dK likewise
    dZ = dQ K^T + Q dK^T  (first order, predicted)  +  dQ dK^T  (second order)

`rot` is the rotary embedding (the identity without one), linear per position; its transpose
carries gradients back through it. With grouped-query attention a key head's gradient is the sum
over the query heads that read it, and the weights' gradients sum over the batch. The prediction
uses only RA and the forward activations; the actual change comes from a real SGD step (autograd
gradient) on a deep copy of the model, one layer at a time; RA is computed on that copy too, so
the model itself is only read (deep-copied), never modified.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ra_lens import attention, capture, contract
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, Batch, HookedModel
from ra_lens.core import MetricFn, metric_loss, reversed_attention
from ra_lens.math import causal_mask, softcap_slope
from ra_lens.record import Recorded, json_ready

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SUPPORTED = (
    "TransformerBridge models whose attention has separate q/k nn.Linear projections feeding "
    "softmax(c tanh(QK^T / (s c)) + mask), optionally with rotate-half rotary embeddings, "
    "grouped-query attention, sliding windows and an attention soft-cap c: GPT-2, OPT, "
    "Llama-style (Llama, SmolLM2, Mistral, Qwen2), Gemma, Gemma-2 and boot_native models; not "
    "HookedTransformer, joint qkv projections (GPT-NeoX, Phi, Falcon), q/k norms (Qwen3, "
    "Gemma-3, OLMo-2)"
)


@dataclass
class EditDynamics(Recorded):
    """Predicted (from RA) versus actual change of every head's attention after one SGD step.

    Each chosen layer is stepped alone: W_q, W_k (and q/k biases) of that layer only, by
    `lr` times the gradient of the loss (the sum over prompts of the metric).

    Attributes:
        predicted: Float[Tensor, "batch layer head query key"], first-order change of the
            logits Z = QK^T predicted from RA; zero outside the causal triangle and pads.
        actual: Float[Tensor, "batch layer head query key"], the change after the real step.
        second_order: Float[Tensor, "batch layer head query key"], the exact remaining term
            dQ dK^T, so predicted + second_order equals actual up to rounding.
        predicted_pattern: Float[Tensor, "batch layer head query key"], first-order change of
            the attention pattern: the softmax Jacobian applied to predicted / scale.
        actual_pattern: Float[Tensor, "batch layer head query key"], the real pattern change,
            softmax(Z / s) after minus before in the model's dtype (checked against
            hook_pattern, which HF-style bridges round to float32).
        grad_error: Float[Tensor, "layer"], relative difference between the RA-derived
            gradient of (W_q, b_q, W_k, b_k) and autograd's: float rounding when RA is exact.
        lengths: Int[Tensor, "batch"], each prompt's real length.
        layers: the layer index of each position on the layer axis.
        lr: the SGD step size.
        scales: the attention scale s of each layer (S = Z / s).

    With `model` a tiny random GPT-2 bridge (`ra_lens.toy_models.tiny_model`) and a large step,
    the first-order prediction is off by the second-order term, and adding it is exact:

    >>> from ra_lens.metrics import target_nll
    >>> dyn = edit_dynamics(model, "The capital of France is", target_nll([294]), lr=1.0)
    >>> def error(change): return float((change - dyn.actual).norm() / dyn.actual.norm())
    >>> error(dyn.predicted) > 1e-3, error(dyn.predicted + dyn.second_order) < 1e-4
    (True, True)
    """

    predicted: Float[Tensor, "batch layer head query key"]
    actual: Float[Tensor, "batch layer head query key"]
    second_order: Float[Tensor, "batch layer head query key"]
    predicted_pattern: Float[Tensor, "batch layer head query key"]
    actual_pattern: Float[Tensor, "batch layer head query key"]
    grad_error: Float[Tensor, "layer"]
    lengths: Int[Tensor, "batch"]
    layers: list[int]
    lr: float
    scales: list[float]

    def __repr__(self) -> str:
        batch, n_layers, n_heads = self.predicted.shape[:3]
        return (
            f"EditDynamics(batch={batch}, layers={self.layers}, heads={n_heads}, lr={self.lr:g}, "
            f"mean cosine={self.cosine.nanmean().item():.4f})"
        )

    @property
    def cosine(self) -> Float[Tensor, "layer head"]:
        """Cosine between predicted and actual logit changes of each head (over batch and
        positions); NaN where either change is exactly zero."""
        return _cosine(self.predicted, self.actual)

    @property
    def relative_error(self) -> Float[Tensor, "layer head"]:
        """||predicted - actual|| / ||actual|| of each head's logit change (O(lr) for small lr)."""
        return _relative_error(self.predicted, self.actual)

    @property
    def pattern_cosine(self) -> Float[Tensor, "layer head"]:
        """Cosine between predicted and actual pattern changes of each head."""
        return _cosine(self.predicted_pattern, self.actual_pattern)

    @property
    def pattern_relative_error(self) -> Float[Tensor, "layer head"]:
        """||predicted - actual|| / ||actual|| of each head's pattern change."""
        return _relative_error(self.predicted_pattern, self.actual_pattern)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings and the per-head agreement (`cosine`, `relative_error` and
        their pattern versions, [layer head] lists, NaN as None) and `grad_error`."""
        return {
            "layers": list(self.layers),
            "lr": self.lr,
            "scales": list(self.scales),
            "lengths": self.lengths.tolist(),
            "grad_error": self.grad_error.tolist(),
            **{
                name: json_ready(getattr(self, name).tolist())
                for name in ("cosine", "relative_error", "pattern_cosine", "pattern_relative_error")
            },
        }

    def table(self) -> str:
        """A Markdown table: one row per head (layer, head, cosine, relative error of the
        logits and of the pattern)."""
        rows = [
            repr(self),
            "",
            "| layer | head | cosine | rel. error | pattern cosine | pattern rel. error |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        cos, err = self.cosine, self.relative_error
        pcos, perr = self.pattern_cosine, self.pattern_relative_error
        for i, layer in enumerate(self.layers):
            for h in range(cos.shape[1]):
                rows.append(
                    f"| {layer} | {h} | {float(cos[i, h]):.4f} | {float(err[i, h]):.3g} | "
                    f"{float(pcos[i, h]):.4f} | {float(perr[i, h]):.3g} |"
                )
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None) -> Figure:
        """The cosine between predicted and actual logit changes per head, as a layer x head
        heat map (`viz.ranking_maps`); `save` also writes it."""
        from ra_lens.viz import ranking_maps

        return ranking_maps(
            {"cosine (predicted, actual)": self.cosine}, layers=self.layers, save=save
        )


def edit_dynamics(
    model: Validated[HookedModel],
    tokens: Validated[Int[Tensor, "batch pos"] | Batch | str | Sequence[str]],
    metric: MetricFn,
    lr: Validated[float],
    *,
    layers: Validated[Sequence[int]] | None = None,
) -> EditDynamics:
    """Predict from RA, then measure, the change of each head's logits after one SGD step.

    Args:
        model: a TransformerBridge (see `SUPPORTED`); it is deep-copied, never modified.
        tokens: as for `reversed_attention` (ids, a Batch, a string or strings).
        metric: as for `reversed_attention`; the loss is the sum of its values over prompts.
        lr: SGD step size (> 0): W <- W - lr * dL/dW on one layer's W_q, W_k, b_q, b_k.
        layers: the layers to step, one at a time (default all).

    Returns:
        EditDynamics with predicted and actual changes, Float[Tensor, "batch layer head query
        key"] on the CPU in the model's dtype, and per-head `cosine` / `relative_error`.

    Raises:
        ValueError: lr not a positive finite number, or a layer out of range.
        NotImplementedError: an architecture whose attention is not softmax(rot(X W_q + b_q)
            rot(X W_k + b_k)^T / s) with separate q/k nn.Linear projections.

    With `model` a tiny random GPT-2 bridge (`ra_lens.toy_models.tiny_model`):

    >>> from ra_lens.metrics import target_nll
    >>> dyn = edit_dynamics(model, "The capital of France is", target_nll([294]), lr=1e-3)
    >>> dyn.cosine.shape, bool(dyn.cosine.min() > 0.999)  # [layer head]
    (torch.Size([2, 4]), True)
    >>> bool(dyn.grad_error.max() < 1e-5)  # RA's gradient of W_q, b_q, W_k, b_k is autograd's
    True
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    lr = float(lr)
    model_facts = contract.model_facts(model)  # read once for the call
    shape = model_facts.shape
    chosen = capture.check_layers(layers, shape.n_layers)
    for layer in chosen:
        _projections(model, layer)
    batch = capture.to_batch(model, tokens)
    facts = [model_facts.attention[layer] for layer in chosen]
    for layer, fact in zip(chosen, facts):
        if fact.refusal() is not None:
            raise NotImplementedError(
                f"edit_dynamics: layer {layer}: {fact.refusal()}, so a step on W_q/W_k does not "
                f"move QK^T linearly in the step; supported: {SUPPORTED}"
            )
    scales = [fact.scale for fact in facts]
    mask = _real_triangle(batch)

    clone = _deepcopy(model)
    for module in capture.model_modules(clone):  # a bridge's HF modules too: no dropout
        module.eval()
    for p in clone.parameters():
        p.requires_grad_(False)
        p.grad = None
    before = _capture(clone, batch.tokens, chosen)
    for i, layer in enumerate(chosen):
        _check_form(before[layer], clone, layer, facts[i], mask)
    ra = reversed_attention(clone, batch, metric, layers=chosen, convention="qk")
    assert ra.maps is not None
    grads = _autograd_grads(clone, batch, metric, chosen)

    out: dict[str, list[Tensor]] = {k: [] for k in ("pred", "act", "sec", "pred_a", "act_a")}
    grad_errors = []
    for i, layer in enumerate(chosen):
        acts = before[layer]
        dtype = acts["q"].dtype
        has_bias = [p is not None for p in _step_params(clone, layer)[1::2]]
        ra_map = ra.maps[:, i].to(acts["q"].device, dtype)
        pred, second, ra_grads = _predict(acts, ra_map, lr, has_bias)
        grad_errors.append(_grad_error(ra_grads, grads[layer]))
        after = _stepped(clone, batch.tokens, layer, grads[layer], lr)
        pattern = _pattern(acts, facts[i], mask)
        # dS/dZ: 1/s, times the soft-cap's slope where there is one
        slope: float | Tensor = 1.0 / scales[i]
        if facts[i].softcap is not None:
            capped = facts[i].logits(_logits(acts)).masked_fill(~mask, 0.0)
            slope = softcap_slope(capped, cast(float, facts[i].softcap)) / scales[i]
        weighted = pattern * pred * slope
        out["pred"].append(pred * mask)
        out["sec"].append(second * mask)
        out["act"].append((_logits(after) - _logits(acts)) * mask)
        out["pred_a"].append((weighted - pattern * weighted.sum(-1, keepdim=True)) * mask)
        out["act_a"].append(_pattern(after, facts[i], mask) - pattern)

    def stack(key: str) -> Tensor:
        return torch.stack(out[key], dim=1).cpu()

    return EditDynamics(
        predicted=stack("pred"),
        actual=stack("act"),
        second_order=stack("sec"),
        predicted_pattern=stack("pred_a"),
        actual_pattern=stack("act_a"),
        grad_error=torch.tensor(grad_errors, dtype=torch.float64),
        lengths=batch.lengths.cpu(),
        layers=chosen,
        lr=lr,
        scales=scales,
    )


def _deepcopy(model: HookedModel) -> HookedModel:
    """copy.deepcopy, with activations that bridges cache on their modules (non-leaf tensors
    still tied to an autograd graph, which deepcopy refuses) copied detached."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def _projections(model: HookedModel, layer: int) -> tuple[nn.Linear, nn.Linear]:
    """The q and k nn.Linear modules of one layer, or NotImplementedError."""
    attn = model.blocks[layer].attn
    found = []
    for name in ("q", "k"):
        bridge = getattr(attn, name, None) if isinstance(attn, nn.Module) else None
        linear = getattr(bridge, "original_component", None)
        if not isinstance(linear, nn.Linear):
            raise NotImplementedError(
                f"edit_dynamics needs blocks[{layer}].attn.{name} to wrap an nn.Linear "
                f"(found {type(linear).__name__}); supported: {SUPPORTED}"
            )
        found.append(linear)
    return found[0], found[1]


def _step_params(model: HookedModel, layer: int) -> list[Tensor | None]:
    """[W_q, b_q, W_k, b_k] of one layer (a bias is None when the model has none)."""
    q, k = _projections(model, layer)
    return [q.weight, q.bias, k.weight, k.bias]


def _autograd_grads(
    clone: HookedModel, batch: Batch, metric: MetricFn, layers: list[int]
) -> dict[int, list[Tensor | None]]:
    """Autograd dL/d(W_q, b_q, W_k, b_k) of every chosen layer, at the unedited weights."""
    per_layer = {layer: _step_params(clone, layer) for layer in layers}
    flat = [p for params in per_layer.values() for p in params if p is not None]
    for p in flat:
        p.requires_grad_(True)
    with torch.enable_grad():
        _, loss = metric_loss(metric, clone(batch.tokens), batch)
        found = torch.autograd.grad(loss, flat, allow_unused=True)
        grads = iter(
            [torch.zeros_like(p) if g is None else g for p, g in zip(flat, found, strict=True)]
        )
    for p in flat:
        p.requires_grad_(False)
    return {
        layer: [None if p is None else next(grads) for p in params]
        for layer, params in per_layer.items()
    }


def _stepped(
    clone: HookedModel, tokens: Tensor, layer: int, grads: list[Tensor | None], lr: float
) -> dict[str, Tensor]:
    """Activations of `layer` after W <- W - lr * grad on its q/k parameters, then undo it."""
    params = _step_params(clone, layer)
    saved = [None if p is None else p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                if p is not None and g is not None:
                    p.sub_(lr * g)
        return _capture(clone, tokens, [layer])[layer]
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                if p is not None and s is not None:
                    p.copy_(s)


_NAMES = {
    "x_q": capture.Q_IN,
    "x_k": capture.K_IN,
    "x": capture.ATTN_IN,
    "q": capture.Q,
    "k": capture.K,
    "rot_q": capture.ROT_Q,
    "rot_k": capture.ROT_K,
    "cos": capture.COS,
    "sin": capture.SIN,
    "pattern": PATTERN,
}


def _capture(model: HookedModel, tokens: Tensor, layers: list[int]) -> dict[int, dict[str, Tensor]]:
    """One no-grad forward pass; the hooked activations of each layer by short name."""
    names = {(layer, key): name.format(layer) for layer in layers for key, name in _NAMES.items()}
    with torch.no_grad(), capture.recorded(model, names.values()) as acts:
        model(tokens)
    attention.fill_rotated(model, acts, layers)
    turns = {}
    for layer in layers:
        rotate = attention.rotary_function(model, layer, acts)
        if rotate is not None and capture.ROT_Q.format(layer) in acts:
            q = acts[capture.Q.format(layer)]
            turns[layer] = attention.rotation_matrices(rotate, q.shape[1], q.shape[-1], q.device)
    store: dict[int, dict[str, Tensor]] = {layer: {} for layer in layers}
    for (layer, key), name in names.items():
        if name in acts:
            store[layer][key] = acts[name].clone()
    for layer, acts_of_layer in store.items():
        if layer in turns:
            acts_of_layer["turn"] = turns[layer]
        for key in ("x_q", "x_k"):
            if key not in acts_of_layer and "x" in acts_of_layer:
                acts_of_layer[key] = acts_of_layer["x"]
        missing = [k for k in ("x_q", "x_k", "q", "k", "pattern") if k not in acts_of_layer]
        if missing:
            raise NotImplementedError(
                f"edit_dynamics: layer {layer} did not fire the hooks "
                f"{[_NAMES[m].format(layer) for m in missing]} in a forward pass of the model's "
                f"copy (its attention does not run through its own hook points); supported: "
                f"{SUPPORTED}"
            )
    return store


def _rot(
    x: Float[Tensor, "batch pos head d_head"], acts: dict[str, Tensor], transpose: bool = False
) -> Float[Tensor, "batch pos head d_head"]:
    """The rotary embedding (or its transpose) as its per-position matrices `acts["turn"]`
    (`attention.rotation_matrices`); the identity when the layer has none."""
    if "turn" not in acts:
        return x
    turn = acts["turn"].to(x)
    return torch.einsum("bphd,ped->bphe" if transpose else "bphd,pde->bphe", x, turn)


def _qk(acts: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(Q, K) as dotted into the logits: post-rotation when the layer has rotary hooks;
    K repeated to one key head per query head."""
    q = acts.get("rot_q", acts["q"])
    k = acts.get("rot_k", acts["k"])
    return q, attention.per_query_head(k, q.shape[2] // k.shape[2])


def _logits(acts: dict[str, Tensor]) -> Float[Tensor, "batch head query key"]:
    q, k = _qk(acts)
    return torch.einsum("bqhd,bkhd->bhqk", q, k)


def _pattern(
    acts: dict[str, Tensor], facts: capture.AttentionFacts, mask: Tensor
) -> Float[Tensor, "batch head query key"]:
    """The layer's softmax (`AttentionFacts.logits`: scale, soft-cap, window) in the
    activations' dtype, zero outside `mask` (HF-style bridges round hook_pattern to float32,
    which would swamp a small change in a float64 model)."""
    scores = facts.logits(_logits(acts)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def _predict(
    acts: dict[str, Tensor],
    ra: Float[Tensor, "batch head query key"],
    lr: float,
    has_bias: list[bool],
) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """First- and second-order logit changes from RA, and the RA-derived gradients
    [dW_q, db_q, dW_k, db_k] (nn.Linear layout: weight [out, in]; None for a missing bias)."""
    q, k = _qk(acts)
    n_heads, n_kv = q.shape[2], acts["k"].shape[2]
    grad_q = torch.einsum("bhqk,bkhd->bqhd", ra, k)
    grad_k = torch.einsum("bhqk,bqhd->bkhd", ra, q)
    grad_k = grad_k.unflatten(2, (n_kv, n_heads // n_kv)).sum(3)
    grad_q, grad_k = _rot(grad_q, acts, transpose=True), _rot(grad_k, acts, transpose=True)
    deltas: list[Tensor] = []
    grads: list[Tensor | None] = []
    for g, x, bias in ((grad_q, acts["x_q"], has_bias[0]), (grad_k, acts["x_k"], has_bias[1])):
        flat = g.flatten(-2)
        w_grad = torch.einsum("bpo,bpi->oi", flat, x)
        b_grad = flat.sum((0, 1)) if bias else None
        grads += [w_grad, b_grad]
        step = torch.einsum("bpi,oi->bpo", x, w_grad)
        delta = -lr * (step if b_grad is None else step + b_grad)
        deltas.append(_rot(delta.unflatten(-1, g.shape[-2:]), acts))
    dq = deltas[0]
    dk = attention.per_query_head(deltas[1], n_heads // n_kv)
    first = torch.einsum("bqhd,bkhd->bhqk", dq, k) + torch.einsum("bqhd,bkhd->bhqk", q, dk)
    second = torch.einsum("bqhd,bkhd->bhqk", dq, dk)
    return first, second, grads


def _grad_error(ra_grads: list[Tensor | None], grads: list[Tensor | None]) -> float:
    """||RA-derived - autograd|| / ||autograd|| over the layer's q/k parameters that exist."""
    pairs = [
        (r, g) for r, g in zip(ra_grads, grads, strict=True) if r is not None and g is not None
    ]
    diff = sum(float((r - g).double().pow(2).sum()) for r, g in pairs)
    norm = sum(float(g.double().pow(2).sum()) for _, g in pairs)
    return math.sqrt(diff / norm) if norm > 0 else float("nan")


def _real_triangle(batch: Batch) -> Tensor:
    """Bool [batch, 1, query, key]: causal and at a real (non-pad) query."""
    n = batch.tokens.shape[1]
    causal = causal_mask(n, n, batch.tokens.device)
    return (causal[None] & batch.real_mask()[:, :, None])[:, None]


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    """The bare affine map (no module hooks), as the prediction assumes."""
    return nn.functional.linear(x, module.weight, module.bias)


def _check_form(
    acts: dict[str, Tensor],
    model: HookedModel,
    layer: int,
    facts: capture.AttentionFacts,
    mask: Tensor,
) -> None:
    """Check that the layer computes what the prediction assumes, else NotImplementedError. The
    projections and rotation are checked to sqrt(eps) of their dtype relative to their size; the
    softmax by the one recompute check every route uses (`attention.check_recomputed`)."""
    if (facts.rotary or "rot_q" in acts) and "turn" not in acts:
        raise NotImplementedError(
            f"edit_dynamics: layer {layer} rotates q/k and ra-lens cannot read its rotation "
            f"(no cos/sin tables, no rotation code it knows); supported: {SUPPORTED}"
        )
    tol = math.sqrt(torch.finfo(acts["q"].dtype).eps)
    q_lin, k_lin = _projections(model, layer)
    checks = [
        ("hook_q = X W_q + b_q", _linear(q_lin, acts["x_q"]).reshape(acts["q"].shape), acts["q"]),
        ("hook_k = X W_k + b_k", _linear(k_lin, acts["x_k"]).reshape(acts["k"].shape), acts["k"]),
    ]
    if "rot_q" in acts:
        checks.append(("hook_rot_q = rot(hook_q)", _rot(acts["q"], acts), acts["rot_q"]))
        checks.append(("hook_rot_k = rot(hook_k)", _rot(acts["k"], acts), acts["rot_k"]))
    for what, ours, theirs in checks:
        bound = tol * (1.0 + theirs.abs().max().item())
        if ours.shape != theirs.shape or (ours - theirs).abs().max().item() > bound:
            raise NotImplementedError(
                f"layer {layer} does not satisfy {what}, which the first-order prediction "
                f"assumes; supported: {SUPPORTED}"
            )
    attention.check_recomputed(
        layer,
        _pattern(acts, facts, mask),
        acts["pattern"],
        mask,
        facts,
        f"the first-order prediction assumes hook_pattern = softmax(S(QK^T)); supported: "
        f"{SUPPORTED}",
        error=NotImplementedError,
    )


def _cosine(a: Tensor, b: Tensor) -> Float[Tensor, "layer head"]:
    a, b = a.double(), b.double()
    dot = (a * b).sum((0, 3, 4))
    return dot / (_norms(a) * _norms(b))


def _relative_error(a: Tensor, b: Tensor) -> Float[Tensor, "layer head"]:
    return _norms(a.double() - b.double()) / _norms(b.double())


def _norms(x: Tensor) -> Tensor:
    return x.pow(2).sum((0, 3, 4)).sqrt()
