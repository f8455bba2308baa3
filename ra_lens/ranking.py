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

`ablation_curve` keeps the top (or bottom) fraction of heads under a ranking, zeroes every other
head's output at hook_z, and records the task's top-k accuracy; `AblationCurve.auc` is the area
under that curve. `spearman` and `top_k_overlap` compare two rankings.

    >>> scores = ra_ranking(model, tokens, targets)                        # doctest: +SKIP
    >>> curve = ablation_curve(model, test_prompts, scores)                # doctest: +SKIP
    >>> curve.auc, curve.top1                                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ra_lens import capture
from ra_lens.capture import PATTERN, RESID_PRE, Batch, Z
from ra_lens.core import reversed_attention
from ra_lens.math import frobenius_norms, upcast
from ra_lens.metrics import target_nll
from ra_lens.patching import head_ablation_hooks

__all__ = [
    "DEFAULT_FRACTIONS",
    "AblationCurve",
    "ablation_curve",
    "activation_patching",
    "attribution_patching",
    "causal_mediation",
    "check_fractions",
    "check_scores",
    "forward_ranking",
    "head_order",
    "kept_heads",
    "layer_ranking",
    "ra_ranking",
    "random_ranking",
    "spearman",
    "target_probs",
    "top_k_overlap",
]

Tokens = Int[Tensor, "batch pos"] | Batch | str | Sequence[str]
Targets = Int[Tensor, " batch"] | Sequence[int]
Scores = Float[Tensor, "layer head"]

#: p = 0, 10, ..., 100% of heads kept.
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(i / 10 for i in range(11))


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
    logits: Float[Tensor, "batch pos vocab"], lengths: Int[Tensor, " batch"], targets: Tensor
) -> Float[Tensor, " batch"]:
    """p(target) at each prompt's last real position, in float32 or wider."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    last = upcast(logits[rows, lengths.to(logits.device) - 1])
    return last.softmax(-1)[rows, targets.to(logits.device)]


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def check_scores(scores: Any, n_layers: int, n_heads: int, what: str = "scores") -> Scores:
    """Scores as a finite float CPU tensor of shape [n_layers, n_heads], or a clear error."""
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
    model: Any,
    tokens: Tokens,
    targets: Targets,
    *,
    loss_row: bool = False,
    batch_size: int = 8,
) -> Scores:
    """Mean Reversed Attention norm of each head, for each prompt's own -log p(target).

    Args:
        model: a TransformerLens model.
        tokens: Int[Tensor, "batch pos"], a Batch or strings (right-padded; lengths respected).
        targets: Int[Tensor, "batch"], the target token of each prompt at its last position.
        loss_row: False: Frobenius norm of the whole [query key] map (kept as norms only, so
            memory stays O(layer x head)); True: norm of the map's row at the loss position
            (each prompt's last real token) only, which needs the maps (keep="maps").
        batch_size: prompts per forward + backward pass.

    Returns:
        Float[Tensor, "layer head"]: the mean over prompts (equals
        `reversed_attention(model, tokens, target_nll(targets)).head_norms()` when loss_row is
        False).
    """
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    total, n = None, 0
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        ra = reversed_attention(
            model, part, target_nll(targets[rows]), keep="maps" if loss_row else "norms"
        )
        if loss_row:
            assert ra.maps is not None
            index = torch.arange(ra.maps.shape[0])
            rows_at_loss = ra.maps[index, :, :, part.lengths - 1]  # [batch layer head key]
            norms = rows_at_loss.double().pow(2).sum(-1).sqrt().float()
        else:
            norms = ra.norms
        total = norms.sum(0) if total is None else total + norms.sum(0)
        n += norms.shape[0]
    assert total is not None
    return total / n


def forward_ranking(model: Any, tokens: Tokens, *, batch_size: int = 8) -> Scores:
    """Mean Frobenius norm of each head's forward attention pattern (real positions only).

    One forward pass per batch, no gradient; equals `reversed_attention(...).forward_norms()`.

    Returns:
        Float[Tensor, "layer head"].
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    sums = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(batch.tokens.shape[0], batch_size):
        part = _part(batch, rows)
        positions = torch.arange(part.tokens.shape[1], device=part.tokens.device)
        real = positions[None, :] < part.lengths.to(part.tokens.device)[:, None]
        keep = real[:, None, :, None] & real[:, None, None, :]

        def record(layer: int, keep: Tensor = keep):
            def hook(pattern: Tensor, hook: Any) -> None:
                norms = frobenius_norms(upcast(pattern) * keep.to(pattern.device))
                sums[layer] += norms.double().sum(0).cpu()

            return hook

        hooks = [(PATTERN.format(la), record(la)) for la in range(shape.n_layers)]
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(part.tokens)
    return (sums / batch.tokens.shape[0]).float()


def random_ranking(n_layers: int, n_heads: int, seed: int = 0) -> Scores:
    """Uniform random scores from `torch.Generator().manual_seed(seed)`: the same seed, the same
    ranking, whatever the global RNG state. Float[Tensor, "layer head"]."""
    if n_layers < 1 or n_heads < 1:
        raise ValueError(f"need at least one layer and one head, got {n_layers} x {n_heads}")
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand(n_layers, n_heads, generator=generator)


def layer_ranking(n_layers: int, n_heads: int) -> Scores:
    """The layer index as the score (later layers rank higher; within a layer, ties keep head
    order, see `head_order`). Float[Tensor, "layer head"]."""
    if n_layers < 1 or n_heads < 1:
        raise ValueError(f"need at least one layer and one head, got {n_layers} x {n_heads}")
    return torch.arange(n_layers, dtype=torch.float32)[:, None].expand(n_layers, n_heads).clone()


def causal_mediation(
    model: Any,
    tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
) -> Scores:
    """Drop in p(target) when one head's output is zeroed, mean over prompts.

    score[l, h] = mean_i (p_i - p_i with head (l, h) zeroed at hook_z), p at each prompt's last
    position. One forward pass per head and per batch of prompts (n_layers x n_heads x
    ceil(N / batch_size) passes), plus one clean pass per batch. Positive = the head helps.

    Returns:
        Float[Tensor, "layer head"].
    """
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, tokens)
    targets = _targets(targets, batch.tokens.shape[0])
    drops = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    heads = [(la, h) for la in range(shape.n_layers) for h in range(shape.n_heads)]
    with torch.no_grad():
        for rows in _chunks(batch.tokens.shape[0], batch_size):
            part = _part(batch, rows)
            before = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
            for layer, head in tqdm(heads, desc="causal mediation", disable=not progress):
                with model.hooks(fwd_hooks=head_ablation_hooks([(layer, head)])):
                    after = target_probs(model(part.tokens), part.lengths, targets[rows]).double()
                drops[layer, head] += (before - after).sum().cpu()
    return (drops / batch.tokens.shape[0]).float()


def _paired(
    model: Any, clean: Tokens, corrupted: Tokens, targets: Targets
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
    model: Any,
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
    `baseline=True` (its `PatchingResult.effect()`), on a clean cache of hook_z only. This works
    on TransformerBridge in TL 4.3 (it only needs `run_with_cache`, `run_with_hooks` and the
    hook_z alias); the tests check it against a hand-written hook loop.

    Args:
        clean_tokens, corrupted_tokens: prompts of equal token lengths, pair by pair.
        targets: the clean answer token of each prompt.

    Returns:
        Float[Tensor, "layer head"].
    """
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    clean, corrupted, targets = _paired(model, clean_tokens, corrupted_tokens, targets)
    shape = capture.model_shape(model)
    total = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    z_names = {Z.format(la) for la in range(shape.n_layers)}
    for rows in _chunks(clean.tokens.shape[0], batch_size):
        clean_part, corrupted_part = _part(clean, rows), _part(corrupted, rows)
        lengths, part_targets = clean_part.lengths, targets[rows]

        def metric(logits: Tensor, lengths: Tensor = lengths, part_targets: Tensor = part_targets):
            return target_probs(logits, lengths, part_targets)

        with torch.no_grad(), _tl_progress(progress):
            _, cache = model.run_with_cache(
                clean_part.tokens, names_filter=lambda name: name in z_names
            )
            result = get_act_patch_attn_head_out_all_pos(
                model, corrupted_part.tokens, cache, metric, reduce="mean", baseline=True
            )
        total += result.effect().double().cpu() * (rows.stop - rows.start)
    return (total / clean.tokens.shape[0]).float()


def attribution_patching(
    model: Any,
    clean_tokens: Tokens,
    corrupted_tokens: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
) -> Scores:
    """First-order estimate of `activation_patching`: gradient x activation difference at hook_z.

    score[l, h] = mean_i sum_{pos, d} dp_i/dz[l, h] (corrupted run) * (z_clean - z_corrupted)[l, h],
    p_i = p(target) at the last position. One clean forward pass, one corrupted forward pass and
    one backward pass per batch, for all heads.

    Returns:
        Float[Tensor, "layer head"].
    """
    clean, corrupted, targets = _paired(model, clean_tokens, corrupted_tokens, targets)
    shape = capture.model_shape(model)
    layers = list(range(shape.n_layers))
    total = torch.zeros(shape.n_layers, shape.n_heads, dtype=torch.float64)
    for rows in _chunks(clean.tokens.shape[0], batch_size):
        clean_part, corrupted_part = _part(clean, rows), _part(corrupted, rows)
        clean_z = _z_activations(model, clean_part.tokens, layers)
        store: dict[str, Tensor] = {}
        seen: dict[int, Tensor] = {}

        def keep(layer: int, seen: dict[int, Tensor] = seen):
            # On TransformerBridge hook_z sees a view of o's input; only a tensor the hook
            # returns is used downstream, so return a clone and differentiate with respect to it.
            def hook(z: Tensor, hook: Any) -> Tensor:
                z = z.clone()
                seen[layer] = z
                return z

            return hook

        fwd = [(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]
        fwd += [(Z.format(la), keep(la)) for la in layers]
        with capture.preserved_state(model), torch.enable_grad(), model.hooks(fwd_hooks=fwd):
            logits = model(corrupted_part.tokens)
            probs = target_probs(logits, corrupted_part.lengths, targets[rows])
            grads = torch.autograd.grad(probs.sum(), [seen[la] for la in layers], allow_unused=True)
        missing = [la for la, grad in zip(layers, grads, strict=True) if grad is None]
        if missing:
            raise RuntimeError(
                f"no gradient reached hook_z of layers {missing}: attribution patching needs "
                "hook_z in the autograd graph of the output"
            )
        for la, grad in zip(layers, grads, strict=True):
            diff = clean_z[la].to(grad.device) - seen[la].detach()
            total[la] += (upcast(grad) * upcast(diff)).sum((0, 1, 3)).double().cpu()
    return (total / clean.tokens.shape[0]).float()


def _z_activations(model: Any, tokens: Tensor, layers: list[int]) -> dict[int, Tensor]:
    """hook_z of each layer, [batch pos head d_head], from one forward pass without gradient."""
    seen: dict[int, Tensor] = {}

    def keep(layer: int):
        def hook(z: Tensor, hook: Any) -> None:
            seen[layer] = z.detach()

        return hook

    with torch.no_grad(), model.hooks(fwd_hooks=[(Z.format(la), keep(la)) for la in layers]):
        model(tokens)
    return seen


# --------------------------------------------------------------------------------------------
# comparing rankings


def head_order(scores: Scores, *, reverse: bool = False) -> list[tuple[int, int]]:
    """(layer, head) pairs from the highest score to the lowest (reverse: lowest first).

    Ties keep (layer, head) order in both directions (a stable sort of the flattened scores).
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


def spearman(a: Scores, b: Scores) -> float:
    """Spearman rank correlation of two rankings over all heads (ties get average ranks).

    NaN when either ranking is constant.
    """
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    ra, rb = _average_ranks(a.flatten().cpu()), _average_ranks(b.flatten().cpu())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def top_k_overlap(a: Scores, b: Scores, k: int = 10) -> float:
    """Fraction of the k top heads of `a` that are also among the k top heads of `b` (ties broken
    as in `head_order`)."""
    if a.shape != b.shape:
        raise ValueError(f"rankings of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if not 1 <= k <= a.numel():
        raise ValueError(f"k must be between 1 and the number of heads ({a.numel()}), got {k}")
    top_a, top_b = set(head_order(a)[:k]), set(head_order(b)[:k])
    return len(top_a & top_b) / k


# --------------------------------------------------------------------------------------------
# ablation curves


@dataclass(frozen=True)
class AblationCurve:
    """Task accuracy when only the top (or, with reverse, bottom) fraction of heads is kept.

    Attributes:
        fractions: fractions p of heads kept, in the order given.
        n_kept: number of heads kept at each p, round(p * n_heads_total).
        accuracies: `tasks.Accuracy` at each p (every other head zeroed at hook_z).
        reverse: False: the highest-scored heads are kept; True: the lowest-scored.
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
        """Area under the top-k curve over the fractions (trapezoid rule, `viz.trapezoid_auc`).

        Over p in [0, 1] when the fractions span it, so 1.0 = perfect accuracy everywhere."""
        from ra_lens.viz import trapezoid_auc

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
    """Fractions as floats, each in [0, 1], at least one; or a ValueError."""
    out = [float(p) for p in fractions]
    if not out:
        raise ValueError("no fractions given: pass e.g. (0, 0.1, ..., 1)")
    bad = [p for p in out if not 0.0 <= p <= 1.0]
    if bad:
        raise ValueError(f"fractions of heads kept must lie in [0, 1], got {bad}")
    return out


def kept_heads(scores: Scores, fraction: float, *, reverse: bool = False) -> list[tuple[int, int]]:
    """The round(fraction x n_heads) heads kept at `fraction`: the top ones, or the bottom ones."""
    (fraction,) = check_fractions([fraction])
    order = head_order(scores, reverse=reverse)
    return order[: math.floor(fraction * len(order) + 0.5)]


def ablation_curve(
    model: Any,
    prompts: Sequence[Any],
    scores: Scores,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    reverse: bool = False,
    mode: Literal["zero", "mean"] = "zero",
    means: Float[Tensor, "layer head d_head"] | None = None,
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
        mode, means: as in `head_ablation_hooks` ("mean" needs `means =
            mean_head_outputs(model, tokens)`).
        evaluate: optional `ablated heads -> Accuracy` replacing `tasks.evaluate` with
            `head_ablation_hooks` (e.g. to memoise runs shared by several curves).

    Returns:
        AblationCurve with one `Accuracy` per fraction; `.auc` is the top-1 area.
    """
    from ra_lens import tasks

    shape = capture.model_shape(model)
    scores = check_scores(scores, shape.n_layers, shape.n_heads)
    fractions = check_fractions(fractions)
    if not prompts:
        raise ValueError("no prompts to evaluate the ablations on")

    def default(ablated: list[tuple[int, int]]) -> Any:
        hooks = head_ablation_hooks(ablated, mode=mode, means=means) if ablated else []
        return tasks.evaluate(model, list(prompts), fwd_hooks=hooks, batch_size=batch_size)

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
    model: Any,
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
