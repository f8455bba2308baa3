"""The softmax algebra of query/key attribution: pure float64 tensor functions (any leading axes,
the last two are query and key), and the vocabulary of node kinds, methods and directions."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

NodeKind = Literal["pattern", "query", "key"]
Method = Literal["exact", "exact-ig", "linear"]
Direction = Literal["denoise", "noise"]
NODES: tuple[str, ...] = ("pattern", "query", "key")
METHODS: tuple[str, ...] = ("exact", "exact-ig", "linear")
DIRECTIONS: tuple[str, ...] = ("denoise", "noise")


def log_other_mass(log_pattern: Float[Tensor, "... query key"]) -> Float[Tensor, "... query key"]:
    """log(1 - A_ts) for every entry, exact also where A_ts rounds to 1.

    Only a row's largest entry can exceed 1/2; there 1 - A is the sum of the other entries (taken
    as a logsumexp), elsewhere log1p(-A) is accurate.

    >>> log_pattern = torch.tensor([[40.0, 0.0, 0.0]], dtype=torch.float64).log_softmax(-1)
    >>> float(1 - log_pattern[0, 0].exp()), round(float(log_other_mass(log_pattern)[0, 0]), 4)
    (0.0, -39.3069)
    """
    top = log_pattern.argmax(dim=-1, keepdim=True)
    others = log_pattern.scatter(-1, top, float("-inf")).logsumexp(dim=-1, keepdim=True)
    general = torch.log1p(-log_pattern.exp())
    return general.scatter(-1, top, others)


def key_terms(
    log_pattern: Float[Tensor, "... query key"],
    grad: Float[Tensor, "... query key"],
    delta: Float[Tensor, "... query key"],
    method: Method,
) -> Float[Tensor, "... query key"]:
    """Estimate, per (row t, key s), of raising the one logit (t, s) by delta[t, s].

    exact: sum_s' (A'_ts' - A_ts') R_ts' = (p' - A_ts)(R_ts - Rbar_t^(-s)), p' = sigmoid(logit
    A_ts + delta); linear: its derivative at delta = 0 times delta, A_ts (R_ts - D_t) delta, with
    D_t = sum_s A_ts R_ts. Masked entries (log A = -inf) give 0.

    Against raising logit (2, 1) by 3 and taking the softmax again:

    >>> logits, grad = torch.randn(2, 4, 4, dtype=torch.float64)
    >>> terms = key_terms(logits.log_softmax(-1), grad, torch.full((4, 4), 3.0), "exact")
    >>> raised = logits.clone()
    >>> raised[2, 1] += 3.0
    >>> torch.isclose(terms[2, 1], ((raised.softmax(-1) - logits.softmax(-1)) * grad).sum())
    tensor(True)
    """
    pattern = log_pattern.exp()
    visible = log_pattern > float("-inf")
    weighted = pattern * grad
    row_sum = weighted.sum(dim=-1, keepdim=True)
    if method == "linear":
        return torch.where(visible, weighted - pattern * row_sum, 0.0) * delta
    log_other = log_other_mass(log_pattern)
    new_weight = torch.sigmoid(log_pattern - log_other + delta)
    # sum_{s' != s} A_ts' R_ts': at the row maximum summed directly (no cancellation).
    top = log_pattern.argmax(dim=-1, keepdim=True)
    top_excluded = weighted.scatter(-1, top, 0.0).sum(dim=-1, keepdim=True)
    other_weighted = (row_sum - weighted).scatter(-1, top, top_excluded)
    other_mean = torch.where(
        log_other > float("-inf"), other_weighted / log_other.exp(), torch.zeros_like(grad)
    )
    change = torch.where(visible, new_weight - pattern, 0.0)
    return change * (grad - other_mean)


def key_delta_rows(
    log_pattern: Float[Tensor, "... query key"], delta_column: Float[Tensor, "... query"], key: int
) -> Float[Tensor, "... query key"]:
    """A' - A when logit (t, key) of every row t changes by delta_column[t] (the key node's
    change of the pattern, materialised; the estimate uses the closed form in `key_terms`).

    >>> logits, delta = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    >>> raised = logits.clone()
    >>> raised[:, 1] += delta
    >>> changed = key_delta_rows(logits.log_softmax(-1), delta, key=1)
    >>> torch.allclose(changed, raised.softmax(-1) - logits.softmax(-1))
    True
    """
    log_other = log_other_mass(log_pattern)[..., key]
    logit = log_pattern[..., key] - log_other
    new_weight = torch.sigmoid(logit + delta_column)
    pattern = log_pattern.exp()
    visible = log_pattern[..., key] > float("-inf")
    change = torch.where(visible, new_weight - pattern[..., key], 0.0)
    # Every other entry keeps its share of the remaining mass: A_ts' (1 - p') / (1 - A_ts).
    others = -change[..., None] * (log_pattern - log_other[..., None]).exp()
    others[..., key] = change
    return others
