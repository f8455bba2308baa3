"""Pure tensor functions of Reversed Attention: no models, no hooks.

Notation (README, "What RA is, and the three conventions"), per head: A = softmax(Z / s + M) is the forward pattern,
R = dL/dA the gradient at `hook_pattern`, and

    dL/dS  = A * (R - rowsum(A * R))        the "scores" convention (softmax VJP)
    dL/dZ  = dL/dS / s                      the "qk" convention: Reversed Attention, dL/d(QK^T)

Under an attention soft-cap c (Gemma-2: S = c tanh(Z / (s c)) + M), dS/dZ = (1 - (S/c)^2) / s, so
dL/dZ = dL/dS (1 - (S/c)^2) / s (`softcap_slope`).

Every function works on any leading batch axes, with the last two axes (query, key). Also the one
area under a curve (`trapezoid_auc`), for ablation and faithfulness curves and their plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import einops
import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

Convention = Literal["qk", "scores", "pattern"]
CONVENTIONS: tuple[str, ...] = ("qk", "scores", "pattern")


def upcast(x: Tensor) -> Tensor:
    """Half precision to float32; float32 and float64 stay as they are.

    >>> upcast(torch.ones(2, dtype=torch.bfloat16)).dtype, upcast(torch.ones(2).double()).dtype
    (torch.float32, torch.float64)
    """
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def softmax_vjp(
    pattern: Float[Tensor, "... query key"],
    pattern_grad: Float[Tensor, "... query key"],
    out: Tensor | None = None,
) -> Float[Tensor, "... query key"]:
    """dL/dS from the softmax output A and dL/dA: A * (R - rowsum(A * R)), at least in float32.

    `out`, if given, receives the result (e.g. a slice of a preallocated [batch, layer, ...] buffer).

    Equal to autograd's backward pass through the softmax:

    >>> scores = torch.randn(3, 5, 5, dtype=torch.float64, requires_grad=True)
    >>> pattern, grad = scores.softmax(-1), torch.randn(3, 5, 5, dtype=torch.float64)
    >>> (autograd,) = torch.autograd.grad(pattern, scores, grad)
    >>> torch.allclose(softmax_vjp(pattern.detach(), grad), autograd)
    True
    """
    a = upcast(pattern)
    out = torch.mul(a, upcast(pattern_grad), out=out)
    # In place: at long lengths each fresh [head, q, k] temporary costs more than the arithmetic.
    return out.addcmul_(a, out.sum(dim=-1, keepdim=True), value=-1.0)


def causal_mask(n_query: int, n_key: int, device: torch.device | str | None = None) -> Tensor:
    """Bool [query, key], True where key <= query (with queries aligned to the last keys).

    >>> causal_mask(2, 3)
    tensor([[ True,  True, False],
            [ True,  True,  True]])
    """
    offset = n_key - n_query
    return torch.ones(n_query, n_key, dtype=torch.bool, device=device).tril(diagonal=offset)


def softcap_slope(
    scores: Float[Tensor, "... query key"], cap: float
) -> Float[Tensor, "... query key"]:
    """dS/d(QK^T / s) = 1 - (S/c)^2 = sech^2 of the tanh's argument, from the capped scores S
    (`hook_attn_scores`, masked entries included: there the slope is 0, as A is).

    >>> raw = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    >>> capped = 2.0 * torch.tanh(raw / 2.0)
    >>> (autograd,) = torch.autograd.grad(capped.sum(), raw)
    >>> torch.allclose(softcap_slope(capped.detach(), 2.0), autograd)
    True
    """
    ratio = upcast(scores).clamp(-cap, cap) / cap
    return 1.0 - ratio * ratio


def convert(
    pattern: Float[Tensor, "... query key"],
    pattern_grad: Float[Tensor, "... query key"],
    convention: Convention,
    scale: float,
    out: Tensor | None = None,
    slope: Tensor | None = None,
) -> Float[Tensor, "... query key"]:
    """Turn the gradient at hook_pattern into the requested convention.

    Args:
        pattern: forward attention A.
        pattern_grad: dL/dA.
        convention: "qk" (dL/d(QK^T), the paper's RA), "scores" (dL/d pre-softmax scores) or
            "pattern" (dL/dA masked to the causal triangle; A's own gradient is dense).
        scale: the attention scale s that divides QK^T (sqrt(d_head) for GPT-2 and Llama).
        out: optional destination for the "qk" and "scores" conventions.
        slope: for "qk" under an attention soft-cap, `softcap_slope` of the capped scores.

    >>> mask = causal_mask(4, 4)
    >>> pattern = torch.randn(4, 4).masked_fill(~mask, float("-inf")).softmax(-1)
    >>> grad = torch.randn(4, 4)
    >>> ra = convert(pattern, grad, "qk", scale=8.0)
    >>> torch.allclose(ra.sum(-1), torch.zeros(4), atol=1e-6)  # every row sums to zero
    True
    >>> torch.allclose(8.0 * ra, convert(pattern, grad, "scores", 8.0))
    True
    >>> bool(convert(pattern, grad, "pattern", 8.0)[~mask].eq(0).all())  # causal triangle only
    True
    """
    if convention == "pattern":
        mask = causal_mask(pattern.shape[-2], pattern.shape[-1], pattern.device)
        return upcast(pattern_grad).masked_fill(~mask, 0.0)
    scores_grad = softmax_vjp(pattern, pattern_grad, out=out)
    if convention == "scores":
        return scores_grad
    if slope is not None:
        scores_grad.mul_(slope.to(scores_grad))
    return scores_grad.div_(scale)


def pattern_grad_from_z(
    z_grad: Float[Tensor, "batch pos head d_head"],
    v: Float[Tensor, "batch pos kv_head d_head"],
) -> Float[Tensor, "batch head query key"]:
    """dL/dA = G V^T per head, from the gradient at hook_z and the values at hook_v.

    With grouped-query attention, query head h reads key/value head h // (head / kv_head).

    Equal to autograd through z = A V, here with 4 query heads sharing 2 key/value heads:

    >>> pattern = torch.rand(1, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    >>> v = torch.randn(1, 3, 2, 5, dtype=torch.float64)  # [batch pos kv_head d_head]
    >>> z = torch.einsum("bhqk,bkhd->bqhd", pattern, v.repeat_interleave(2, dim=2))
    >>> z_grad = torch.randn_like(z)
    >>> (autograd,) = torch.autograd.grad(z, pattern, z_grad)
    >>> torch.allclose(pattern_grad_from_z(z_grad, v), autograd)
    True
    """
    n_heads, n_kv = z_grad.shape[2], v.shape[2]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} key/value heads evenly")
    v_per_head = einops.repeat(upcast(v), "b k kv d -> b k (kv group) d", group=n_heads // n_kv)
    return torch.einsum("bqhd,bkhd->bhqk", upcast(z_grad), v_per_head)


def frobenius_norms(maps: Float[Tensor, "... query key"]) -> Float[Tensor, "..."]:
    """Frobenius norm of each [query, key] map.

    >>> frobenius_norms(torch.ones(2, 3, 4, 4))  # [batch head query key] -> [batch head]
    tensor([[4., 4., 4.],
            [4., 4., 4.]])
    """
    # torch's stubs type torch.linalg's functions as Any
    return torch.linalg.vector_norm(upcast(maps), dim=(-2, -1))  # type: ignore[no-any-return]


def rotate_half(
    x: Float[Tensor, "batch pos head d_head"],
    cos: Float[Tensor, "... pos rot"],
    sin: Float[Tensor, "... pos rot"],
) -> Float[Tensor, "batch pos head d_head"]:
    """HuggingFace's rotate-half rotary embedding on the first `rot` dims of every head (partial
    rotary: the rest pass through), with the model's own cos/sin tables.

    >>> x = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    >>> zeros, ones = torch.zeros(1, 3, 4, dtype=torch.float64), torch.ones(1, 3, 4, dtype=torch.float64)
    >>> torch.equal(rotate_half(x, ones, zeros), x)  # angle 0: the identity
    True
    """
    r = cos.shape[-1]
    cos = cos.reshape(-1, cos.shape[-2], 1, r).to(x.dtype)
    sin = sin.reshape(-1, sin.shape[-2], 1, r).to(x.dtype)
    part, rest = x[..., :r], x[..., r:]
    half = torch.cat([-part[..., r // 2 :], part[..., : r // 2]], dim=-1)
    return torch.cat([part * cos + half * sin, rest], dim=-1)


def trapezoid_auc(
    x: Tensor | np.ndarray | Sequence[float], y: Tensor | np.ndarray | Sequence[float]
) -> float:
    """Area under y(x) by the trapezoid rule, after sorting by x (stably), in float64.

    >>> trapezoid_auc([0, 0.5, 1], [0, 1, 1])
    0.75
    >>> trapezoid_auc([1, 0], [1, 1])  # sorted first
    1.0
    """
    xs = torch.as_tensor(x, dtype=torch.float64).detach().cpu().reshape(-1)
    ys = torch.as_tensor(y, dtype=torch.float64).detach().cpu().reshape(-1)
    if xs.shape != ys.shape:
        raise ValueError(f"{xs.numel()} x values for {ys.numel()} y values")
    order = torch.argsort(xs, stable=True)
    xs, ys = xs[order], ys[order]
    return float(((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2).sum())
