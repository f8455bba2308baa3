"""Merging studies that ran side by side (one process per cell): settings must agree, the
speed goal is recomputed from every cell's seconds, no cell twice; the command line's errors."""

from __future__ import annotations

import json

import pytest
from helpers import disk_full_beyond

from ra_lens.experiments import ranking_study
from ra_lens.experiments.ranking_study import SPEED_GOAL, merge_saved


def saved(task: str, cm: float, ra: float, runtime: float, **config) -> dict:
    cell = {
        "task": task,
        "shots": 5,
        "ablation": "zero",
        "seconds": {"ra": ra, "causal_mediation": cm},
    }
    return {
        "config": {"cells": [[task, 5]], "n_prompts": 25, "model": "m", **config},
        "runtime_seconds": runtime,
        "goals": {},
        "skipped": [f"{task} why"],
        "summary": [{"task": task, "ranking": "ra"}],
        "cells": [cell],
    }


def test_merge_recomputes_the_speed_goal_and_keeps_every_cell():
    merged = merge_saved([saved("a", 60.0, 1.0, 10.0), saved("b", 30.0, 1.0, 20.0)])
    assert merged["config"]["cells"] == [["a", 5], ["b", 5]]
    assert [c["task"] for c in merged["cells"]] == ["a", "b"]
    assert merged["runtime_seconds"] == 20.0 and merged["runtime_seconds_parts"] == [10.0, 20.0]
    goals = merged["goals"]
    assert goals["cm_over_ra_speed_ratio"] == {"a 5-shot zero": 60.0, "b 5-shot zero": 30.0}
    assert goals["cm_over_ra_speed_ratio_min"] == 30.0
    assert goals["cm_over_ra_speed_ratio_met"] is (30.0 >= SPEED_GOAL)
    assert merged["skipped"] == ["a why", "b why"] and len(merged["summary"]) == 2


def test_merge_refuses_studies_with_different_settings():
    with pytest.raises(ValueError, match="different settings \\(n_prompts\\)"):
        merge_saved([saved("a", 1.0, 1.0, 1.0), saved("b", 1.0, 1.0, 1.0, n_prompts=10)])
    with pytest.raises(ValueError, match="at least one"):
        merge_saved([])


# --- the command line: user errors are one line and exit 2; a run where no cell ran fails ----


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = ranking_study.main(list(argv))
    return code, capsys.readouterr().err


def test_merge_refuses_a_cell_twice():
    with pytest.raises(ValueError, match="repeat the cells a 5-shot zero"):
        merge_saved([saved("a", 1.0, 1.0, 1.0), saved("a", 1.0, 1.0, 1.0)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--batch-size", "0"], "batch_size must be an int >= 1, got 0"),
        (["--quick", "--n-prompts", "-1"], "n_prompts must be an int >= 1, got -1"),
        (["--quick", "--n-test", "-1"], "n_test must be an int >= 1, got -1"),
        (["--quick", "--cells", "nope:1"], "bad cell 'nope:1'"),
        (["--quick", "--rankings", "nope"], "unknown ranking 'nope'"),
        (["--quick", "--device", "nodevice"], "unknown device 'nodevice'"),
        (["--markdown", "{missing}"], "missing.json: no such file"),
        (["--markdown", "{broken}"], "broken.json is not valid JSON"),
        (["--markdown", "{folder}"], "is a folder, not a saved study"),
        (["--markdown", "{other}"], "other.json is not a saved ranking study"),
        (["--merge", "{good}", "{good}", "--json", "{out}"], "good.json more than once"),
        (["--merge", "{good}", "--json", "{folder}"], "is a folder: give the merged study's"),
        (["--merge", "{missing}", "--json", "{out}"], "missing.json: no such file"),
        (["--merge", "{good}"], "--merge needs --json FILE"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, tmp_path, argv, message):
    (tmp_path / "broken.json").write_text('{"cells": [')
    (tmp_path / "other.json").write_text('{"cells": []}')
    (tmp_path / "good.json").write_text(json.dumps(saved("a", 2.0, 1.0, 1.0)))
    paths = {
        "missing": tmp_path / "missing.json",
        "broken": tmp_path / "broken.json",
        "other": tmp_path / "other.json",
        "good": tmp_path / "good.json",
        "folder": tmp_path,
        "out": tmp_path / "merged.json",
    }
    code, err = run_cli(capsys, *(a.format(**paths) for a in argv))
    assert code == 2
    assert err.startswith("ranking_study: error: ") and message in err and err.count("\n") == 1


def test_merge_on_a_full_disk_keeps_the_earlier_study(capsys, tmp_path, monkeypatch):
    """A failed write of --merge --json leaves the file as it was, not a truncated JSON."""
    monkeypatch.setattr(ranking_study, "_markdown", lambda data, path: "(the table)")
    (tmp_path / "a.json").write_text(json.dumps(saved("a", 2.0, 1.0, 1.0)))
    (tmp_path / "b.json").write_text(json.dumps(saved("b", 2.0, 1.0, 1.0)))
    out = tmp_path / "merged.json"
    earlier = json.dumps(saved("c", 2.0, 1.0, 1.0))
    out.write_text(earlier)
    with disk_full_beyond(len(earlier)):
        code, err = run_cli(capsys, "--merge", *(str(tmp_path / n) for n in ("a.json", "b.json")), "--json", str(out))  # fmt: skip
    assert code == 2 and err == "ranking_study: error: [Errno 27] File too large\n"
    assert out.read_text() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "merged.json"]


def test_cuda_without_cuda_is_a_user_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run_cli(capsys, "--quick", "--device", "cuda")
    assert code == 2 and "CUDA is not available here, use --device cpu" in err


def test_explicit_flags_win_over_quick(capsys, monkeypatch):
    seen = {}

    def fake_study(model, **kwargs):
        seen.update(kwargs)
        return ranking_study.StudyResult([], {}, 0.0, ["toy 2-shot zero: stopped"])

    monkeypatch.setattr(ranking_study, "ranking_study", fake_study)
    argv = ["--quick", "--cells", "toy:2", "--n-prompts", "3", "--n-boot", "20"]
    code, err = run_cli(capsys, *argv)
    assert [(task.name, shots) for task, shots in seen["cells"]] == [("toy", 2)]
    assert (seen["n_prompts"], seen["n_boot"]) == (3, 20)
    assert seen["n_means"] == ranking_study.QUICK_SETTINGS["n_means"]  # not given: --quick's
    assert code == 1 and "no cell ran (1 failed)" in err  # every cell failed: a failure


def test_a_run_where_every_cell_fails_exits_non_zero(capsys, monkeypatch):
    def failing(*args, **kwargs):
        raise ValueError("too few usable pairs")

    monkeypatch.setattr(ranking_study, "head_ranking", failing)
    code, err = run_cli(capsys, "--quick", "--ablations", "zero")
    assert code == 1 and "no cell ran (2 failed)" in err
