"""The ranking engine: the one loop every head ranking runs in, and the checks it shares.

A ranking is a small scorer, `scorer(model, part) -> Float[Tensor, "batch layer head"]` (one score
per prompt of the part and head; or, for a scorer that can only average, Float[Tensor, "layer
head"], the part's mean). `rank` does everything else, once for every ranking:

- prompts to a right-padded `Batch` (`capture.to_batch`), targets checked (`check_targets`:
  integer ids inside the vocabulary, one per prompt), clean/corrupted pairs checked position by
  position;
- chunks of `batch_size` prompts, each cut to its own longest prompt;
- the model in eval mode with every module's mode, requires_grad and .grad restored afterwards,
  claimed for this thread (`capture.preserved_state`): a ranking never depends on the mode the
  caller left the model in (dropout would make it random);
- a progress bar over prompts (`Part.done` moves it inside a part);
- the mean over prompts, or each prompt's scores (`per_prompt=True`, for bootstrap intervals).

    >>> def last_logit_norm(model, part):  # a toy scorer: one value per prompt, every head
    ...     logits = model(part.prompts.tokens)
    ...     value = logits[:, -1].norm(dim=-1).double()
    ...     return value[:, None, None].expand(-1, 2, 4)
    >>> rank(model, ["I like Italy", "Q: hot"], [5, 7], last_logit_norm, per_prompt=True).shape
    torch.Size([2, 2, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ra_lens import capture, pairs
from ra_lens._typing import Validated
from ra_lens.capture import Batch, HookedModel
from ra_lens.checks import check_count
from ra_lens.math import upcast
from ra_lens.progress import tqdm
from ra_lens.types import Scores, Targets, Tokens

#: The progress bar counts prompts, in fractions while a part is under way: shown in percent.
_BAR = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}"

#: Each prompt's score of each head.
PerPrompt = Float[Tensor, "batch layer head"]


@dataclass(frozen=True)
class Part:
    """One chunk of prompts handed to a scorer.

    Attributes:
        rows: where the part sits among all prompts.
        prompts: its prompts, cut to the longest of them (right padding, real lengths kept).
        targets: Int[Tensor, "batch"], one target token per prompt (CPU).
        corrupted: the paired corrupted prompts (same token lengths), for patching rankings.
        per_prompt: whether the caller wants each prompt's scores (a scorer that can only give
            the part's mean must refuse).
        done: a scorer with a long loop (one pass per head) reports the fraction of the part it
            has done, for the progress bar.
    """

    rows: slice
    prompts: Batch
    targets: Tensor
    corrupted: Batch | None = None
    per_prompt: bool = False
    done: Callable[[float], None] = lambda fraction: None

    @property
    def size(self) -> int:
        return cast(int, self.rows.stop - self.rows.start)  # typeshed: slice's fields are Any


Scorer = Callable[[HookedModel, Part], Tensor]


def check_targets(model: HookedModel, targets: Targets, n: int) -> Int[Tensor, "n"]:
    """One integer target id per prompt, inside the model's vocabulary; or a clear error.

    Float ids are refused rather than truncated, negative ids rather than counted from the end.

    >>> check_targets(model, [5, 7], 2)
    tensor([5, 7])
    >>> check_targets(model, [5, -1], 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: target ids [5, -1] must lie in 0..299 (the model's vocabulary): ...
    """
    if isinstance(targets, Tensor):
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(
                f"targets must be integer token ids, got a {targets.dtype} tensor: pass "
                "torch.tensor(ids, dtype=torch.long) (float ids would be truncated)"
            )
        ids = targets.detach().to("cpu", torch.long).reshape(-1)
    else:
        if isinstance(targets, (str, bytes)) or not hasattr(targets, "__iter__"):
            raise TypeError(f"targets must be a sequence of token ids, got {targets!r}")
        values = list(targets)
        bad = [t for t in values if isinstance(t, bool) or not _is_int(t)]
        if bad:
            raise TypeError(
                f"targets must be integer token ids, got {bad[0]!r}: pass one id per prompt, "
                "e.g. model.to_single_token(' Paris')"
            )
        ids = torch.tensor([int(t) for t in values], dtype=torch.long)
    if ids.shape[0] != n:
        raise ValueError(
            f"{ids.shape[0]} targets for {n} prompts: give one target token per prompt"
        )
    vocab = getattr(model.cfg, "d_vocab", None)
    low_bad = bool((ids < 0).any())
    if low_bad or (vocab is not None and bool((ids >= int(vocab)).any())):
        top = f"0..{int(vocab) - 1}" if vocab is not None else "0 and up"
        raise ValueError(
            f"target ids {ids.tolist()} must lie in {top} (the model's vocabulary): a negative id "
            "is not counted from the end; use model.to_single_token(' word')"
        )
    return ids


def _is_int(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, float))


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


def rank(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets | None,
    scorer: Scorer,
    *,
    corrupted: Tokens | None = None,
    batch_size: int = 8,
    progress: bool = False,
    per_prompt: bool = False,
    desc: str = "ranking",
) -> Scores | PerPrompt:
    """Run `scorer` over `prompts` in chunks of `batch_size`, in eval mode, and reduce.

    Args:
        model: a TransformerLens model; its modes, flags and gradients are restored afterwards.
        prompts: token ids, a Batch or strings.
        targets: one token id per prompt (None for scorers that need none).
        scorer: `(model, Part) -> Float[Tensor, "batch layer head"]` per prompt, or
            Float[Tensor, "layer head"], the part's mean (then per_prompt is refused).
        corrupted: prompts paired with `prompts`, of equal token lengths (patching rankings).
        per_prompt: return Float[Tensor, "batch layer head"] instead of the mean over prompts.

    Returns:
        Float[Tensor, "layer head"] (or per prompt), float32 on the CPU.
    """
    check_count(batch_size, "batch_size")
    if corrupted is None:
        batch, other = capture.to_batch(model, prompts), None
    else:
        batch, other = pairs.paired(model, prompts, corrupted)
    n = batch.tokens.shape[0]
    ids = (
        check_targets(model, targets, n)
        if targets is not None
        else torch.zeros(n, dtype=torch.long)
    )
    per: list[Tensor] = []
    total: Tensor | None = None
    with (
        capture.preserved_state(model),
        tqdm(total=n, desc=desc, disable=not progress, bar_format=_BAR) as bar,
    ):
        for rows in pairs.chunks(n, batch_size):

            def done(fraction: float, rows: slice = rows) -> None:
                bar.update(rows.start + fraction * (rows.stop - rows.start) - bar.n)

            part = Part(
                rows,
                batch.rows(rows, trim=True),
                ids[rows],
                None if other is None else other.rows(rows, trim=True),
                per_prompt,
                done,
            )
            values = scorer(model, part).detach().double().cpu()
            if values.ndim == 3:
                per.append(values)
            elif per_prompt:  # a mean came back although each prompt's scores were asked for
                raise ValueError(f"{desc} gives only the mean over prompts, not per prompt")
            else:
                weighted = values * part.size
                total = weighted if total is None else total + weighted
            done(1.0)
    if per:
        values = torch.cat(per)
        return values.float() if per_prompt else values.mean(0).float()
    assert total is not None
    return (total / n).float()


def check_scores(
    scores: Validated[Tensor], n_layers: int, n_heads: int, what: str = "scores"
) -> Scores:
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


def check_shape(n_layers: Validated[int], n_heads: Validated[int]) -> None:
    """At least one layer and one head, as ints."""
    if (
        isinstance(n_layers, bool)
        or isinstance(n_heads, bool)
        or not isinstance(n_layers, int)
        or not isinstance(n_heads, int)
        or n_layers < 1
        or n_heads < 1
    ):
        raise ValueError(f"need at least one layer and one head, got {n_layers} x {n_heads}")
