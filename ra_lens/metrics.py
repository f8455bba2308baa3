"""Metrics: callables from logits to one value per prompt, differentiated by reversed_attention.

A metric is any callable `metric(logits) -> Float[Tensor, "batch"]` (or a scalar). The metrics here
also accept `lengths` (each prompt's real length in a right-padded batch), so that a position
counted from the end (-1, the default) means each prompt's own last token.

    >>> metric = target_nll(torch.tensor([1, 2]))                        # -log p at the last token
    >>> metric(torch.zeros(2, 5, 10)).shape
    torch.Size([2])
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import Batch, HookedModel, to_batch
from ra_lens.math import upcast
from ra_lens.types import MetricFn

#: Target token ids: one for every prompt, or one per prompt (ints, 0-d tensors or a tensor).
TokenIds = int | Tensor | Sequence[int | Tensor]


def _positions(
    position: int | Tensor, logits: Tensor, lengths: Tensor | None
) -> Int[Tensor, "batch"]:
    """Absolute positions, one per prompt. Ints and tensors follow one rule: a negative position
    counts from each prompt's own end (its real length in a right-padded batch), and every
    position must fall inside its prompt, never on padding."""
    batch, n_pos = logits.shape[0], logits.shape[1]
    ends = (
        lengths.to(logits.device).long()
        if lengths is not None
        else torch.full((batch,), n_pos, device=logits.device)
    )
    if isinstance(position, Tensor):
        given = position.to(logits.device).long().reshape(-1)
        if given.shape[0] != batch:
            raise ValueError(f"{given.shape[0]} positions for a batch of {batch} prompts")
    else:
        given = torch.full_like(ends, int(position))
    pos = torch.where(given < 0, ends + given, given)
    if bool(((pos < 0) | (pos >= ends)).any()):
        shown = position.tolist() if isinstance(position, Tensor) else position
        raise ValueError(
            f"position {shown} is outside prompts of lengths {ends.tolist()}: count from 0 "
            "inside each prompt, or from its own end with negative numbers (-1 = last token)"
        )
    return pos


def _as_targets(targets: TokenIds) -> Tensor:
    return torch.as_tensor(targets, dtype=torch.long).reshape(-1)


def _check_targets(targets: Tensor, logits: Tensor) -> Tensor:
    vocab = logits.shape[-1]
    if bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(
            f"target ids {targets.tolist()} must lie in 0..{vocab - 1} (the vocabulary); a "
            "negative id is not counted from the end: use model.to_single_token(' word')"
        )
    if targets.shape[0] not in (1, logits.shape[0]):
        raise ValueError(
            f"{targets.shape[0]} targets for a batch of {logits.shape[0]} prompts: give one "
            "target per prompt (or one for all); for prompt i of the batch alone, as "
            "TransformerLens's attribution_patch runs them, use metric[i] (metric[i].mean() "
            "where a scalar is needed)"
        )
    return targets.to(logits.device)


class Metric:
    """Base class: `metric(logits, lengths=None) -> Float[Tensor, "batch"]`.

    Subclasses list in `_per_prompt` the attributes that hold one entry per prompt (a tensor
    whose first dimension is the batch, or of length 1 for every prompt); `metric[i]` and
    `metric[i:j]` cut those to the chosen prompts, so the metric of one example of a batch is at
    hand when an API runs the examples one by one (TransformerLens 4's `attribution_patch` calls
    its metric on each pair alone). `metric.mean()` is the scalar those APIs differentiate.
    """

    _per_prompt: tuple[str, ...] = ()

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, "batch"]:
        raise NotImplementedError

    def __getitem__(self, index: Validated[int | slice]) -> Metric:
        """The same metric for prompts `index` of the batch it was built for (an int keeps the
        batch dimension: `metric[2]` is the metric of a batch of one, prompt 2).

        >>> metric = logit_diff([3, 5, 7], [4, 6, 8])
        >>> logits = torch.randn(3, 4, 10)
        >>> bool(metric[1](logits[1:2]) == metric(logits)[1:2])
        True
        >>> metric[1:].correct.tolist(), metric[-1].incorrect.tolist()
        ([5, 7], [8])
        """
        n = self._n_prompts()
        if isinstance(index, bool) or not isinstance(index, int | slice):
            raise TypeError(f"index a metric with an int or a slice of prompts, not {index!r}")
        if n == 1:  # one target (position, ...) for every prompt: the same for any of them
            return copy.copy(self)
        if isinstance(index, int):
            if not -n <= index < n:
                raise IndexError(f"prompt {index} of a metric built for {n} prompts")
            index = slice(index % n, index % n + 1)
        if not range(n)[index]:
            raise IndexError(f"prompts {index} of a metric built for {n} prompts: none selected")
        part = copy.copy(self)
        for name in self._per_prompt:
            value = getattr(self, name)
            if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == n > 1:
                setattr(part, name, value[index])
        return part

    def _n_prompts(self) -> int:
        """Prompts the metric was built for: the longest per-prompt attribute (1: any batch)."""
        sizes = {
            int(value.shape[0])
            for value in (getattr(self, name) for name in self._per_prompt)
            if isinstance(value, Tensor) and value.ndim >= 1
        }
        if len(sizes - {1}) > 1:
            raise ValueError(f"per-prompt attributes of {len(sizes)} different lengths {sizes}")
        return max(sizes, default=1)

    def mean(self) -> MeanMetric:
        """The mean of this metric over the batch: one scalar, for APIs that need `metric(logits)`
        to be a 0-d tensor (TransformerLens's `attribution_patch`, the `patching_metric` of
        `transformer_lens.patching`).

        >>> logits = torch.randn(2, 4, 10)
        >>> metric = logit_diff([3, 5], [4, 6])
        >>> scalar = metric.mean()(logits)
        >>> scalar.shape, bool(scalar == metric(logits).mean())
        (torch.Size([]), True)
        """
        return MeanMetric(self)


class MeanMetric:
    """`metric(logits, lengths).mean()`: a 0-d tensor (see `Metric.mean`)."""

    def __init__(self, metric: Metric):
        self.metric = metric

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, ""]:
        return self.metric(logits, lengths).mean()

    def __getitem__(self, index: Validated[int | slice]) -> MeanMetric:
        """The mean over prompts `index` only."""
        return MeanMetric(self.metric[index])


class TargetNLL(Metric):
    """-log p(target) at one position per prompt."""

    _per_prompt = ("targets", "position")

    def __init__(self, targets: TokenIds, position: int | Tensor = -1):
        self.targets, self.position = _as_targets(targets), position

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, "batch"]:
        rows = torch.arange(logits.shape[0], device=logits.device)
        pos = _positions(self.position, logits, lengths)
        log_probs = upcast(logits[rows, pos]).log_softmax(dim=-1)
        return -log_probs[rows, _check_targets(self.targets, logits)]


class TargetProb(TargetNLL):
    """p(target) at one position per prompt (increase it: its RA points the other way to NLL's)."""

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, "batch"]:
        return (-super().__call__(logits, lengths)).exp()


class LogitDiff(Metric):
    """logit(correct) - logit(incorrect) at one position per prompt."""

    _per_prompt = ("correct", "incorrect", "position")

    def __init__(
        self,
        correct: TokenIds,
        incorrect: TokenIds,
        position: int | Tensor = -1,
    ):
        self.correct, self.incorrect = _as_targets(correct), _as_targets(incorrect)
        self.position = position

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, "batch"]:
        rows = torch.arange(logits.shape[0], device=logits.device)
        final = upcast(logits[rows, _positions(self.position, logits, lengths)])
        return (
            final[rows, _check_targets(self.correct, logits)]
            - final[rows, _check_targets(self.incorrect, logits)]
        )


class CompletionNLL(Metric):
    """Teacher forcing: mean cross-entropy over each prompt's completion tokens only.

    Tokens are prompt + completion; the completion of prompt i occupies positions
    [prompt_lengths[i], lengths[i]) and is predicted from the position before each token.
    """

    _per_prompt = ("tokens", "prompt_lengths")

    def __init__(self, tokens: Int[Tensor, "batch pos"], prompt_lengths: Tensor | Sequence[int]):
        self.tokens = tokens
        self.prompt_lengths = torch.as_tensor(prompt_lengths, dtype=torch.long).reshape(-1)

    def __call__(
        self, logits: Float[Tensor, "batch pos vocab"], lengths: Tensor | None = None
    ) -> Float[Tensor, "batch"]:
        batch, n_pos = self.tokens.shape
        ends = lengths if lengths is not None else torch.full((batch,), n_pos)
        ends, starts = ends.to(logits.device), self.prompt_lengths.to(logits.device)
        if bool((starts >= ends).any()) or bool((starts < 1).any()):
            raise ValueError("every completion needs at least one token after a non-empty prompt")
        log_probs = upcast(logits[:, :-1]).log_softmax(dim=-1)
        next_tokens = self.tokens[:, 1:].to(logits.device)
        token_lp = log_probs.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
        predicted_pos = torch.arange(1, n_pos, device=logits.device)
        in_completion = (predicted_pos >= starts[:, None]) & (predicted_pos < ends[:, None])
        return -(token_lp * in_completion).sum(-1) / in_completion.sum(-1)


def target_nll(targets: TokenIds, position: int | Tensor = -1) -> TargetNLL:
    """-log p(target) per prompt. `targets`: Int[Tensor, "batch"] (or one id for all prompts);
    `position`: an int or Int[Tensor, "batch"], counted from each prompt's start, or from its
    own end when negative (-1, the default, is each prompt's last real token).

    >>> logits = torch.randn(2, 5, 10)  # [batch pos vocab]; prompt 1 has 2 real tokens
    >>> nll = target_nll([3, 4])(logits, lengths=torch.tensor([5, 2]))
    >>> expected = [-logits[0, 4].log_softmax(-1)[3], -logits[1, 1].log_softmax(-1)[4]]
    >>> torch.allclose(nll, torch.stack(expected))
    True
    """
    return TargetNLL(targets, position)


def target_prob(targets: TokenIds, position: int | Tensor = -1) -> TargetProb:
    """p(target) per prompt, at `position` (as in target_nll).

    >>> logits = torch.randn(1, 5, 10)
    >>> torch.allclose(target_prob([3])(logits), logits[:, -1].softmax(-1)[:, 3])
    True
    """
    return TargetProb(targets, position)


def logit_diff(correct: TokenIds, incorrect: TokenIds, position: int | Tensor = -1) -> LogitDiff:
    """logit(correct) - logit(incorrect) per prompt, at `position` (as in target_nll).

    >>> logits = torch.randn(1, 5, 10)
    >>> logit_diff([3], [4], position=2)(logits) == logits[:, 2, 3] - logits[:, 2, 4]
    tensor([True])
    """
    return LogitDiff(correct, incorrect, position)


def completion(
    model: HookedModel, prompts: str | Sequence[str], completions: str | Sequence[str]
) -> tuple[Batch, CompletionNLL]:
    """Teacher-forced tokens and metric for prompt + completion pairs (the paper's loss).

    Returns:
        (batch, metric): right-padded prompt+completion ids with each row's length (a Batch),
        and the mean NLL of each completion. Pass both to reversed_attention.

    With `model` a tiny random model (`ra_lens.toy_models.tiny_model`), whose tokenizer splits
    " Paris" into " Par" and "is" after 8 prompt tokens:

    >>> batch, metric = completion(model, "The capital of France is", " Paris")
    >>> batch.lengths
    tensor([10])
    >>> logits = model(batch.tokens)  # positions 7 and 8 predict tokens 8 and 9
    >>> log_probs = logits[0, 7:9].log_softmax(-1).gather(-1, batch.tokens[0, 8:10, None])
    >>> torch.allclose(metric(logits), -log_probs.mean())
    True

    Pass both to `reversed_attention(model, batch, metric)`.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    completions = [completions] if isinstance(completions, str) else list(completions)
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    full = to_batch(model, [p + c for p, c in zip(prompts, completions)])
    prompt_lengths = to_batch(model, prompts).lengths
    return full, CompletionNLL(full.tokens, prompt_lengths)


def metric_lengths(metric: MetricFn, batch: Batch) -> Tensor | None:
    """`batch.lengths` where the metric accepts a `lengths` argument (every metric here does),
    else None; a metric without one is refused on a padded batch, where it cannot know where each
    prompt ends. The one rule, for the TransformerLens and nnsight routes alike."""
    try:
        accepts = "lengths" in inspect.signature(metric).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        return batch.lengths
    if batch.padded:
        raise ValueError(
            "prompts of different lengths were right-padded, and the metric cannot know where each "
            "one ends: use a metric from ra_lens.metrics or give the metric a `lengths` parameter"
        )
    return None


def call_metric(metric: MetricFn, logits: Tensor, batch: Batch) -> Tensor:
    """The metric's value on `logits`, with `lengths=` where it accepts them (`metric_lengths`).
    How RA, the pair layer and circuits call every metric."""
    lengths = metric_lengths(metric, batch)
    return metric(logits) if lengths is None else metric(logits, lengths=lengths)
