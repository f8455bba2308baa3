"""Merging studies that ran side by side (one process per cell): settings must agree, the
speed goal is recomputed from every cell's seconds."""

from __future__ import annotations

import pytest

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
