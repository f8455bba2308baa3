"""Baseline rankings: the forward attention pattern's norm, a seeded random ranking and the
layer index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import PATTERN, HookedModel
from ra_lens.math import frobenius_norms, upcast
from ra_lens.ranking.engine import Part, PerPrompt, check_shape, rank
from ra_lens.types import Scores, Targets, Tokens


def forward_ranking(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets | None = None,
    *,
    batch_size: int = 8,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Mean Frobenius norm of each head's forward attention pattern (real positions only).

    One forward pass per batch, no gradient; equals `reversed_attention(...).forward_norms()`.
    `targets` are not used (the pattern does not depend on them); given, they are checked like
    every ranking's.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    >>> from ra_lens import reversed_attention
    >>> from ra_lens.metrics import target_nll
    >>> prompts = ["I like Italy and France", "The quick brown fox"]
    >>> ra = reversed_attention(model, prompts, target_nll([5, 7]))
    >>> torch.allclose(forward_ranking(model, prompts), ra.forward_norms(), rtol=1e-5)
    True
    """
    shape = capture.model_shape(model)
    n_layers = shape.n_layers

    def score(model: HookedModel, part: Part) -> Tensor:
        real = part.prompts.real_mask()
        keep = real[:, None, :, None] & real[:, None, None, :]
        norms = torch.zeros(part.size, n_layers, shape.n_heads, dtype=torch.float64)

        def record(layer: int) -> Callable[[Tensor, Any], None]:
            def hook(pattern: Tensor, hook: Any) -> None:
                head_norms = frobenius_norms(upcast(pattern) * keep.to(pattern.device))
                norms[:, layer] = head_norms.double().cpu()

            return hook

        hooks = [(PATTERN.format(la), record(la)) for la in range(n_layers)]
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(part.prompts.tokens)
        return norms

    return rank(
        model,
        prompts,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="forward ranking",
    )


def random_ranking(n_layers: int, n_heads: int, seed: int = 0) -> Scores:
    """Uniform random scores from `torch.Generator().manual_seed(seed)`: the same seed, the same
    ranking, whatever the global RNG state. Float[Tensor, "layer head"].

    >>> scores = random_ranking(2, 4, seed=1)
    >>> scores.shape, torch.equal(scores, random_ranking(2, 4, seed=1))
    (torch.Size([2, 4]), True)
    """
    check_shape(n_layers, n_heads)
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand(n_layers, n_heads, generator=generator)


def layer_ranking(n_layers: int, n_heads: int) -> Scores:
    """The layer index as the score (later layers rank higher; within a layer, ties keep head
    order, see `head_order`). Float[Tensor, "layer head"].

    >>> layer_ranking(2, 3)
    tensor([[0., 0., 0.],
            [1., 1., 1.]])
    """
    check_shape(n_layers, n_heads)
    return torch.arange(n_layers, dtype=torch.float32)[:, None].expand(n_layers, n_heads).clone()
