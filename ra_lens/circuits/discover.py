"""Edge scores for circuits more faithful than EAP-IG's: learned masks cross-fitted on two halves
of the training pairs, their harmful edges scaled by a factor measured on pairs a mask did not see.

`discover` splits the training pairs into a first half A and a second half B and:

1. trains one edge mask per half (`learn_mask`, rule="scaled", each warm-started from its own
   half's EAP-IG scores), so no mask sees all the pairs;
2. chooses the factor on the negative scores (`calibrate_negatives`) for A's mask on B's pairs,
   which that mask was not trained on (a mask's harmful edges look stronger on its own pairs);
3. returns the raw mean of the two masks' log-odds with that factor on the negatives.

The signed ranking (MIB's CPR) comes from the masks, the |score| ranking (MIB's CMD) from the
factor. Cost: two masks on half the pairs each (about one mask on all of them) plus one
calibration: 7.2-9.3x `attribute`'s default's CPU seconds on the circuit study's training pairs,
measured one at a time (docs/results/circuit-study.md, where it is measured against
EAP-IG-inputs on held-out pairs; `benchmarks/bench_circuits.py` prints the ratio).
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
from ra_lens.circuits.negatives import (
    CANDIDATES,
    calibrate_negatives,
    check_candidates,
    scale_negatives,
)
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import MetricFn, Tokens

#: Fewest training pairs: two per half (a mask is fitted to at least two pairs).
MIN_DISCOVER_PAIRS = 4


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
        candidates: the factors on the negative scores to choose from (`calibrate_negatives`).
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
            `calibrate_negatives` refuse (a collapsed mask, a metric equal on both runs, ...).

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
    held = halves[1]
    calibration = calibrate_negatives(
        model, masks[0], clean_b.rows(held), corrupted_b.rows(held),
        pairs.metric_rows(metric, held, n), candidates=candidates, own_copies=True,
        batch_size=batch_size, progress=progress,
    )  # fmt: skip
    scores = scale_negatives(ensemble(masks, normalise="none"), calibration.scale)
    method = f"discover(2 masks x {steps} steps, negatives x {calibration.scale:g})"
    return dataclasses.replace(scores, method=method, seconds=timing.cpu_time() - start)
