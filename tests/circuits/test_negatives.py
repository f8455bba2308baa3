"""`circuits.negatives`: scaling the scores that hurt leaves the signed ranking (CPR's circuits)
alone and moves only where they enter the |score| ranking; the calibration's CMD per candidate is
`faithfulness_curve`'s CMD of the scaled scores on the same pairs, and the smallest one is chosen.
Float64 tiny models, both TransformerLens worlds: GPT-2-like and Llama-like (grouped-query: each
query head's copy scaled by its own sign)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    PAIR_CLEAN,
    PAIR_CORRUPTED,
    PAIR_METRIC,
    circuit_toy,
    snapshot,
)

from ra_lens.circuits import (
    attribute,
    calibrate_negatives,
    faithfulness_curve,
    learn_mask,
    mib_circuits,
    scale_negatives,
)
from ra_lens.circuits.mib import ChosenCircuits, mib_sign
from ra_lens.circuits.negatives import Fold, cross_calibrate

SIZES = [0.1, 0.3, 0.6, 1.0]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return circuit_toy(request.param)


@pytest.fixture(scope="module")
def mask_scores(model):
    """A learned mask's scores (their negatives are what the calibration is for)."""
    warm = attribute(model, PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC, method="eap-ig", steps=3)
    learned = learn_mask(
        model, PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC, warm_start=warm, steps=3, rule="scaled"
    )
    return learned.scores


def test_negatives_scaled_positives_kept(mask_scores):
    """Each score that hurts (each copy, where there are copies) times the factor, the rest
    as they were; grouped scores the sums of their scaled copies."""
    scaled = scale_negatives(mask_scores, 0.5)
    copies = mask_scores.ungrouped_scores is not None
    before = (mask_scores.ungrouped_scores if copies else mask_scores.scores).double()
    after = (scaled.ungrouped_scores if copies else scaled.scores).double()
    hurts = mib_sign(mask_scores.direction) * before < 0
    assert hurts.any() and (~hurts & (before != 0)).any()
    assert torch.equal(after[hurts], 0.5 * before[hurts])
    assert torch.equal(after[~hurts], before[~hurts])
    if copies:
        graph = mask_scores.graph
        summed = torch.zeros_like(scaled.scores).index_add_(1, graph.ungrouped_target, after)
        torch.testing.assert_close(scaled.scores, summed * graph.real, rtol=0, atol=1e-12)
    assert (scaled.method, scaled.direction, scaled.graph) == (mask_scores.method, mask_scores.direction, mask_scores.graph)  # fmt: skip


def test_signed_circuits_unchanged_abs_circuits_move(mask_scores):
    """Per copy (each query head's copy ranked by its own score, as MIB's evaluator does) and
    on a model without grouped keys, the signed circuits stay; a grouped key/value edge whose
    copies differ in sign is the sum of its copies, so its grouped score moves."""
    scaled = scale_negatives(mask_scores, 0.25)
    own = mask_scores.ungrouped_scores is not None
    signed = [ChosenCircuits(s, "top", own).at(SIZES, absolute=False) for s in (mask_scores, scaled)]  # fmt: skip
    assert [c.copies.tolist() for c in signed[0]] == [c.copies.tolist() for c in signed[1]]
    by_abs = [mib_circuits(s, SIZES, absolute=True) for s in (mask_scores, scaled)]
    assert [c.copies.tolist() for c in by_abs[0]] != [c.copies.tolist() for c in by_abs[1]]
    assert scale_negatives(mask_scores, 1.0) is mask_scores


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, math.inf])
def test_bad_scale_refused(mask_scores, bad):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        scale_negatives(mask_scores, bad)


def test_calibration_is_the_curves_cmd_and_its_minimum(model, mask_scores):
    before = snapshot(model)
    candidates = (1.0, 0.5, 0.25)
    got = calibrate_negatives(
        model,
        mask_scores,
        PAIR_CLEAN,
        PAIR_CORRUPTED,
        PAIR_METRIC,
        candidates=candidates,
        sizes=SIZES,  # fmt: skip
    )
    assert snapshot(model)[:2] == before[:2]
    assert list(got.cmd) == list(candidates)
    for c in candidates:
        curve = faithfulness_curve(
            model,
            scale_negatives(mask_scores, c),
            PAIR_CLEAN,
            PAIR_CORRUPTED,
            PAIR_METRIC,
            sizes=SIZES,  # fmt: skip
        )
        assert got.cmd[c] == pytest.approx(curve.cmd, rel=1e-12, abs=1e-12)
    assert got.cmd[got.scale] == min(got.cmd.values())
    assert torch.equal(got.scores.scores, scale_negatives(mask_scores, got.scale).scores)
    assert "chosen" in got.table() and got.to_dict()["scale"] == got.scale


def test_calibration_refuses_bad_input(model, mask_scores):
    args = (model, mask_scores, PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC)
    with pytest.raises(ValueError, match="candidates is empty"):
        calibrate_negatives(*args, candidates=())
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        calibrate_negatives(*args, candidates=(1.0, 2.0))
    with pytest.raises(ValueError, match="units="):
        calibrate_negatives(*args, units="heads")


def test_cross_calibration_takes_the_folds_mean_and_can_stop_when_worse(model, mask_scores):
    """Each fold's CMDs are its own calibration's; the choice is by their mean, applied to the
    scores given; stop_when_worse measures the candidates up to the first worse than the one
    before it."""
    candidates = (1.0, 0.5, 0.25, 0.1)
    pairs = [(PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC), (PAIR_CLEAN[:1], PAIR_CORRUPTED[:1], PAIR_METRIC[:1])]  # fmt: skip
    folds = [Fold(mask_scores, *pairs[0]), Fold(scale_negatives(mask_scores, 0.3), *pairs[1])]
    alone = [
        calibrate_negatives(
            model,
            fold.scores,
            fold.clean,
            fold.corrupted,
            fold.metric,
            candidates=candidates,
            sizes=SIZES,
        )  # fmt: skip
        for fold in folds
    ]
    target = attribute(model, PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC, method="eap")
    full = cross_calibrate(model, folds, target, candidates=candidates, sizes=SIZES)
    assert full.fold_cmds == [a.cmds for a in alone]
    assert full.cmds == pytest.approx([(a + b) / 2 for a, b in zip(*full.fold_cmds, strict=True)])
    assert full.scale == candidates[full.cmds.index(min(full.cmds))]
    assert torch.equal(full.scores.scores, scale_negatives(target, full.scale).scores)
    stopped = cross_calibrate(model, folds, target, candidates=candidates, sizes=SIZES, stop_when_worse=True)  # fmt: skip
    rises = [i for i in range(1, len(full.cmds)) if full.cmds[i] > full.cmds[i - 1]]
    tried = rises[0] + 1 if rises else len(candidates)
    assert stopped.candidates == list(candidates[:tried]) and stopped.cmds == full.cmds[:tried]
    assert stopped.scale == candidates[full.cmds.index(min(full.cmds[:tried]))]
    assert stopped.to_dict()["fold_cmd"][1] == {str(c): v for c, v in zip(candidates, full.fold_cmds[1][:tried])}  # fmt: skip
    with pytest.raises(ValueError, match="folds is empty"):
        cross_calibrate(model, [], target)
