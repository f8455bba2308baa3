"""`circuits.pair_scores` (attribute pair by pair) and `circuits.stable` (bootstrap over pairs),
checked against one attribute call and a brute-force bootstrap."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import has_bridge

from ra_lens.circuits import EdgeScores, attribute, pair_scores, stable
from ra_lens.circuits.graph import Graph
from ra_lens.metrics import logit_diff
from ra_lens.ranking.statistics import bootstrap_indices
from ra_lens.toy_models import tiny_model

CLEAN = ["The capital of France is", "When Mary and John went to the store", "I like b and"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store", "I like c and"]
METRIC = logit_diff([294, 50, 7], [52, 60, 9])
GRAPH = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama" if has_bridge() else "hooked", dtype=torch.float64)


@pytest.mark.parametrize(("method", "direction"), [("eap", "denoise"), ("exact", "noise")])
def test_pair_scores_average_to_one_attribute_call(model, method, direction):
    per = pair_scores(model, CLEAN, CORRUPTED, METRIC, method=method, direction=direction)
    whole = attribute(model, CLEAN, CORRUPTED, METRIC, method=method, direction=direction)
    assert per.per_pair.shape == (3, *whole.scores.shape)
    scale = float(whole.scores.abs().max())
    assert scale > 0
    torch.testing.assert_close(per.scores, whole.scores.detach().double(), rtol=0, atol=1e-12 * scale)  # fmt: skip
    # each pair's scores are that pair's attribute call
    one = attribute(model, CLEAN[1:2], CORRUPTED[1:2], logit_diff([50], [60]), method=method, direction=direction)  # fmt: skip
    torch.testing.assert_close(per.per_pair[1], one.scores.detach().double(), rtol=0, atol=1e-12 * scale)  # fmt: skip
    assert per.seconds is not None and per.seconds > 0


def test_identical_pairs_resample_to_the_mean(model):
    clean, corrupted = [CLEAN[0]] * 4, [CORRUPTED[0]] * 4
    per = pair_scores(model, clean, corrupted, logit_diff([294] * 4, [52] * 4), method="eap")
    torch.testing.assert_close(per.per_pair, per.per_pair[:1].expand(4, -1, -1), rtol=0, atol=0)
    for statistic in ("agreement", "shrink"):
        result = stable(per, statistic=statistic, n_boot=50)
        torch.testing.assert_close(result.scores, per.scores, rtol=1e-12, atol=1e-18)


def _per_pair(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(7, *GRAPH.real.shape, generator=generator, dtype=torch.float64) + 0.3
    return values * GRAPH.real


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_statistics_by_brute_force(direction):
    per_pair = _per_pair(0)
    scores = EdgeScores(GRAPH, per_pair.mean(0), "m", direction, per_pair=per_pair)
    helps = per_pair if direction == "denoise" else -per_pair
    mean = helps.mean(0)
    index = bootstrap_indices(7, 120, seed=5)
    boots = torch.stack([helps[row].mean(0) for row in index])  # [boot, writer, reader]
    agree = (torch.sign(boots) == torch.sign(mean)).double().mean(0)
    expected = mean * (2 * agree - 1) * GRAPH.real
    got = stable(scores, n_boot=120, seed=5, statistic="agreement")
    torch.testing.assert_close(got.scores, expected, rtol=1e-12, atol=1e-15)
    assert got.direction == "denoise" and got.method == f"stable-agreement(m:{direction})"
    t_sq = mean**2 / boots.var(0, unbiased=False)
    expected = (mean * t_sq / (1 + t_sq)).nan_to_num() * GRAPH.real
    got = stable(scores, n_boot=120, seed=5, statistic="shrink")
    torch.testing.assert_close(got.scores, expected, rtol=1e-9, atol=1e-15)
    # a stable edge keeps most of its mean, an unstable one shrinks
    assert float(got.scores[GRAPH.real].abs().sum()) < float(mean[GRAPH.real].abs().sum())


def test_bad_input_is_refused():
    plain = EdgeScores(GRAPH, torch.zeros(GRAPH.real.shape), "m", "denoise")
    with pytest.raises(ValueError, match="pair_scores"):
        stable(plain)
    with_pairs = EdgeScores(GRAPH, torch.zeros(GRAPH.real.shape), "m", "denoise", per_pair=_per_pair(1))  # fmt: skip
    with pytest.raises(ValueError, match="n_boot"):
        stable(with_pairs, n_boot=0)
    with pytest.raises(ValueError, match="statistic"):
        stable(with_pairs, statistic="t")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EdgeScores"):
        stable(with_pairs.scores)  # type: ignore[arg-type]


def _gqa_model():
    if has_bridge():
        return tiny_model("llama", dtype=torch.float64, spread=True)
    from ra_lens.toy_models import hooked_matrix_model

    return hooked_matrix_model("llama", dtype=torch.float64)


def test_pair_stable_and_ensemble_carry_each_query_heads_copy(tmp_path):
    """On a grouped-query model pair_scores gives the copies attribute gives (not equal shares),
    stable and ensemble keep them, and export_mib writes attribute's importances."""
    from ra_lens.circuits import ensemble
    from ra_lens.circuits.files import export_mib

    model = _gqa_model()
    metric = logit_diff([294, 50], [52, 60])
    whole = attribute(model, CLEAN[:2], CORRUPTED[:2], metric, method="eap")
    per = pair_scores(model, CLEAN[:2], CORRUPTED[:2], metric, method="eap")
    assert whole.graph.group > 1 and whole.ungrouped_scores is not None
    scale = float(whole.scores.abs().max())
    assert per.ungrouped_scores is not None
    torch.testing.assert_close(per.ungrouped_scores, whole.ungrouped_scores.double(), rtol=0, atol=1e-9 * scale)  # fmt: skip
    read = {}
    for name, scores in (("whole", whole), ("per", per)):
        export_mib(scores, tmp_path / name, circuits=False)
        edges = json.loads((tmp_path / name / "importances.json").read_text())["edges"]
        read[name] = {k: v["score"] for k, v in edges.items()}
    assert read["whole"].keys() == read["per"].keys()
    gap = max(abs(read["whole"][k] - read["per"][k]) for k in read["whole"])
    assert gap < 1e-9 * scale
    # stable: each copy keeps its part of the edge, weighted like the edge
    result = stable(per, n_boot=20)
    assert result.ungrouped_scores is not None
    g = result.graph
    weight = torch.zeros_like(result.scores)
    nonzero = g.real & (per.scores != 0)
    weight[nonzero] = result.scores[nonzero] / per.scores[nonzero]
    expected = per.ungrouped_scores * weight[:, g.ungrouped_target]
    torch.testing.assert_close(result.ungrouped_scores, expected, rtol=1e-9, atol=1e-12 * scale)
    # ensemble of an input with copies and one without: the copies combine linearly
    both = ensemble([per, EdgeScores(g, per.scores, "eap", "denoise")], normalise="none")
    shares = (per.scores / g.copies[None, :])[:, g.ungrouped_target] * g.real[:, g.ungrouped_target]
    torch.testing.assert_close(both.ungrouped_scores, (per.ungrouped_scores + shares) / 2, rtol=0, atol=1e-12 * scale)  # fmt: skip
