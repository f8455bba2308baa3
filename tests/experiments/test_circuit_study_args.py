"""The circuit study's flags and the settings they ask for (experiments/circuit_study_args.py)."""

from __future__ import annotations

import pytest

from ra_lens.experiments.circuit_study import FULL_SETTINGS, METHODS, QUICK_SETTINGS
from ra_lens.experiments.circuit_study_args import parser, settings


def chosen(argv: list[str]) -> dict:
    args = parser(tuple(METHODS), None).parse_args(argv)
    return settings(args, QUICK_SETTINGS if args.quick else FULL_SETTINGS, tuple(METHODS))


def test_flags_win_over_the_base_settings_and_leave_them_as_they_were():
    before = dict(QUICK_SETTINGS)
    got = chosen(["--quick", "--methods", "eap,random", "--n-pairs", "5", "--truth-tasks", ""])
    assert got == {**before, "methods": ["eap", "random"], "n_pairs": 5, "truth_tasks": []}
    assert QUICK_SETTINGS == before
    assert chosen(["--train-pairs", "0", "--selection", "greedy", "--pair-seed", "7"]) == {
        **FULL_SETTINGS, "train_pairs": 0, "selection": "greedy", "pair_seed": 7,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "eap,nope"], "unknown method nope: choose from eap, eap-noise"),
        (["--tasks", " , "], r"unknown task \(none\): choose from ioi, country-capital"),
        (["--ablations", "mean,half"], "unknown ablation half: choose from patching, mean, zero"),
        (["--n-boot", "0"], "--n-boot must be at least 1, got 0"),
        (["--train-pairs", "-1"], "--train-pairs must be at least 0, got -1"),
        (["--pair-seed", "-1"], "--pair-seed must be at least 0, got -1"),
    ],
)
def test_a_bad_value_is_named(argv, message):
    with pytest.raises(ValueError, match=message):
        chosen(argv)
