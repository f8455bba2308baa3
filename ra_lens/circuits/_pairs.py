"""Pairs of prompts in batches, and a metric evaluated on one batch of them."""

from __future__ import annotations

import copy

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens.attribution.compute import check_pairs
from ra_lens.capture import Batch, HookedModel
from ra_lens.core import call_metric
from ra_lens.metrics import Metric
from ra_lens.types import MetricFn, Tokens


def paired(model: HookedModel, clean: Tokens, corrupted: Tokens) -> tuple[Batch, Batch]:
    """Both sides as Batches, checked: one corrupted prompt per clean one, same token length."""
    clean_b, corrupted_b = capture.to_batch(model, clean), capture.to_batch(model, corrupted)
    check_pairs(clean_b, corrupted_b)
    return clean_b, corrupted_b


def chunks(n: int, batch_size: int) -> list[slice]:
    """Consecutive slices of at most batch_size pairs."""
    capture.check_positive_int(batch_size, "batch_size")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def part(batch: Batch, rows: slice) -> Batch:
    """Rows of a batch (full padded width, so metrics holding token tensors still line up)."""
    return Batch(batch.tokens[rows], batch.lengths[rows])


def metric_for(metric: MetricFn, rows: slice, n: int) -> MetricFn:
    """The metric for pairs `rows` of n: an ra_lens metric with per-prompt targets is cut to
    those rows; any other callable is used as it is, which needs all n pairs in one batch.

    >>> from ra_lens.metrics import logit_diff
    >>> metric_for(logit_diff([1, 2, 3], [4, 5, 6]), slice(1, 3), 3).correct.tolist()
    [2, 3]
    """
    if rows == slice(0, n):
        return metric
    if not isinstance(metric, Metric):
        raise ValueError(
            f"the metric is a plain callable, so it cannot be split into batches of pairs: pass "
            f"batch_size >= {n} (all pairs in one batch) or a metric from ra_lens.metrics "
            "(e.g. ra_lens.tasks.ioi.paired_batch's logit_diff)"
        )
    part_metric = copy.copy(metric)
    for name, value in vars(metric).items():
        if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == n:
            setattr(part_metric, name, value[rows])
    return part_metric


def metric_values(metric: MetricFn, logits: Tensor, batch: Batch) -> Float[Tensor, "batch"]:
    """One metric value per prompt (a scalar metric is refused: faithfulness and scores are
    per pair)."""
    values = call_metric(metric, logits, batch)
    n = batch.tokens.shape[0]
    if not isinstance(values, Tensor) or values.ndim != 1 or values.shape[0] != n:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(
            f"the metric returned {shape}: ra_lens.circuits needs one value per prompt, "
            f"Float[Tensor, '{n}'] (e.g. ra_lens.metrics.logit_diff), not a mean over the batch"
        )
    if not bool(torch.isfinite(values.detach()).all()):
        raise ValueError(f"the metric returned non-finite values {values.detach().tolist()[:8]}")
    return values
