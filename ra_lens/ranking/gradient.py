"""Rankings from one forward and one backward pass: RA's norm (whole map or loss row), RA's
inverse-temperature score, and the first-order estimates of causal mediation, activation
patching and query/key patching. Each is a scorer run by `engine.rank`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import RESID_PRE, Batch, HookedModel, Z
from ra_lens.core import reversed_attention
from ra_lens.math import upcast
from ra_lens.metrics import target_nll, target_prob
from ra_lens.patching import HeadMeans, ablation_values, check_means
from ra_lens.patching import last_token_means as last_token_means  # in the examples
from ra_lens.ranking.engine import Part, PerPrompt, rank, target_probs
from ra_lens.types import Scores, Targets, Tokens


def ra_ranking(
    model: Validated[HookedModel],
    prompts: Tokens,
    targets: Targets,
    *,
    loss_row: bool = False,
    batch_size: int = 8,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Mean Reversed Attention norm of each head, for each prompt's own -log p(target).

    Args:
        model: a TransformerLens model, or an nnsight model (`ra_lens.nnsight`).
        prompts: Int[Tensor, "batch pos"], a Batch or strings (right-padded; lengths respected).
        targets: Int[Tensor, "batch"], the target token of each prompt at its last position.
        loss_row: False: Frobenius norm of the whole [query key] map (kept as norms only, so
            memory stays O(layer x head)); True: norm of the map's row at the loss position
            (each prompt's last real token) only, which needs the maps (keep="maps").
        batch_size: prompts per forward + backward pass.
        per_prompt: return each prompt's norms, Float[Tensor, "batch layer head"], instead of
            their mean (for bootstrap intervals over prompts).

    Returns:
        Float[Tensor, "layer head"]: the mean over prompts (equals
        `reversed_attention(model, prompts, target_nll(targets)).head_norms()` when loss_row is
        False).

    >>> prompts, targets = ["I like Italy and France", "The quick brown fox"], [5, 7]
    >>> scores = ra_ranking(model, prompts, targets)  # `model`: 2 layers x 4 heads
    >>> scores.shape, ra_ranking(model, prompts, targets, per_prompt=True).shape
    (torch.Size([2, 4]), torch.Size([2, 2, 4]))
    >>> ra = reversed_attention(model, prompts, target_nll(targets))
    >>> torch.allclose(scores, ra.head_norms(), rtol=1e-5)
    True
    """

    from ra_lens.nnsight.adapter import as_nnsight

    nnsight_model = as_nnsight(model)
    if nnsight_model is not None:  # the same scores, read through nnsight
        from ra_lens.nnsight.route import ra_ranking as through_nnsight

        return through_nnsight(
            nnsight_model, prompts, targets, loss_row=loss_row, batch_size=batch_size,
            per_prompt=per_prompt,
        )  # fmt: skip

    def score(model: HookedModel, part: Part) -> Tensor:
        keep: Literal["maps", "norms"] = "maps" if loss_row else "norms"
        ra = reversed_attention(model, part.prompts, target_nll(part.targets), keep=keep)
        if not loss_row:
            return ra.norms
        assert ra.maps is not None
        index = torch.arange(ra.maps.shape[0], device=ra.maps.device)
        last = part.prompts.lengths.to(ra.maps.device) - 1
        rows_at_loss = ra.maps[index, :, :, last]  # [batch layer head key]
        return rows_at_loss.double().pow(2).sum(-1).sqrt().float()

    return rank(
        model,
        prompts,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="RA ranking",
    )


def temperature_scores(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets,
    *,
    batch_size: int = 8,
    progress: bool = False,
) -> PerPrompt:
    """d(-log p(target))/d(beta_h) at beta = 1, per prompt and head, where beta_h multiplies
    head h's attention logits (an inverse temperature): sum over the causal triangle of
    RA * QK^T.

    QK^T is not read from a hook: with S = QK^T / s + mask and A = softmax(S), log A = S - lse
    row by row and every RA row sums to zero, so sum RA * QK^T = s * sum RA * log A over the
    entries with A > 0 (RA vanishes where A does). It therefore works on every model RA works
    on. Positive = sharpening the head raises the loss. When a row of A is nearly one-hot both RA
    and this score go to zero, whatever the head does: the saturation blind spot is shared.

    Returns:
        Float[Tensor, "batch layer head"], signed.

    >>> scores = temperature_scores(model, ["I like Italy and France", "Q: hot"], [5, 7])
    >>> scores.shape  # [batch layer head], signed
    torch.Size([2, 2, 4])
    >>> torch.allclose(temperature_ranking(model, ["I like Italy and France", "Q: hot"], [5, 7]),
    ...                scores.abs().mean(0))
    True
    """

    def score(model: HookedModel, part: Part) -> Tensor:
        # dL/dS itself (not s * RA, which differs under an attention soft-cap)
        ra = reversed_attention(
            model, part.prompts, target_nll(part.targets), keep="maps", convention="scores"
        )
        assert ra.maps is not None and ra.patterns is not None
        maps, patterns = ra.maps.double(), ra.patterns.double()
        log_a = torch.where(patterns > 0, patterns.clamp_min(1e-300).log(), 0.0)
        return (maps * log_a).sum((-2, -1)).float()

    return rank(
        model,
        prompts,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=True,
        desc="temperature scores",
    )


def temperature_ranking(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets,
    *,
    batch_size: int = 8,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Mean |d loss / d inverse temperature| of each head (`temperature_scores`): an RA-derived
    score without the Frobenius norm. Float[Tensor, "layer head"].

    >>> temperature_ranking(model, ["I like Italy"], [5]).shape
    torch.Size([2, 4])
    """
    values = temperature_scores(
        model, prompts, targets, batch_size=batch_size, progress=progress
    ).abs()
    return values.float() if per_prompt else values.double().mean(0).float()


def first_order_mediation(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets,
    *,
    means: HeadMeans | None = None,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """First-order estimate of `causal_mediation`: gradient at hook_z times (actual - ablated).

    score[l, h] = mean_i sum_{pos, d} dp_i/dz[l, h] * (z - z_ablated)[l, h], p_i = p(target) at
    the last position, z_ablated = 0 (zero ablation) or the means. This is the Taylor estimate
    of p_i - p_i(head ablated), for every head from one forward and one backward pass per batch
    (attribution patching with the ablation as the "corrupted" activation).

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    >>> first_order_mediation(model, ["I like Italy", "Q: hot"], [5, 7]).shape
    torch.Size([2, 4])
    >>> means = last_token_means(model, ["The quick brown fox", "I like France"])
    >>> first_order_mediation(model, ["I like Italy"], [5], means=means, per_prompt=True).shape
    torch.Size([1, 2, 4])
    """
    shape = capture.model_shape(model)
    check_means(means, shape.n_layers, shape.n_heads)
    layers = list(range(shape.n_layers))

    def score(model: HookedModel, part: Part) -> Tensor:
        z, grads = _z_and_grads(model, part.prompts, part.targets, layers)
        out = []
        for la in layers:
            diff = upcast(z[la])
            if means is not None:
                diff = diff - ablation_values(means[la], part.prompts.lengths, diff.shape[1]).to(
                    diff
                )
            out.append((upcast(grads[la]) * diff).sum((1, 3)).double())
        return torch.stack(out, dim=1)

    return rank(
        model,
        prompts,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="first-order mediation",
    )


def attribution_patching(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """First-order estimate of `activation_patching`: gradient x activation difference at hook_z.

    score[l, h] = mean_i sum_{pos, d} dp_i/dz[l, h] (corrupted run) * (z_clean - z_corrupted)[l, h],
    p_i = p(target) at the last position. One clean forward pass, one corrupted forward pass and
    one backward pass per batch, for all heads.

    Args:
        clean, corrupted: prompts of equal token lengths, pair by pair.
        targets: the clean answer token of each prompt.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    >>> clean = model.to_tokens("I like Italy")
    >>> corrupted = clean.clone()
    >>> corrupted[0, -1] = 7  # another last token, the same length
    >>> attribution_patching(model, clean, clean, [5]).abs().max()
    tensor(0.)
    >>> attribution_patching(model, clean, corrupted, [5], per_prompt=True).shape
    torch.Size([1, 2, 4])
    """
    layers = list(range(capture.model_shape(model).n_layers))
    names = [Z.format(la) for la in layers]

    def score(model: HookedModel, part: Part) -> Tensor:
        assert part.corrupted is not None
        with torch.no_grad(), capture.recorded(model, names) as acts:
            model(part.prompts.tokens)
        corrupted_z, grads = _z_and_grads(model, part.corrupted, part.targets, layers)
        out = []
        for la, grad in zip(layers, grads, strict=True):
            diff = acts[Z.format(la)].to(grad.device) - corrupted_z[la]
            out.append((upcast(grad) * upcast(diff)).sum((1, 3)).double())
        return torch.stack(out, dim=1)

    return rank(
        model,
        clean,
        targets,
        score,
        corrupted=corrupted,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="attribution patching",
    )


def exact_qk_attribution(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Exact-softmax attribution of each head's queries and keys (AtP*'s QK fix).

    score[l, h] = mean_i of the estimated gain in p(target) when head h's queries are taken from
    the clean run, plus the part of the estimate for its key/value head's keys that flows through
    h's pattern (`AttentionAttribution.key_by_head`), both summed over positions:
    `attention_attribution(..., nodes=("query", "key"), method="exact", direction="denoise")`.
    One forward + backward pass on the corrupted prompts and one forward pass on the clean ones
    per batch, for all heads; unlike a gradient it does not vanish on saturated attention rows.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    >>> clean = model.to_tokens("I like Italy")
    >>> corrupted = clean.clone()
    >>> corrupted[0, -1] = 7  # another last token, the same length
    >>> exact_qk_attribution(model, clean, corrupted, [5]).shape
    torch.Size([2, 4])
    >>> bool(exact_qk_attribution(model, clean, clean, [5]).abs().max() < 1e-12)  # nothing moved
    True
    """
    from ra_lens.attribution import attention_attribution

    def score(model: HookedModel, part: Part) -> Tensor:
        assert part.corrupted is not None
        att = attention_attribution(
            model,
            part.prompts,
            part.corrupted,
            target_prob(part.targets),
            nodes=("query", "key"),
        )
        assert att.key_by_head is not None
        query = att.by_position["query"].double().sum(3)
        return query + att.key_by_head.double().sum(3)

    return rank(
        model,
        clean,
        targets,
        score,
        corrupted=corrupted,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="exact QK attribution",
    )


def _z_and_grads(
    model: HookedModel, part: Batch, targets: Tensor, layers: list[int]
) -> tuple[dict[int, Tensor], list[Tensor]]:
    """hook_z of each layer and d(sum_i p_i(target))/d hook_z, from one forward + backward."""
    store: dict[str, Tensor] = {}
    seen: dict[int, Tensor] = {}

    def keep(layer: int) -> Callable[[Tensor, Any], Tensor]:
        # On TransformerBridge hook_z sees a view of o's input; only a tensor the hook returns
        # is used downstream, so return a clone and differentiate with respect to it.
        def hook(z: Tensor, hook: Any) -> Tensor:
            z = z.clone()
            seen[layer] = z
            return z

        return hook

    fwd = [(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]
    fwd += [(Z.format(la), keep(la)) for la in layers]
    with capture.preserved_state(model), torch.enable_grad(), model.hooks(fwd_hooks=fwd):
        probs = target_probs(model(part.tokens), part.lengths, targets)
        grads = torch.autograd.grad(probs.sum(), [seen[la] for la in layers], allow_unused=True)
    missing = [la for la, grad in zip(layers, grads, strict=True) if grad is None]
    if missing:
        raise RuntimeError(
            f"no gradient reached hook_z of layers {missing}: this ranking needs hook_z in the "
            "autograd graph of the output"
        )
    return {la: seen[la].detach() for la in layers}, list(grads)
