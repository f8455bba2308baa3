"""`circuits.discover`: two scaled masks, one per half of the training pairs, each from its own
half's EAP-IG; the factor on the negatives chosen by the mean CMD of each half's mask on the other
half's pairs (per copy, as MIB's evaluator patches); the raw mean of the two masks with that
factor. Checked against that composition of the public functions on float64 toys, both
TransformerLens worlds."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import PAIR_CLEAN, PAIR_CORRUPTED, circuit_toy, snapshot

from ra_lens import circuits
from ra_lens.circuits import negatives
from ra_lens.circuits.negatives import CANDIDATES
from ra_lens.metrics import logit_diff

CLEAN = PAIR_CLEAN * 2 + PAIR_CLEAN[:1]
CORRUPTED = PAIR_CORRUPTED * 2 + PAIR_CORRUPTED[:1]
METRIC = logit_diff([294, 50, 294, 50, 294], [52, 60, 52, 60, 52])


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    model = circuit_toy(request.param)
    with torch.no_grad():  # a bridge adds its own norm hooks on its first pass: before snapshots
        model(model.to_tokens(CLEAN[0]))
    return model


def test_discover_is_the_mean_of_the_halves_masks_with_the_factor_both_halves_choose(
    model, monkeypatch
):
    chosen = []
    real_calibrate = negatives.cross_calibrate

    def calibrate(*args, **kwargs):
        chosen.append(real_calibrate(*args, **kwargs))
        return chosen[-1]

    # the module (the package's name `discover` is the function)
    module = importlib.import_module("ra_lens.circuits.discover")
    monkeypatch.setattr(module, "cross_calibrate", calibrate)
    before = snapshot(model)
    scores = circuits.discover(model, CLEAN, CORRUPTED, METRIC, steps=2, ig_steps=2, batch_size=2)
    assert_as_found(model, before)

    first, second = (slice(0, 3), slice(3, 5))  # 5 pairs: the first half has the odd one
    masks = [
        circuits.learn_mask(
            model, CLEAN[rows], CORRUPTED[rows], METRIC[rows], steps=2, ig_steps=2,
            rule="scaled", batch_size=2,
        ).scores
        for rows in (first, second)
    ]  # fmt: skip
    # each mask on the other half's pairs, every candidate measured
    one_way = [
        circuits.calibrate_negatives(
            model,
            mask,
            CLEAN[rows],
            CORRUPTED[rows],
            METRIC[rows],
            own_copies=True,
            sizes=module.CALIBRATION_SIZES,
            batch_size=2,
        )  # fmt: skip
        for mask, rows in ((masks[0], second), (masks[1], first))
    ]
    (calibration,) = chosen
    tried = len(calibration.candidates)
    assert calibration.candidates == list(CANDIDATES)[:tried]
    for fold, alone in zip(calibration.fold_cmds, one_way, strict=True):
        assert fold == pytest.approx(alone.cmds[:tried], rel=1e-9, abs=1e-12)
    mean_cmd = [(a + b) / 2 for a, b in zip(one_way[0].cmds, one_way[1].cmds, strict=True)]
    assert calibration.cmds == pytest.approx(mean_cmd[:tried], rel=1e-9, abs=1e-12)
    # tried up to the first candidate worse than the one before, the best of those chosen
    rises = [i for i in range(1, len(mean_cmd)) if mean_cmd[i] > mean_cmd[i - 1]]
    assert tried == (rises[0] + 1 if rises else len(mean_cmd))
    assert calibration.scale == CANDIDATES[mean_cmd.index(min(mean_cmd[:tried]))]
    mean = circuits.ensemble(masks, normalise="none")
    torch.testing.assert_close(mean.scores, (masks[0].scores + masks[1].scores) / 2)
    expected = circuits.scale_negatives(mean, calibration.scale)
    torch.testing.assert_close(scores.scores, expected.scores, rtol=1e-9, atol=1e-12)
    if expected.ungrouped_scores is not None:  # grouped-query: each copy of its own
        assert scores.ungrouped_scores is not None
        torch.testing.assert_close(scores.ungrouped_scores, expected.ungrouped_scores)
    assert scores.direction == "denoise" and scores.seconds is not None and scores.seconds > 0
    assert scores.method == f"discover(2 masks x 2 steps, negatives x {calibration.scale:g})"
    assert bool(scores.scores[scores.graph.real].ne(0).any())
    assert bool(scores.scores[~scores.graph.real].eq(0).all())


def assert_as_found(model, before) -> None:
    """Modes, requires_grad flags and hooks as they were, no parameter .grad filled."""
    after = snapshot(model)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(g is None for g in after[2])


def test_discover_scores_export_to_mib_as_attribute_scores_do(model, tmp_path):
    """importances.json holds the per-copy scores MIB's evaluator ranks."""
    import json

    scores = circuits.discover(model, CLEAN, CORRUPTED, METRIC, steps=1, ig_steps=1)
    (path,) = circuits.export_mib(scores, tmp_path / "mib")
    edges = json.loads(path.read_text())["edges"]
    written = [e["score"] for e in edges.values()]
    values = scores.ungrouped_scores if scores.ungrouped_scores is not None else scores.scores
    assert sum(written) == pytest.approx(float(scores.scores.sum()), rel=1e-6)  # copies add up
    assert max(written) == pytest.approx(float(values.max()), rel=1e-6)
    assert min(written) == pytest.approx(float(values.min()), rel=1e-6)


def test_bad_input_is_refused_naming_the_fix(model):
    before = snapshot(model)
    with pytest.raises(ValueError, match="at least 4"):
        circuits.discover(model, CLEAN[:3], CORRUPTED[:3], METRIC[:3])
    with pytest.raises(ValueError, match="steps"):
        circuits.discover(model, CLEAN, CORRUPTED, METRIC, steps=0)
    with pytest.raises(ValueError, match="ig_steps"):
        circuits.discover(model, CLEAN, CORRUPTED, METRIC, ig_steps=0)
    with pytest.raises(ValueError, match="candidates is empty"):
        circuits.discover(model, CLEAN, CORRUPTED, METRIC, steps=1, ig_steps=1, candidates=())
    plain = lambda logits, **_: logits[:, -1, 0]  # noqa: E731  (not cut to each half)
    with pytest.raises(ValueError, match="plain callable"):
        circuits.discover(model, CLEAN, CORRUPTED, plain, steps=1, ig_steps=1)
    assert_as_found(model, before)
