"""Head rankings: which heads matter for a prediction, scored by RA and by the usual baselines.

Every ranking is a score per head, Float[Tensor, "layer head"] (the shape of
`transformer_lens.patching`'s head outputs), on the CPU in float32; larger = more important.

- `ra_ranking`: mean Frobenius norm of each head's Reversed Attention of -log p(target) (one
  forward + one backward pass for all heads); `loss_row=True` takes the norm of the map's row at
  the loss position only.
- `forward_ranking`: mean Frobenius norm of each head's forward attention pattern.
- `random_ranking` (seeded), `layer_ranking` (the layer index).
- `causal_mediation`: p(target) before minus after zeroing one head's output (one forward pass per
  head, batched over prompts).
- `activation_patching`: TransformerLens's own `get_act_patch_attn_head_out_all_pos`: the gain in
  p(target) when one head's clean output (all positions) is patched into the corrupted run.
- `attribution_patching`: its first-order approximation, sum of dM/dz (corrupted run) times
  (z_clean - z_corrupted) at hook_z, from two forward passes and one backward pass.
- `first_order_mediation`: the same first-order estimate of `causal_mediation` (gradient at hook_z
  times actual minus ablated output), one forward + backward pass for all heads.
- `indirect_effect`: Todd et al.'s: a head's mean last-token output patched into shuffled-label
  prompts, gain in p(target).
- `temperature_ranking`: |d loss / d inverse temperature| per head = |sum of RA * QK^T|.

`ablation_curve` keeps the top (or bottom) fraction of heads under a ranking, zeroes (or
mean-ablates, `last_token_means`) every other head's output at hook_z, and records the task's
top-k accuracy; `AblationCurve.auc` is the area under that curve. `spearman` and `top_k_overlap`
compare two rankings; `auc_interval`, `paired_auc_difference` and `spearman_interval` put
percentile bootstrap intervals over prompts on them.

    >>> scores = ra_ranking(model, tokens, targets)                        # doctest: +SKIP
    >>> curve = ablation_curve(model, test_prompts, scores)                # doctest: +SKIP
    >>> curve.auc, curve.top1                                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, RESID_PRE, Batch, HookedModel, Z
from ra_lens.core import reversed_attention
from ra_lens.math import frobenius_norms, upcast
from ra_lens.metrics import target_nll
from ra_lens.patching import head_ablation_hooks
from ra_lens.types import Scores, Targets, Tokens

__all__ = [
    "DEFAULT_FRACTIONS",
    "DENSE_FRACTIONS",
    "AblationCurve",
    "Interval",
    "ablation_curve",
    "ablation_hooks",
    "activation_patching",
    "attribution_patching",
    "auc_interval",
    "bootstrap_indices",
    "bootstrap_mean",
    "causal_mediation",
    "check_fractions",
    "check_scores",
    "evaluate_ablated",
    "exact_qk_attribution",
    "first_order_mediation",
    "forward_ranking",
    "head_order",
    "indirect_effect",
    "kept_heads",
    "last_token_means",
    "layer_ranking",
    "paired_auc_difference",
    "per_prompt_auc",
    "ra_ranking",
    "random_ranking",
    "spearman",
    "spearman_interval",
    "target_probs",
    "temperature_ranking",
    "temperature_scores",
    "top_k_overlap",
    "trapezoid_auc",
]

PerPrompt = Float[Tensor, "batch layer head"]
#: Mean head outputs for mean ablation: one vector per head (`patching.mean_head_outputs`, used at
#: every position) or one per position counted back from the last token (`last_token_means`).
HeadMeans = Validated[Float[Tensor, "layer head d_head"] | Float[Tensor, "layer head pos d_head"]]

#: p = 0, 10, ..., 100% of heads kept.
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(i / 10 for i in range(11))
#: Dense where the curves move (most models break when over half their heads are removed).
DENSE_FRACTIONS: tuple[float, ...] = (
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# helpers


def _targets(targets: Targets, n: int) -> Tensor:
    out = torch.as_tensor(targets, dtype=torch.long).reshape(-1)
    if out.shape[0] != n:
        raise ValueError(
            f"{out.shape[0]} targets for {n} prompts: give one target token per prompt"
        )
    return out


def _chunks(n: int, batch_size: int) -> list[slice]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def _part(batch: Batch, rows: slice) -> Batch:
    """Rows of a batch, with padding columns no row of the part needs cut off."""
    lengths = batch.lengths[rows]
    return Batch(batch.tokens[rows, : int(lengths.max())], lengths)


def target_probs(
    logits: Float[Tensor, "batch pos vocab"], lengths: Int[Tensor, "batch"], targets: Tensor
) -> Float[Tensor, "batch"]:
    """p(target) at each prompt's last real position, in float32 or wider.

    >>> logits = torch.zeros(2, 3, 4)
    >>> logits[0, 1, 2] = 10.0  # prompt 0 is 2 tokens long: its last real position is 1
    >>> target_probs(logits, torch.tensor([2, 3]), torch.tensor([2, 0]))
    tensor([0.9999, 0.2500])
    """
    rows = torch.arange(logits.shape[0], device=logits.device)
    last = upcast(logits[rows, lengths.to(logits.device) - 1])
    return last.softmax(-1)[rows, targets.to(logits.device)]


def _reduce(values: Tensor, per_prompt: bool) -> Tensor:
    """Per-prompt values [batch layer head] as float32, or their mean over prompts."""
    return values.float() if per_prompt else values.double().mean(0).float()


def check_scores(scores: Any, n_layers: int, n_heads: int, what: str = "scores") -> Scores:
    """Scores as a finite float CPU tensor of shape [n_layers, n_heads], or a clear error.

    >>> check_scores(torch.ones(2, 4, dtype=torch.float64), 2, 4).dtype
    torch.float32
    >>> check_scores(torch.ones(4, 2), 2, 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: scores have shape (4, 2) but the model has 2 layers of 4 heads: ...
    """
    if not isinstance(scores, Tensor):
        raise TypeError(
            f"{what} must be a Float[Tensor, 'layer head'], got {type(scores).__name__}"
        )
    if tuple(scores.shape) != (n_layers, n_heads):
        raise ValueError(
            f"{what} have shape {tuple(scores.shape)} but the model has {n_layers} layers of "
            f"{n_heads} heads: a ranking must be [n_layers, n_heads] = [{n_layers}, {n_heads}]"
        )
    scores = scores.detach().to("cpu", torch.float32)
    if not torch.isfinite(scores).all():
        raise ValueError(f"{what} contain NaN or inf")
    return scores


# --------------------------------------------------------------------------------------------
# rankings


def ra_ranking(
    model: HookedModel,
    tokens: Tokens,
    targets: Targets,
    *,
    loss_row: bool = False,
    batch_size: int = 8,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Mean Reversed Attention norm of each head, for each prompt's own -log p(target).

    Args:
        model: a TransformerLens model.
        tokens: Int[Tensor, "batch pos"], a Batch or strings (right-padded; lengths respected).
        targets: Int[Tensor, "batch"], the target token of each prompt at its last position.
        loss_row: False: Frobenius norm of the whole [query key] map (kept as norms only, so
            memory stays O(layer x head)); True: norm of the map's row at the loss position
            (each prompt's last real token) only, which needs the maps (keep="maps").
        batch_size: prompts per forward + backward pass.
        per_prompt: return each prompt's norms, Float[Tensor, "batch layer head"], instead of
            their mean (for bootstrap intervals over prompts).

    Returns:
        Float[Tensor, "layer head"]: the mean over prompts (equals
        `reversed_attention(model, tokens, target_nll(targets)).head_norms()` when loss_row is
        False).

    >>> from ra_lens.metrics import target_nll
    >>> prompts, targets = ["I like Italy and France", "The quick brown fox"], [5, 7]
    >>> scores = ra_ranking(model, prompts, targets)  # `model`: 2 layers x 4 heads
    >>> scores.shape, ra_ranking(model, prompts, targets, per_prompt=True).shape
    (torch.Size([2, 4]), torch.Size([2, 2, 4]))
    >>> ra = reversed_attention(model, prompts, target_nll(targets))
    >>> torch.allclose(scores, ra.head_norms(), rtol=1e-5)
    True
    """
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    parts = []
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        ra = reversed_attention(
            model, part, target_nll(targets[rows]), keep="maps" if loss_row else "norms"
        )
        if loss_row:
            assert ra.maps is not None
            index = torch.arange(ra.maps.shape[0], device=ra.maps.device)
            last = part.lengths.to(ra.maps.device) - 1
            rows_at_loss = ra.maps[index, :, :, last]  # [batch layer head key]
            norms = rows_at_loss.double().pow(2).sum(-1).sqrt().float()
        else:
            norms = ra.norms
        parts.append(norms)
    return _reduce(torch.cat(parts), per_prompt)


def forward_ranking(
    model: HookedModel, tokens: Tokens, *, batch_size: int = 8, per_prompt: bool = False
) -> Scores | PerPrompt:
    """Mean Frobenius norm of each head's forward attention pattern (real positions only).

    One forward pass per batch, no gradient; equals `reversed_attention(...).forward_norms()`.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    >>> from ra_lens.metrics import target_nll
    >>> prompts = ["I like Italy and France", "The quick brown fox"]
    >>> ra = reversed_attention(model, prompts, target_nll([5, 7]))
    >>> torch.allclose(forward_ranking(model, prompts), ra.forward_norms(), rtol=1e-5)
    True
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    norms = torch.zeros(batch.tokens.shape[0], shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        real = part.real_mask()
        keep = real[:, None, :, None] & real[:, None, None, :]

        def record(layer: int, keep: Tensor = keep, rows: slice = rows):
            def hook(pattern: Tensor, hook: Any) -> None:
                head_norms = frobenius_norms(upcast(pattern) * keep.to(pattern.device))
                norms[rows, layer] = head_norms.double().cpu()

            return hook

        hooks = [(PATTERN.format(la), record(la)) for la in range(shape.n_layers)]
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(part.tokens)
    return _reduce(norms, per_prompt)


def random_ranking(n_layers: int, n_heads: int, seed: int = 0) -> Scores:
    """Uniform random scores from `torch.Generator().manual_seed(seed)`: the same seed, the same
    ranking, whatever the global RNG state. Float[Tensor, "layer head"].

    >>> scores = random_ranking(2, 4, seed=1)
    >>> scores.shape, torch.equal(scores, random_ranking(2, 4, seed=1))
    (torch.Size([2, 4]), True)
    """
    if n_layers < 1 or n_heads < 1:
        raise ValueError(f"need at least one layer and one head, got {n_layers} x {n_heads}")
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand(n_layers, n_heads, generator=generator)


def layer_ranking(n_layers: int, n_heads: int) -> Scores:
    """The layer index as the score (later layers rank higher; within a layer, ties keep head
    order, see `head_order`). Float[Tensor, "layer head"].

    >>> layer_ranking(2, 3)
    tensor([[0., 0., 0.],
            [1., 1., 1.]])
    """
    if n_layers < 1 or n_heads < 1:
        raise ValueError(f"need at least one layer and one head, got {n_layers} x {n_heads}")
    return torch.arange(n_layers, dtype=torch.float32)[:, None].expand(n_layers, n_heads).clone()


def causal_mediation(
    model: HookedModel,
    tokens: Tokens,
    targets: Targets,
    *,
    means: HeadMeans | None = None,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Drop in p(target) when one head's output is ablated, mean over prompts.

    score[l, h] = mean_i (p_i - p_i with head (l, h) ablated at hook_z), p at each prompt's last
    position. One forward pass per head and per batch of prompts (n_layers x n_heads x
    ceil(N / batch_size) passes), plus one clean pass per batch. Positive = the head helps.

    Args:
        means: None zeroes the head; otherwise its output is replaced by these means
            (`mean_head_outputs`, or `last_token_means` aligned at each prompt's last token).
        per_prompt: return Float[Tensor, "batch layer head"] instead of the mean.

    Returns:
        Float[Tensor, "layer head"].

    One head by hand: p(target) before minus after zeroing head 2 of layer 1.

    >>> scores = causal_mediation(model, ["I like Italy"], [5])
    >>> tokens = model.to_tokens("I like Italy")
    >>> def p():
    ...     return target_probs(model(tokens), torch.tensor([tokens.shape[1]]), torch.tensor([5]))
    >>> with torch.no_grad():
    ...     before = p()
    ...     with model.hooks(fwd_hooks=ablation_hooks([(1, 2)])):
    ...         after = p()
    >>> torch.allclose(scores[1, 2], (before - after).float(), atol=1e-7)
    True
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    _check_means(means, shape)
    drops = torch.zeros(batch.tokens.shape[0], shape.n_layers, shape.n_heads, dtype=torch.float64)
    heads = [(la, h) for la in range(shape.n_layers) for h in range(shape.n_heads)]
    with torch.no_grad():
        for rows in _chunks(batch.tokens.shape[0], batch_size):
            part = _part(batch, rows)
            before = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
            for layer, head in tqdm(heads, desc="causal mediation", disable=not progress):
                hooks = ablation_hooks([(layer, head)], means=means, lengths=part.lengths)
                with model.hooks(fwd_hooks=hooks):
                    after = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
                drops[rows, layer, head] = (before - after).cpu()
    return _reduce(drops, per_prompt)


def _paired(
    model: HookedModel, clean: Tokens, corrupted: Tokens, targets: Targets
) -> tuple[Batch, Batch, Tensor]:
    clean_b, corrupted_b = capture.to_batch(model, clean), capture.to_batch(model, corrupted)
    if clean_b.tokens.shape != corrupted_b.tokens.shape or not torch.equal(
        clean_b.lengths, corrupted_b.lengths
    ):
        raise ValueError(
            f"clean {tuple(clean_b.tokens.shape)} and corrupted {tuple(corrupted_b.tokens.shape)} "
            "prompts must match token for token in length (patching is position by position): "
            "pair each clean prompt with a corrupted prompt of the same token length"
        )
    return clean_b, corrupted_b, _targets(targets, clean_b.tokens.shape[0])


@contextlib.contextmanager
def _tl_progress(enabled: bool) -> Iterator[None]:
    """TransformerLens's patching loop always draws a tqdm bar; swap it out when not wanted."""
    import transformer_lens.patching as tl_patching

    original = tl_patching.tqdm
    if not enabled:
        tl_patching.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        tl_patching.tqdm = original


def activation_patching(
    model: HookedModel,
    clean_tokens: Tokens,
    corrupted_tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
) -> Scores:
    """Gain in p(target) when one head's clean output is patched into the corrupted run.

    score[l, h] = mean_i (p_i(corrupted, z[l, h] from clean) - p_i(corrupted)), all positions of
    the head's hook_z output patched at once. Computed by TransformerLens itself:
    `transformer_lens.patching.get_act_patch_attn_head_out_all_pos` with `reduce="mean"` and
    `baseline=True` (its `PatchingResult.effect()`; under TL 2.x, which has neither, the mean
    metric minus the unpatched one), on a clean cache of hook_z only. This works
    on TransformerBridge in TL 4.3 (it only needs `run_with_cache`, `run_with_hooks` and the
    hook_z alias); the tests check it against a hand-written hook loop.

    Args:
        clean_tokens, corrupted_tokens: prompts of equal token lengths, pair by pair.
        targets: the clean answer token of each prompt.

    Returns:
        Float[Tensor, "layer head"].

    Patching a run with itself changes nothing:

    >>> activation_patching(model, ["I like Italy"], ["I like Italy"], [5]).abs().max()
    tensor(0.)
    """
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    # TL >= 3 reduces per-prompt metrics and subtracts the baseline itself; TL 2.x does neither
    tl_reduce = "reduce" in inspect.signature(get_act_patch_attn_head_out_all_pos).parameters
    clean, corrupted, targets = _paired(model, clean_tokens, corrupted_tokens, targets)
    shape = capture.model_shape(model)
    total = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    z_names = {Z.format(la) for la in range(shape.n_layers)}
    for rows in _chunks(clean.tokens.shape[0], batch_size):
        clean_part, corrupted_part = _part(clean, rows), _part(corrupted, rows)
        lengths, part_targets = clean_part.lengths, targets[rows]

        def metric(logits: Tensor, lengths: Tensor = lengths, part_targets: Tensor = part_targets):
            probs = target_probs(logits, lengths, part_targets)
            return probs if tl_reduce else probs.mean()

        with torch.no_grad(), _tl_progress(progress):
            _, cache = model.run_with_cache(
                clean_part.tokens, names_filter=lambda name: name in z_names
            )
            if tl_reduce:
                effect = get_act_patch_attn_head_out_all_pos(
                    model, corrupted_part.tokens, cache, metric, reduce="mean", baseline=True
                ).effect()
            else:  # TL 2.x: the patched mean p(target), minus the unpatched one
                patched = get_act_patch_attn_head_out_all_pos(
                    model, corrupted_part.tokens, cache, metric
                )
                effect = patched.double() - float(metric(model(corrupted_part.tokens)))
        total += effect.double().cpu() * (rows.stop - rows.start)
    return (total / clean.tokens.shape[0]).float()


def attribution_patching(
    model: HookedModel,
    clean_tokens: Tokens,
    corrupted_tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """First-order estimate of `activation_patching`: gradient x activation difference at hook_z.

    score[l, h] = mean_i sum_{pos, d} dp_i/dz[l, h] (corrupted run) * (z_clean - z_corrupted)[l, h],
    p_i = p(target) at the last position. One clean forward pass, one corrupted forward pass and
    one backward pass per batch, for all heads.

    Returns:
        Float[Tensor, "layer head"].

    >>> clean = model.to_tokens("I like Italy")
    >>> corrupted = clean.clone()
    >>> corrupted[0, -1] = 7  # another last token, the same length
    >>> attribution_patching(model, clean, clean, [5]).abs().max()
    tensor(0.)
    >>> attribution_patching(model, clean, corrupted, [5], per_prompt=True).shape
    torch.Size([1, 2, 4])
    """
    clean, corrupted, targets = _paired(model, clean_tokens, corrupted_tokens, targets)
    shape = capture.model_shape(model)
    layers = list(range(shape.n_layers))
    total = torch.zeros(clean.tokens.shape[0], shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(clean.tokens.shape[0], batch_size):
        clean_part, corrupted_part = _part(clean, rows), _part(corrupted, rows)
        with torch.no_grad(), capture.recorded(model, [Z.format(la) for la in layers]) as acts:
            model(clean_part.tokens)
        clean_z = {la: acts[Z.format(la)] for la in layers}
        corrupted_z, grads = _z_and_grads(model, corrupted_part, targets[rows], layers)
        for la, grad in zip(layers, grads, strict=True):
            diff = clean_z[la].to(grad.device) - corrupted_z[la]
            total[rows, la] = (upcast(grad) * upcast(diff)).sum((1, 3)).double().cpu()
    return _reduce(total, per_prompt)


# --------------------------------------------------------------------------------------------
# mean ablation aligned at the last token (Todd et al.)


def last_token_means(
    model: HookedModel, tokens: Tokens, *, batch_size: int = 16
) -> Float[Tensor, "layer head pos d_head"]:
    """Each head's hook_z output averaged over prompts position by position, counted back from
    each prompt's last real token (Todd et al.'s alignment for function vectors).

    means[l, h, -1] is the mean output at the last token, means[l, h, -2] one token earlier, and
    so on; entry -1 - j averages the prompts that are longer than j tokens. Use it with
    `ablation_hooks` (mean ablation) on held-out prompts of the same task; the old
    `patching.mean_head_outputs` (one mean over all real positions) stays available.

    Returns:
        Float[Tensor, "layer head pos d_head"] on the CPU, pos = the longest prompt's length.

    >>> prompts = ["I like Italy and France", "Q: hot"]
    >>> [model.to_tokens(p).shape[1] for p in prompts]
    [11, 7]
    >>> means = last_token_means(model, prompts)  # [layer head pos d_head]
    >>> means.shape
    torch.Size([2, 4, 11, 8])
    >>> with torch.no_grad(), capture.recorded(model, [Z.format(0)]) as z:
    ...     _ = model(model.to_tokens(prompts[0]))
    >>> torch.allclose(means[0, :, 0], z[Z.format(0)][0, 0])  # only prompt 0 reaches back 11
    True
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    m = int(batch.lengths.max())
    sums = torch.zeros(shape.n_layers, shape.n_heads, m, shape.d_head, dtype=torch.float64)
    counts = torch.zeros(m, dtype=torch.float64)
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        # offset[i, p] = how many tokens position p lies before prompt i's last token
        offset = part.lengths.cpu()[:, None] - 1 - torch.arange(part.tokens.shape[1])[None, :]
        real = offset >= 0
        slot = (m - 1 - offset).clamp(0, m - 1)  # where position p lands on the aligned axis
        names = [Z.format(la) for la in range(shape.n_layers)]
        with torch.no_grad(), capture.recorded(model, names) as acts:
            model(part.tokens)
        for layer, name in enumerate(names):
            values = upcast(acts.pop(name)).double().cpu() * real[:, :, None, None]
            flat = values.permute(1, 0, 2, 3).reshape(-1, shape.n_heads, shape.d_head)
            aligned = torch.zeros(m, shape.n_heads, shape.d_head, dtype=torch.float64)
            aligned.index_add_(0, slot.T.reshape(-1), flat)  # [m head d], summed over prompts
            sums[layer] += aligned.permute(1, 0, 2)
        counts.index_add_(0, slot[real], torch.ones(int(real.sum()), dtype=torch.float64))
    return (sums / counts[None, None, :, None]).float()


def _check_means(means: HeadMeans | None, shape: Any) -> None:
    if means is None:
        return
    if not isinstance(means, Tensor) or means.ndim not in (3, 4):
        raise ValueError(
            "means must be Float[Tensor, 'layer head d_head'] (patching.mean_head_outputs) or "
            "Float[Tensor, 'layer head pos d_head'] (ranking.last_token_means)"
        )
    if means.shape[0] != shape.n_layers or means.shape[1] != shape.n_heads:
        raise ValueError(
            f"means of shape {tuple(means.shape)} do not fit a model of {shape.n_layers} layers x "
            f"{shape.n_heads} heads: compute them on this model"
        )


def _replacement(
    means: Float[Tensor, "head d_head"] | Float[Tensor, "head mean_pos d_head"],
    lengths: Int[Tensor, "batch"],
    n_pos: int,
) -> Float[Tensor, "batch pos head d_head"]:
    """The value each ablated position takes: one vector per head, or the position-aligned mean
    counted back from each row's last real token. Positions further back than the means reach
    take the mean over the positions they cover; padding after the last token (which no real
    position can see) takes the last token's mean."""
    if means.ndim == 2:
        return means[None, None].expand(lengths.shape[0], n_pos, *means.shape)
    m = means.shape[1]
    table = torch.cat([means.flip(1), means.mean(1, keepdim=True)], dim=1)  # [head m+1 d]
    offset = lengths.cpu()[:, None] - 1 - torch.arange(n_pos)[None, :]
    index = offset.clamp(0, m)  # m = "further back than the means reach"
    return table[:, index].permute(1, 2, 0, 3)


def ablation_hooks(
    heads: Sequence[tuple[int, int]],
    *,
    means: HeadMeans | None = None,
    lengths: Int[Tensor, "batch"] | None = None,
) -> list[tuple[str, Callable]]:
    """Hooks that ablate heads at `blocks.{l}.attn.hook_z`: zero (means None) or mean ablation.

    Args:
        heads: (layer, head) pairs to ablate.
        means: Float[Tensor, "layer head d_head"] (the same vector at every position, as
            `patching.head_ablation_hooks`) or Float[Tensor, "layer head pos d_head"] from
            `last_token_means`, lined up with each prompt's last real token.
        lengths: real length of each row of the batch the hooks will see (right padding);
            default: every row is unpadded. Position-aligned means need it for padded batches.

    Returns:
        [(hook_name, hook_fn)] for `model.hooks(fwd_hooks=...)`.

    >>> [name for name, _ in ablation_hooks([(1, 2), (0, 1), (1, 0)])]
    ['blocks.0.attn.hook_z', 'blocks.1.attn.hook_z']
    >>> with torch.no_grad(), model.hooks(fwd_hooks=ablation_hooks([(1, 2)])):
    ...     with capture.recorded(model, [Z.format(1)]) as z:
    ...         _ = model(model.to_tokens("I like Italy"))
    >>> bool((z[Z.format(1)][:, :, 2] == 0).all()), bool((z[Z.format(1)][:, :, 1] != 0).any())
    (True, True)
    """
    if means is None or means.ndim == 3:
        return head_ablation_hooks(heads, mode="zero" if means is None else "mean", means=means)
    if means.ndim != 4:
        raise ValueError(f"means must have 3 or 4 dimensions, got {tuple(means.shape)}")
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(int(layer), []).append(int(head))

    def ablate(layer: int, chosen: list[int]):
        index = torch.tensor(chosen)

        def hook(z: Tensor, hook: Any) -> Tensor:
            rows = (
                torch.full((z.shape[0],), z.shape[1], dtype=torch.long)
                if lengths is None
                else lengths
            )
            value = _replacement(means[layer, index], rows, z.shape[1])
            z = z.clone()
            z[:, :, index] = value.to(z.device, z.dtype)
            return z

        return hook

    return [(Z.format(layer), ablate(layer, chosen)) for layer, chosen in sorted(by_layer.items())]


def evaluate_ablated(
    model: HookedModel,
    prompts: Sequence[Any],
    ablated: Sequence[tuple[int, int]],
    *,
    means: HeadMeans | None = None,
    batch_size: int = 16,
) -> Any:
    """`tasks.evaluate` with `ablated` heads zeroed or mean-ablated.

    With position-aligned means the prompts run one token length at a time, so every row of a
    batch is unpadded and lines up with the means at its last token. Returns `tasks.Accuracy`.

    >>> from ra_lens import tasks
    >>> prompts = tasks.build_prompts([("b", "of"), ("c", "is"), ("d", "to")], shots=1, seed=0)
    >>> ablated = evaluate_ablated(model, prompts, [(0, 1), (1, 2)])
    >>> hooks = ablation_hooks([(0, 1), (1, 2)])
    >>> torch.equal(ablated.ranks, tasks.evaluate(model, prompts, fwd_hooks=hooks).ranks)
    True
    """
    from ra_lens import tasks

    if means is None or means.ndim == 3 or not ablated:
        hooks = ablation_hooks(ablated, means=means) if ablated else []
        return tasks.evaluate(model, list(prompts), fwd_hooks=hooks, batch_size=batch_size)
    prompts = list(prompts)
    lengths = tasks.prompt_lengths(prompts, model)
    ranks = torch.empty(len(prompts), dtype=torch.long)
    hooks = ablation_hooks(ablated, means=means)
    for n in sorted(set(lengths)):
        idx = [i for i, m in enumerate(lengths) if m == n]
        acc = tasks.evaluate(
            model, [prompts[i] for i in idx], fwd_hooks=hooks, batch_size=batch_size
        )
        ranks[idx] = acc.ranks
    return tasks.Accuracy.from_ranks(ranks)


# --------------------------------------------------------------------------------------------
# cheap and Todd-style rankings


def first_order_mediation(
    model: HookedModel,
    tokens: Tokens,
    targets: Targets,
    *,
    means: HeadMeans | None = None,
    batch_size: int = 32,
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
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    _check_means(means, shape)
    layers = list(range(shape.n_layers))
    out = torch.zeros(batch.tokens.shape[0], shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        z, grads = _z_and_grads(model, part, targets[rows], layers)
        for la in layers:
            diff = upcast(z[la])
            if means is not None:
                diff = diff - _replacement(means[la], part.lengths, diff.shape[1]).to(diff)
            out[rows, la] = (upcast(grads[la]) * diff).sum((1, 3)).double().cpu()
    return _reduce(out, per_prompt)


def _z_and_grads(
    model: HookedModel, part: Batch, targets: Tensor, layers: list[int]
) -> tuple[dict[int, Tensor], list[Tensor]]:
    """hook_z of each layer and d(sum_i p_i(target))/d hook_z, from one forward + backward."""
    store: dict[str, Tensor] = {}
    seen: dict[int, Tensor] = {}

    def keep(layer: int):
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


def indirect_effect(
    model: HookedModel,
    clean_tokens: Tokens,
    corrupted_tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Todd et al.'s indirect effect: gain in p(target) on shuffled-label prompts when one head's
    last-token output is replaced by its mean last-token output over the clean prompts.

    score[l, h] = mean_i (p_i(corrupted, z[l, h] at the last token := mean_clean) -
    p_i(corrupted)). Only the last token is patched, so clean and corrupted prompts may differ in
    length. One forward pass per head and per batch of corrupted prompts.

    Args:
        clean_tokens: prompts whose mean last-token hook_z is patched in.
        corrupted_tokens: the prompts to patch (e.g. `shuffled_label_prompts` of the clean ones).
        targets: the answer token of each corrupted prompt.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    With one clean prompt patched into itself, its own mean changes nothing:

    >>> indirect_effect(model, ["I like Italy"], ["I like Italy"], [5]).abs().max()
    tensor(0.)
    """
    shape = capture.model_shape(model)
    corrupted = capture.to_batch(model, corrupted_tokens)
    targets = _targets(targets, corrupted.tokens.shape[0])
    mean_last = last_token_means(model, clean_tokens, batch_size=batch_size)[:, :, -1]
    gains = torch.zeros(
        corrupted.tokens.shape[0], shape.n_layers, shape.n_heads, dtype=torch.float64
    )
    heads = [(la, h) for la in range(shape.n_layers) for h in range(shape.n_heads)]

    def patch(head: int, value: Tensor, last: Tensor):
        def hook(z: Tensor, hook: Any) -> Tensor:
            z = z.clone()
            rows = torch.arange(z.shape[0], device=z.device)
            z[rows, last.to(z.device), head] = value.to(z.device, z.dtype)
            return z

        return hook

    with torch.no_grad():
        for rows in _chunks(corrupted.tokens.shape[0], batch_size):
            part = _part(corrupted, rows)
            base = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
            for layer, head in tqdm(heads, desc="indirect effect", disable=not progress):
                hook = patch(head, mean_last[layer, head], part.lengths - 1)
                with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                    after = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
                gains[rows, layer, head] = (after - base).cpu()
    return _reduce(gains, per_prompt)


def temperature_scores(
    model: HookedModel, tokens: Tokens, targets: Targets, *, batch_size: int = 8
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
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    parts = []
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        ra = reversed_attention(model, part, target_nll(targets[rows]), keep="maps")
        assert ra.maps is not None and ra.patterns is not None
        maps, patterns = ra.maps.double(), ra.patterns.double()
        log_a = torch.where(patterns > 0, patterns.clamp_min(1e-300).log(), 0.0)
        scales = torch.tensor(ra.scales, dtype=torch.float64)[None, :, None]
        parts.append((maps * log_a).sum((-2, -1)) * scales)
    return torch.cat(parts).float()


def temperature_ranking(
    model: HookedModel,
    tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 8,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Mean |d loss / d inverse temperature| of each head (`temperature_scores`): an RA-derived
    score without the Frobenius norm. Float[Tensor, "layer head"].

    >>> temperature_ranking(model, ["I like Italy"], [5]).shape
    torch.Size([2, 4])
    """
    values = temperature_scores(model, tokens, targets, batch_size=batch_size).abs()
    return _reduce(values, per_prompt)


# --------------------------------------------------------------------------------------------
# comparing rankings


def head_order(scores: Scores, *, reverse: bool = False) -> list[tuple[int, int]]:
    """(layer, head) pairs from the highest score to the lowest (reverse: lowest first).

    Ties keep (layer, head) order in both directions (a stable sort of the flattened scores).

    >>> head_order(torch.tensor([[0.1, 0.9], [0.5, 0.5]]))
    [(0, 1), (1, 0), (1, 1), (0, 0)]
    >>> head_order(torch.tensor([[0.1, 0.9], [0.5, 0.5]]), reverse=True)
    [(0, 0), (1, 0), (1, 1), (0, 1)]
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be Float[Tensor, 'layer head'], got {tuple(scores.shape)}")
    flat = scores.detach().float().cpu().flatten()
    order = torch.argsort(flat if reverse else -flat, stable=True)
    n_heads = scores.shape[1]
    return [(int(i) // n_heads, int(i) % n_heads) for i in order]


def _average_ranks(values: Tensor) -> Tensor:
    """Ranks 1..n with ties sharing their average rank (as scipy.stats.rankdata)."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    sorted_values = values[order]
    ranks = torch.empty_like(values)
    i, n = 0, values.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Scores, b: Validated[Scores]) -> float:
    """Spearman rank correlation of two rankings over all heads (ties get average ranks).

    NaN when either ranking is constant.

    >>> a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> spearman(a, a ** 3), spearman(a, -a)
    (1.0, -1.0)
    """
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    ra, rb = _average_ranks(a.flatten().cpu()), _average_ranks(b.flatten().cpu())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def top_k_overlap(a: Scores, b: Validated[Scores], k: int = 10) -> float:
    """Fraction of the k top heads of `a` that are also among the k top heads of `b` (ties broken
    as in `head_order`).

    >>> a, b = torch.tensor([[4.0, 3.0], [2.0, 1.0]]), torch.tensor([[4.0, 1.0], [2.0, 3.0]])
    >>> top_k_overlap(a, b, k=2)  # top 2 of a: (0, 0), (0, 1); of b: (0, 0), (1, 1)
    0.5
    """
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if not 1 <= k <= a.numel():
        raise ValueError(f"k must be between 1 and the number of heads ({a.numel()}), got {k}")
    top_a, top_b = set(head_order(a)[:k]), set(head_order(b)[:k])
    return len(top_a & top_b) / k


# --------------------------------------------------------------------------------------------
# statistics: bootstrap over prompts


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile bootstrap interval.

    Attributes:
        estimate: the statistic on the data as observed.
        low, high: the (1 - level) / 2 and (1 + level) / 2 quantiles of the bootstrap statistics.
        level: coverage (0.95); n: prompts resampled; n_boot: resamples; seed: their seed.
    """

    estimate: float
    low: float
    high: float
    level: float
    n: int
    n_boot: int
    seed: int

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self) -> dict[str, float | int | None]:
        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "estimate": clean(self.estimate),
            "low": clean(self.low),
            "high": clean(self.high),
            "level": self.level,
            "n": self.n,
            "n_boot": self.n_boot,
            "seed": self.seed,
        }


def bootstrap_indices(n: int, n_boot: int = 2000, seed: int = 0) -> Int[Tensor, "n_boot n"]:
    """Resampled prompt indices (with replacement) from `torch.Generator().manual_seed(seed)`:
    the same seed gives the same resamples whatever the global RNG state.

    >>> bootstrap_indices(5, n_boot=3, seed=0).shape, bool((bootstrap_indices(5, 3) < 5).all())
    (torch.Size([3, 5]), True)
    >>> torch.equal(bootstrap_indices(5, 3, seed=7), bootstrap_indices(5, 3, seed=7))
    True
    """
    if n < 1 or n_boot < 1:
        raise ValueError(f"need n >= 1 prompts and n_boot >= 1 resamples, got {n} and {n_boot}")
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, n, (n_boot, n), generator=generator)


def _interval(estimate: float, stats: Tensor, level: float, n: int, n_boot: int, seed: int):
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    stats = stats.double()
    stats = stats[~stats.isnan()]
    if stats.numel() == 0:
        return Interval(estimate, float("nan"), float("nan"), level, n, n_boot, seed)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(stats, q).tolist()
    return Interval(estimate, low, high, level, n, n_boot, seed)


def bootstrap_mean(
    values: Float[Tensor, "n"], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Mean of per-prompt values with a percentile bootstrap interval over prompts.

    >>> print(bootstrap_mean(torch.tensor([0.0, 1.0, 0.0, 1.0]), n_boot=500))
    0.500 [0.000, 1.000]
    """
    values = values.detach().double().cpu().reshape(-1)
    index = bootstrap_indices(values.numel(), n_boot, seed)
    return _interval(
        float(values.mean()), values[index].mean(1), level, values.numel(), n_boot, seed
    )


def per_prompt_auc(curve: AblationCurve, k: int = 1) -> Float[Tensor, "n"]:
    """Each test prompt's own area under its 0/1 top-k curve (trapezoid rule over the fractions,
    sorted). Their mean is `curve.auc_at(k)`, which is why a bootstrap over prompts is exact
    resampling of the AUC.

    >>> from ra_lens.tasks import Accuracy
    >>> ranks = [[9, 9], [0, 9], [0, 0]]  # 2 prompts; prompt 0 right from p = 0.5 on, prompt 1 at 1
    >>> accuracies = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accuracies)
    >>> per_prompt_auc(curve), curve.auc
    (tensor([0.7500, 0.2500], dtype=torch.float64), 0.5)
    """
    order = sorted(range(len(curve.fractions)), key=lambda j: curve.fractions[j])
    xs = torch.tensor([curve.fractions[j] for j in order], dtype=torch.float64)
    hits = torch.stack([(curve.accuracies[j].ranks < k).double() for j in order])  # [step n]
    if len(order) < 2:
        return torch.zeros(hits.shape[1], dtype=torch.float64)
    widths = (xs[1:] - xs[:-1])[:, None]
    return (widths * (hits[1:] + hits[:-1]) / 2).sum(0)


def auc_interval(
    curve: AblationCurve,
    k: int = 1,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Top-k ablation AUC with a percentile bootstrap interval over the test prompts.

    >>> from ra_lens.tasks import Accuracy
    >>> ranks = [[9, 9, 9, 9], [0, 0, 9, 9], [0, 0, 0, 9]]
    >>> accuracies = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accuracies)
    >>> interval = auc_interval(curve, n_boot=500)
    >>> interval.estimate == curve.auc, interval.low <= curve.auc <= interval.high
    (True, True)
    """
    interval = bootstrap_mean(per_prompt_auc(curve, k), n_boot=n_boot, seed=seed, level=level)
    return replace(interval, estimate=curve.auc_at(k))


def paired_auc_difference(
    a: AblationCurve,
    b: AblationCurve,
    k: int = 1,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """AUC(a) - AUC(b) with a paired bootstrap: both curves resampled on the same test prompts.

    Raises:
        ValueError: the curves were not measured on the same number of prompts.

    >>> from ra_lens.tasks import Accuracy
    >>> def curve(*ranks):
    ...     accs = [Accuracy.from_ranks(torch.tensor(r)) for r in ranks]
    ...     return AblationCurve([0.0, 1.0], [0, 2], accs)
    >>> good, bad = curve([0, 0, 9], [0, 0, 0]), curve([9, 9, 9], [0, 0, 0])
    >>> print(paired_auc_difference(good, bad, n_boot=500))
    0.333 [0.000, 0.500]
    """
    pa, pb = per_prompt_auc(a, k), per_prompt_auc(b, k)
    if pa.shape != pb.shape:
        raise ValueError(
            f"curves on {pa.numel()} and {pb.numel()} prompts: a paired bootstrap needs both "
            "measured on the same test prompts"
        )
    interval = bootstrap_mean(pa - pb, n_boot=n_boot, seed=seed, level=level)
    return replace(interval, estimate=a.auc_at(k) - b.auc_at(k))


def _fast_ranks(values: Tensor) -> Tensor:
    """Average ranks; argsort of argsort when there are no ties (the usual case for scores)."""
    if torch.unique(values).numel() < values.numel():
        return _average_ranks(values)
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks[torch.argsort(values)] = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return ranks


def _spearman_flat(a: Tensor, b: Tensor) -> float:
    ra, rb = _fast_ranks(a), _fast_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def spearman_interval(
    a: Scores | PerPrompt,
    b: Scores | PerPrompt,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Spearman correlation of two rankings with a bootstrap interval over the ranking prompts.

    A per-prompt ranking, Float[Tensor, "batch layer head"], is resampled over its prompts and
    averaged; a fixed one, Float[Tensor, "layer head"] (random, layer index), stays as it is. Two
    per-prompt rankings on the same number of prompts are resampled together (paired: the same
    prompts); otherwise each gets its own resamples (streams seeded `seed` and `seed + 1`).
    The estimate is the Spearman of the two means. NaN resamples (a constant ranking) are dropped.

    >>> torch.manual_seed(0) and None
    >>> a = torch.rand(20, 2, 4)  # per prompt: [batch layer head]
    >>> interval = spearman_interval(a, a + 0.01 * torch.rand(20, 2, 4), n_boot=200)
    >>> interval.estimate > 0.9, interval.n
    (True, 20)
    """
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    mean_a = a.mean(0) if a.ndim == 3 else a
    mean_b = b.mean(0) if b.ndim == 3 else b
    if mean_a.shape != mean_b.shape:
        raise ValueError(
            f"rankings of different shapes {tuple(mean_a.shape)} and {tuple(mean_b.shape)}"
        )
    estimate = spearman(mean_a.float(), mean_b.float())
    index_a = bootstrap_indices(a.shape[0], n_boot, seed) if a.ndim == 3 else None
    if b.ndim == 3 and index_a is not None and b.shape[0] == a.shape[0]:
        index_b = index_a
    else:
        index_b = bootstrap_indices(b.shape[0], n_boot, seed + 1) if b.ndim == 3 else None
    stats = torch.empty(n_boot, dtype=torch.float64)
    for i in range(n_boot):
        sa = a[index_a[i]].mean(0) if index_a is not None else mean_a
        sb = b[index_b[i]].mean(0) if index_b is not None else mean_b
        stats[i] = _spearman_flat(sa.flatten(), sb.flatten())
    n = max(a.shape[0] if a.ndim == 3 else 0, b.shape[0] if b.ndim == 3 else 0)
    return _interval(estimate, stats, level, n, n_boot, seed)


# --------------------------------------------------------------------------------------------
# ablation curves


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


@dataclass(frozen=True)
class AblationCurve:
    """Task accuracy when only the top (or, with reverse, bottom) fraction of heads is kept.

    Attributes:
        fractions: fractions p of heads kept, in the order given.
        n_kept: number of heads kept at each p, round(p * n_heads_total).
        accuracies: `tasks.Accuracy` at each p (every other head zeroed at hook_z).
        reverse: False: the highest-scored heads are kept; True: the lowest-scored.

    >>> from ra_lens.tasks import Accuracy
    >>> accs = [Accuracy.from_ranks(torch.tensor(r)) for r in ([5, 5], [0, 5], [0, 0])]
    >>> curve = AblationCurve([0.0, 0.5, 1.0], [0, 1, 2], accs)
    >>> curve.top1, curve.auc, curve.auc_top3
    ([0.0, 0.5, 1.0], 0.5, 0.5)
    """

    fractions: list[float]
    n_kept: list[int]
    accuracies: list[Any]
    reverse: bool = False

    def curve(self, k: int = 1) -> list[float]:
        """Top-k accuracy at each fraction."""
        return [a.top(k) for a in self.accuracies]

    @property
    def top1(self) -> list[float]:
        return self.curve(1)

    @property
    def top3(self) -> list[float]:
        return self.curve(3)

    def auc_at(self, k: int = 1) -> float:
        """Area under the top-k curve over the fractions (trapezoid rule, `trapezoid_auc`).

        Over p in [0, 1] when the fractions span it, so 1.0 = perfect accuracy everywhere."""
        return trapezoid_auc(self.fractions, self.curve(k))

    @property
    def auc(self) -> float:
        """Area under the top-1 curve."""
        return self.auc_at(1)

    @property
    def auc_top3(self) -> float:
        return self.auc_at(3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fractions": list(self.fractions),
            "n_kept": list(self.n_kept),
            "reverse": self.reverse,
            "top1": self.top1,
            "top3": self.top3,
            "auc": self.auc,
            "auc_top3": self.auc_top3,
        }


def check_fractions(fractions: Sequence[float]) -> list[float]:
    """Fractions as floats, each in [0, 1], at least one; or a ValueError.

    >>> check_fractions([0, 0.5, 1])
    [0.0, 0.5, 1.0]
    >>> check_fractions([1.5])
    Traceback (most recent call last):
    ValueError: fractions of heads kept must lie in [0, 1], got [1.5]
    """
    out = [float(p) for p in fractions]
    if not out:
        raise ValueError("no fractions given: pass e.g. (0, 0.1, ..., 1)")
    bad = [p for p in out if not 0.0 <= p <= 1.0]
    if bad:
        raise ValueError(f"fractions of heads kept must lie in [0, 1], got {bad}")
    return out


def kept_heads(scores: Scores, fraction: float, *, reverse: bool = False) -> list[tuple[int, int]]:
    """The round(fraction x n_heads) heads kept at `fraction`: the top ones, or the bottom ones.

    >>> scores = torch.tensor([[0.1, 0.9], [0.5, 0.3]])
    >>> kept_heads(scores, 0.5), kept_heads(scores, 0.5, reverse=True)
    ([(0, 1), (1, 0)], [(0, 0), (1, 1)])
    """
    (fraction,) = check_fractions([fraction])
    order = head_order(scores, reverse=reverse)
    return order[: math.floor(fraction * len(order) + 0.5)]


def ablation_curve(
    model: HookedModel,
    prompts: Sequence[Any],
    scores: Validated[Scores],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    reverse: bool = False,
    mode: Validated[Literal["zero", "mean"]] = "zero",
    means: HeadMeans | None = None,
    batch_size: int = 16,
    evaluate: Callable[[list[tuple[int, int]]], Any] | None = None,
) -> AblationCurve:
    """Keep the top p of heads under `scores` (reverse: the bottom p), zero all the others' outputs
    at hook_z (or, with mode="mean", replace them by `means`), and measure the task's top-k
    accuracy, for each p in `fractions`.

    Args:
        model: a TransformerLens model.
        prompts: `tasks.Prompt`s (any lengths: `tasks.evaluate` reads each prompt's last token).
        scores: Float[Tensor, "layer head"] of the model's shape; larger = more important.
        fractions: fractions of heads kept, each in [0, 1].
        reverse: keep the lowest-scored heads instead.
        mode, means: as in `ablation_hooks` ("mean" needs `means =
            last_token_means(model, held_out_tokens)` or `mean_head_outputs(...)`).
        evaluate: optional `ablated heads -> Accuracy` replacing `tasks.evaluate` with
            `head_ablation_hooks` (e.g. to memoise runs shared by several curves).

    Returns:
        AblationCurve with one `Accuracy` per fraction; `.auc` is the top-1 area.

    >>> from ra_lens import tasks
    >>> prompts = tasks.build_prompts([("b", "of"), ("c", "is"), ("d", "to")], shots=1, seed=0)
    >>> curve = ablation_curve(model, prompts, random_ranking(2, 4), fractions=[0, 0.5, 1])
    >>> curve.n_kept
    [0, 4, 8]
    >>> unablated = tasks.evaluate(model, prompts)
    >>> torch.equal(curve.accuracies[-1].ranks, unablated.ranks)  # p = 1: no head ablated
    True
    """

    shape = capture.model_shape(model)
    scores = check_scores(scores, shape.n_layers, shape.n_heads)
    fractions = check_fractions(fractions)
    if not prompts:
        raise ValueError("no prompts to evaluate the ablations on")

    def default(ablated: list[tuple[int, int]]) -> Any:
        chosen = means if mode == "mean" else None
        return evaluate_ablated(model, prompts, ablated, means=chosen, batch_size=batch_size)

    if evaluate is None:
        head_ablation_hooks([], mode=mode, means=means)  # checks mode and means up front
    run = evaluate or default
    order = head_order(scores, reverse=reverse)
    n_kept, accuracies = [], []
    for p in fractions:
        k = math.floor(p * len(order) + 0.5)
        n_kept.append(k)
        accuracies.append(run(sorted(order[k:])))
    return AblationCurve(fractions, n_kept, accuracies, reverse)


def exact_qk_attribution(
    model: HookedModel,
    clean_tokens: Tokens,
    corrupted_tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
) -> Scores:
    """Exact-softmax attribution of each head's queries and keys (AtP*'s QK fix).

    score[l, h] = mean_i of the estimated gain in p(target) when head h's queries are taken from
    the clean run, plus the part of the estimate for its key/value head's keys that flows through
    h's pattern (`AttentionAttribution.key_by_head`), both summed over positions:
    `attention_attribution(..., nodes=("query", "key"), method="exact", direction="denoise")`.
    One forward + backward pass on the corrupted prompts and one forward pass on the clean ones
    per batch, for all heads; unlike a gradient it does not vanish on saturated attention rows.

    Returns:
        Float[Tensor, "layer head"].

    >>> clean = model.to_tokens("I like Italy")
    >>> corrupted = clean.clone()
    >>> corrupted[0, -1] = 7  # another last token, the same length
    >>> exact_qk_attribution(model, clean, corrupted, [5]).shape
    torch.Size([2, 4])
    >>> bool(exact_qk_attribution(model, clean, clean, [5]).abs().max() < 1e-12)  # nothing moved
    True
    """
    from ra_lens.attribution import attention_attribution
    from ra_lens.metrics import target_prob

    clean, corrupted, targets = _paired(model, clean_tokens, corrupted_tokens, targets)
    shape = capture.model_shape(model)
    total = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(clean.tokens.shape[0], batch_size):
        att = attention_attribution(
            model,
            _part(clean, rows),
            _part(corrupted, rows),
            target_prob(targets[rows]),
            nodes=("query", "key"),
        )
        assert att.key_by_head is not None
        total += att.by_position["query"].double().sum((0, 3))
        total += att.key_by_head.double().sum((0, 3))
    return (total / clean.tokens.shape[0]).float()
