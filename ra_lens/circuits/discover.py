"""Edge scores for circuits more faithful than EAP-IG's: learned masks cross-fitted on two halves
of the training pairs, their harmful edges scaled by a factor measured on pairs a mask did not see.

`discover` splits the training pairs into a first half A and a second half B and:

1. trains one edge mask per half (`learn_mask`, rule="scaled", each warm-started from its own
   half's EAP-IG scores), so no mask sees all the pairs;
2. chooses the factor on the negative scores (`cross_calibrate`) by the mean CMD of A's mask on
   B's pairs and B's mask on A's, pairs each mask was not trained on (a mask's harmful edges look
   stronger on its own pairs), trying 1, 0.5, 0.25 in turn until the mean CMD gets worse;
3. returns the raw mean of the two masks' log-odds with that factor on the negatives.

The signed ranking (MIB's CPR) comes from the masks, the |score| ranking (MIB's CMD) from the
factor. One direction alone chose the factor worse: on 48 fresh IOI pairs it chose 1 where 0.5
halves the held-out CMD (docs/results/circuit-study.md). Cost: two masks on half the pairs each
(about one mask on all of them) plus the calibration; `benchmarks/bench_circuits.py` prints the
ratio to `attribute`'s default, docs/results/circuit-study.md has it per task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ra_lens import capture, pairs, timing
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.circuits.ensemble import ensemble
from ra_lens.circuits.masks import learn_mask
from ra_lens.circuits.mib import MIB_FRACTIONS
from ra_lens.circuits.negatives import CANDIDATES, Fold, check_candidates, cross_calibrate
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import MetricFn, Tokens

#: Fewest training pairs: two per half (a mask is fitted to at least two pairs).
MIN_DISCOVER_PAIRS = 4
#: The circuit sizes the factor is chosen at: MIB's from 1 % of the edges (the sizes below span
#: under 1 % of the area's width but would add half again to the calibration's passes).
CALIBRATION_SIZES: tuple[float, ...] = tuple(k for k in MIB_FRACTIONS if k >= 0.01)


def discover(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    steps: int = 10,
    lr: float = 0.1,
    ig_steps: int = 5,
    candidates: Sequence[float] = CANDIDATES,
    batch_size: int = 8,
    progress: bool = False,
) -> EdgeScores:
    """Cross-fitted learned masks with calibrated negatives (module docstring).

    Args:
        model: as `circuits.attribute` takes it.
        clean, corrupted: the training pairs (>= 4; the first (n + 1) // 2 are half A),
            Int[Tensor, "pair pos"], Batch or strings.
        metric: logits -> Float[Tensor, "pair"] from `ra_lens.metrics` (it is cut to each half),
            e.g. `ra_lens.metrics.logit_diff`.
        steps, lr: each mask's training steps and step size (`learn_mask`, rule="scaled").
        ig_steps: the IG steps of each mask's EAP-IG warm start.
        candidates: the factors on the negative scores to try, in this order (`cross_calibrate`).
        batch_size: pairs per forward/backward pass.
        progress: show progress bars.

    Returns:
        EdgeScores in MIB's sign (direction "denoise"), per query-head copy on grouped-query
        models; `method` names the factor chosen, `seconds` the CPU seconds of all of it.
        `top`/`export_mib` take them as they take `attribute`'s; MIB's evaluator patches each
        copy on its own, as the calibration did.

    Raises:
        ValueError: fewer than 4 pairs, steps or ig_steps < 1, no candidate or one outside
            (0, 1], a metric not from `ra_lens.metrics` (it cannot be cut), and what `learn_mask` and
            `cross_calibrate` refuse (a collapsed mask, a metric equal on both runs, ...).

    >>> from ra_lens.metrics import logit_diff
    >>> clean = ["The capital of France is", "I like France"] * 2
    >>> corrupted = ["The capital of Italy is", "I like Italy"] * 2
    >>> scores = discover(model, clean, corrupted, logit_diff([294] * 4, [52] * 4), steps=2)
    >>> scores.method.split(",")[0], scores.direction  # the method also names the factor chosen
    ('discover(2 masks x 2 steps', 'denoise')
    """
    start = timing.cpu_time()
    check_count(steps, "steps", why="each mask's training steps")
    check_count(ig_steps, "ig_steps")
    check_candidates(candidates)
    capture.check_model(model)
    clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
    n = clean_b.tokens.shape[0]
    if n < MIN_DISCOVER_PAIRS:
        raise ValueError(f"discover got {n} training pair(s): give at least {MIN_DISCOVER_PAIRS}, two for each half's mask (or use circuits.attribute, which takes any number)")  # fmt: skip
    halves = [slice(0, (n + 1) // 2), slice((n + 1) // 2, n)]
    masks = [
        learn_mask(
            model, clean_b.rows(rows), corrupted_b.rows(rows), pairs.metric_rows(metric, rows, n),
            steps=steps, lr=lr, rule="scaled", ig_steps=ig_steps, batch_size=batch_size,
            progress=progress,
        ).scores
        for rows in halves
    ]  # fmt: skip
    folds = [  # each mask on the half it did not see
        Fold(mask, clean_b.rows(rows), corrupted_b.rows(rows), pairs.metric_rows(metric, rows, n))
        for mask, rows in zip(masks, reversed(halves), strict=True)
    ]
    calibration = cross_calibrate(
        model, folds, ensemble(masks, normalise="none"), candidates=candidates,
        sizes=CALIBRATION_SIZES, own_copies=True, stop_when_worse=True, batch_size=batch_size,
        progress=progress,
    )  # fmt: skip
    scores = calibration.scores
    method = f"discover(2 masks x {steps} steps, negatives x {calibration.scale:g})"
    return dataclasses.replace(scores, method=method, seconds=timing.cpu_time() - start)
