"""The head-ranking experiment run end to end on a tiny model (slow: the file name's
`_end_to_end`); its rankings are the library's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked

from ra_lens import ranking as rk
from ra_lens import tasks
from ra_lens.experiments import HeadRankingResult, head_ranking
from ra_lens.experiments.head_ranking import RANKINGS
from ra_lens.tasks import task_prompts
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


@pytest.fixture(scope="module")
def result(llama):
    return head_ranking(llama, TOY, shots=2, n_prompts=6, fractions=(0.0, 0.5, 1.0), progress=False)


def test_head_ranking_end_to_end(llama, result, tmp_path):
    assert isinstance(result, HeadRankingResult)
    assert list(result.scores) == list(RANKINGS)
    shape = (llama.cfg.n_layers, llama.cfg.n_heads)
    assert all(tuple(s.shape) == shape for s in result.scores.values())
    assert result.n_prompts == 6 and result.n_patching == 6
    # Fraction 0 ablates everything and fraction 1 nothing, whatever the ranking.
    for curves in (result.curves, result.reverse_curves):
        for curve in curves.values():
            assert curve.accuracies[-1].ranks.tolist() == result.unablated.ranks.tolist()
            assert curve.top1[0] == result.curves["ra"].top1[0]
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data["rankings"]) == set(RANKINGS)
    for entry in data["rankings"].values():
        assert len(entry["curve"]) == len(entry["reverse_curve_top3"]) == 3
        assert entry["seconds"] >= 0
        assert 0 <= entry["auc"] <= 1 and 0 <= entry["reverse_auc_top3"] <= 1
    assert set(data["spearman"]) == set(RANKINGS) - {"ra"}
    assert data["top10_overlap"]["ra_loss_row"] >= 0
    assert all(-1 <= rho <= 1 for rho in data["spearman"].values())
    nan_result = HeadRankingResult(**{**result.__dict__, "spearman": {"random": float("nan")}})
    assert json.loads(json.dumps(nan_result.to_dict(), allow_nan=False))["spearman"] == {
        "random": None
    }
    table = result.table()
    assert "causal_mediation" in table and "faster than causal mediation" in table
    result.save(tmp_path / "out" / "ranking.json")
    assert json.loads((tmp_path / "out" / "ranking.json").read_text())["task"] == "toy"
    paths = result.plots(tmp_path / "figs")
    names = {p.name for p in paths}
    assert {"ablation_curves.png", "ranking_maps.png"} <= names
    assert all(p.stat().st_size > 0 for p in paths)


def test_head_ranking_rankings_match_the_library(llama, result):
    train, _ = task_prompts(llama, TOY, shots=2)
    train = train[:6]
    texts = [p.text for p in train]
    targets = [tasks.answer_token(llama, p.answer) for p in train]
    torch.testing.assert_close(result.scores["ra"], rk.ra_ranking(llama, texts, targets))
    torch.testing.assert_close(result.scores["random"], rk.random_ranking(2, llama.cfg.n_heads, 42))
    assert result.spearman["ra_loss_row"] == pytest.approx(
        rk.spearman(result.scores["ra"], result.scores["ra_loss_row"])
    )
