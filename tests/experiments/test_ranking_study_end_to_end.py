"""The ranking study's --quick run end to end (slow: the file name's `_end_to_end`): runtime
seconds and intervals in its JSON."""

from __future__ import annotations

import json

import pytest
from helpers import arch_or_hooked

from ra_lens.experiments.head_ranking import RANKINGS


def test_ranking_study_quick_writes_runtime_seconds_and_intervals(tmp_path, capsys):
    from ra_lens.experiments.ranking_study import QUICK_SETTINGS, main

    out = tmp_path / "study.json"
    assert main(["--quick", "--json", str(out), "--plots", str(tmp_path / "plots")]) == 0
    data = json.loads(out.read_text())
    assert data["runtime_seconds"] > 0
    assert data["config"]["model"] == f"tiny-{arch_or_hooked('llama')} (random weights)"
    fractions = list(QUICK_SETTINGS["fractions"])
    assert data["config"]["fractions"] == fractions and 0 < fractions[1] < 1
    cells = {(c["task"], c["shots"], c["ablation"]) for c in data["cells"]}
    assert cells == {("toy", s, a) for s in (0, 2) for a in ("zero", "mean")}
    goals = data["goals"]
    ratios = {
        f"toy {c['shots']}-shot {c['ablation']}": c["seconds"]["causal_mediation"]
        / c["seconds"]["ra"]
        for c in data["cells"]
    }
    assert goals["cm_over_ra_speed_ratio"] == pytest.approx(ratios)
    assert goals["cm_over_ra_speed_ratio_min"] == pytest.approx(min(ratios.values()))
    assert goals["cm_over_ra_speed_ratio_goal"] == 50.0  # reported, never asserted on timing
    assert goals["cm_over_ra_speed_ratio_met"] == (min(ratios.values()) >= 50.0)
    for cell in data["cells"]:
        expected = set(RANKINGS) if cell["shots"] else {
            n for n, spec in RANKINGS.items() if not spec.needs_labels
        }  # fmt: skip
        assert set(cell["rankings"]) == expected
        assert cell["fractions"] == fractions
        n_heads = cell["n_layers"] * cell["n_heads"]
        assert data["runtime_seconds"] >= cell["seconds"]["ablation_curves"] > 0
        assert cell["seconds"]["bootstrap"] > 0
        for name, entry in cell["rankings"].items():
            assert data["runtime_seconds"] > entry["seconds"] >= 0
            # heads kept grow with the fraction: none at 0 (every curve alike), all at 1
            assert entry["n_kept"] == [round(p * n_heads) for p in fractions]
            assert entry["n_kept"] == sorted(set(entry["n_kept"]))
            assert entry["curve"][0] == cell["rankings"]["ra"]["curve"][0]
            assert entry["curve"][-1] == entry["reverse_curve"][-1] == cell["unablated"]["top1"]
            for key in ("auc", "auc_top3", "reverse_auc"):
                ci = entry["intervals"][key]
                assert ci["low"] <= ci["estimate"] <= ci["high"]
                assert (ci["n"], ci["n_boot"]) == (cell["n_test"], QUICK_SETTINGS["n_boot"])
            assert entry["intervals"]["auc"]["estimate"] == pytest.approx(entry["auc"])
            if name != "ra":
                for key in ("paired_vs_ra", "spearman"):
                    ci = entry["intervals"][key]
                    assert ci["low"] <= ci["estimate"] <= ci["high"]
    # mean ablation reuses the protocol-independent rankings, recomputes causal mediation
    zero, mean = data["cells"][2], data["cells"][3]
    assert zero["rankings"]["ra"]["scores"] == mean["rankings"]["ra"]["scores"]
    assert (
        zero["rankings"]["causal_mediation"]["scores"]
        != mean["rankings"]["causal_mediation"]["scores"]
    )
    rows = data["summary"]
    assert all(row["n_test"] == 4 for row in rows)
    assert all(row["n_prompts"] == QUICK_SETTINGS["n_prompts"] for row in rows)
    assert len(list((tmp_path / "plots").glob("toy_*shot_*.png"))) == 4
    assert "causal mediation / RA seconds" in capsys.readouterr().out
    assert main(["--markdown", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(rows) and "| toy | 2 | mean | 4 | causal_mediation |" in "\n".join(
        table
    )
