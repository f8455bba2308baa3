"""`--truth-from`: an earlier run's truth is reused as stored for the same pairs, and a damaged
entry is refused with a ValueError naming the task and the fix (it was a KeyError)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens import attention_attribution
from ra_lens.experiments.attention_attribution import KINDS, _stored_truth
from ra_lens.tasks.ioi import PromptPair, paired_batch
from ra_lens.toy_models import tiny_model

PAIRS = [
    PromptPair("When Mary and John went to the store, John gave a drink to",
               "When John and Mary went to the store, John gave a drink to", "a", "b"),
    PromptPair("When John and Mary went to the store, Mary gave a drink to",
               "When Mary and John went to the store, Mary gave a drink to", "b", "a"),
]  # fmt: skip


@pytest.fixture(scope="module")
def setting():
    model = tiny_model(arch_or_hooked("llama"))
    clean, corrupted, metric = paired_batch(model, PAIRS)
    exact = attention_attribution(model, clean, corrupted, metric)
    first = PAIRS[0]
    truth = {kind: (exact.scores[kind] * 0.5 + 0.25).tolist() for kind in KINDS}
    stored = {
        "task": "toy",
        "n_pairs": len(PAIRS),
        "example": {"clean": first.clean, "corrupted": first.corrupted, "answer": first.answer,
                    "wrong": first.wrong},
        "metric_clean": float(exact.clean_metric.mean()),
        "metric_corrupted": float(exact.corrupted_metric.mean()),
        "scores": {"truth": truth},
        "seconds": {"truth": 12.5},
    }  # fmt: skip
    return exact, stored


def test_a_sound_entry_is_reused_as_stored(setting):
    exact, stored = setting
    truth, seconds = _stored_truth(stored, PAIRS, exact)
    assert seconds == 12.5
    for kind in KINDS:
        assert torch.equal(truth[kind], torch.tensor(stored["scores"]["truth"][kind]))


def _without(data: dict, *path: str) -> dict:
    data = copy.deepcopy(data)
    inner = data
    for key in path[:-1]:
        inner = inner[key]
    del inner[path[-1]]
    return data


def test_damaged_entries_are_refused_by_task(setting):
    exact, stored = setting
    short = copy.deepcopy(stored)
    short["scores"]["truth"]["key"] = short["scores"]["truth"]["key"][:1]
    damaged = [
        _without(stored, "metric_clean"),
        _without(stored, "scores", "truth", "key"),
        _without(stored, "scores"),
        _without(stored, "seconds"),
        short,
        {**stored, "scores": {"truth": {kind: "n/a" for kind in KINDS}}},
    ]
    for entry in damaged:
        with pytest.raises(ValueError, match="stored truth of task 'toy' is damaged") as error:
            _stored_truth(entry, PAIRS, exact)
        assert "run without --truth-from to measure it again" in str(error.value)
    with pytest.raises(ValueError, match="task None is damaged"):
        _stored_truth([1, 2], PAIRS, exact)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="measured on other pairs"):
        _stored_truth({**stored, "n_pairs": 3}, PAIRS, exact)
