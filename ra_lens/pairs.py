"""Clean/corrupted pairs and batched loops: the one pair/batch layer of rankings, attribution,
circuits and the experiments.

- `check_pairs` / `paired`: one corrupted prompt per clean one, of the same token length
  (patching is position by position);
- `chunks`: consecutive slices of at most `batch_size` prompts;
- `Batch.rows` (in `ra_lens.capture`): the prompts of one slice, at full width or trimmed;
- `metric_rows`: the metric of one slice of prompts (`Metric[rows]` of `ra_lens.metrics`, or a
  clear refusal for a plain callable that cannot be split);
- `metric_values`: one checked, finite metric value per prompt (through `metrics.call_metric`).

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import Batch, HookedModel
from ra_lens.checks import check_count
from ra_lens.metrics import Metric, call_metric
from ra_lens.types import MetricFn, Tokens


def check_pairs(clean: Batch, corrupted: Batch) -> None:
    """Refuse pairs that cannot be patched position by position: different counts, or a pair
    whose two prompts have different token lengths (the error names the pair and the fix).

    >>> a, b = capture.to_batch(model, ["Q: hot"]), capture.to_batch(model, ["Q: big"])
    >>> check_pairs(a, b)
    Traceback (most recent call last):
    ValueError: pair 0: clean has 7 tokens, corrupted 6: patching is position by position, so each corrupted prompt must have the same token length as its clean prompt (swap in names/words that are one token each)
    """  # noqa: E501
    if clean.tokens.shape[0] != corrupted.tokens.shape[0]:
        raise ValueError(
            f"{clean.tokens.shape[0]} clean but {corrupted.tokens.shape[0]} corrupted prompts: "
            "give one corrupted prompt per clean prompt"
        )
    unequal = (clean.lengths != corrupted.lengths).nonzero().flatten().tolist()
    if unequal or clean.tokens.shape != corrupted.tokens.shape:
        i = unequal[0] if unequal else 0
        raise ValueError(
            f"pair {i}: clean has {int(clean.lengths[i])} tokens, corrupted "
            f"{int(corrupted.lengths[i])}: patching is position by position, so each corrupted "
            "prompt must have the same token length as its clean prompt (swap in names/words "
            "that are one token each)"
        )


def paired(model: HookedModel, clean: Tokens, corrupted: Tokens) -> tuple[Batch, Batch]:
    """Both sides as right-padded Batches, checked by `check_pairs`.

    >>> clean, corrupted = paired(model, ["I like Italy"], ["I like Paris"])
    >>> clean.tokens.shape == corrupted.tokens.shape
    True
    """
    clean_b, corrupted_b = capture.to_batch(model, clean), capture.to_batch(model, corrupted)
    check_pairs(clean_b, corrupted_b)
    return clean_b, corrupted_b


def chunks(n: int, batch_size: int) -> list[slice]:
    """Consecutive slices of at most `batch_size` rows covering range(n).

    >>> chunks(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    check_count(batch_size, "batch_size")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def metric_rows(metric: MetricFn, rows: slice, n: int) -> MetricFn:
    """The metric for prompts `rows` of n: a metric from `ra_lens.metrics` is cut to those rows
    (`Metric[rows]`); any other callable is used as it is, which needs all n prompts at once.

    Raises:
        ValueError: a plain callable and rows short of all n, naming what each caller accepts.

    >>> from ra_lens.metrics import logit_diff
    >>> metric_rows(logit_diff([1, 2, 3], [4, 5, 6]), slice(1, 3), 3).correct.tolist()
    [2, 3]
    """
    if rows == slice(0, n):
        return metric
    if not isinstance(metric, Metric):
        # Said for every caller, which this function does not know: attribute and faithfulness
        # cut by batch_size, pair_scores always pair by pair (it has no batch_size).
        raise ValueError(
            f"the metric is a plain callable, which ra-lens cannot cut to pairs "
            f"{rows.start}..{rows.stop - 1} of {n}: pass a metric from ra_lens.metrics (e.g. "
            "ra_lens.metrics.logit_diff(correct, wrong) with one token per pair, or "
            "ra_lens.tasks.ioi.paired_batch's); circuits.pair_scores, which scores each pair "
            "alone, takes only such a metric, while circuits.attribute and the faithfulness "
            f"calls also take a plain callable with batch_size >= {n} (all pairs in one batch)"
        )
    return metric[rows]


def metric_values(metric: MetricFn, logits: Tensor, batch: Batch) -> Float[Tensor, "batch"]:
    """One metric value per prompt, finite (a scalar metric is refused: faithfulness, edge scores
    and patching effects are per pair).

    >>> from ra_lens.metrics import logit_diff
    >>> batch = capture.to_batch(model, ["I like Italy", "Q: hot"])
    >>> metric_values(logit_diff([1, 2], [3, 4]), model(batch.tokens), batch).shape
    torch.Size([2])
    """
    values = call_metric(metric, logits, batch)
    n = batch.tokens.shape[0]
    if not isinstance(values, Tensor) or values.ndim != 1 or values.shape[0] != n:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(
            f"the metric returned {shape}: this needs one value per prompt, "
            f"Float[Tensor, '{n}'] (e.g. ra_lens.metrics.logit_diff), not a mean over the batch"
        )
    if not bool(torch.isfinite(values.detach()).all()):
        raise ValueError(f"the metric returned non-finite values {values.detach().tolist()[:8]}")
    return values
