"""The circuit study's prompt pairs (experiments/circuit_study_pairs.py)."""

from __future__ import annotations

import pytest
from helpers import arch_or_hooked

from ra_lens.experiments.circuit_study_pairs import QUICK_WORDS, TASKS, task_pairs
from ra_lens.toy_models import tiny_model


def test_toy_pairs_swap_one_word_and_keep_the_token_length():
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    pairs = task_pairs(model, "toy", 4)
    # each word against the next one, as long as the tiny tokenizer keeps them one token
    assert [p.clean for p in pairs] == [f"I like {x} and" for x in QUICK_WORDS[:4]]
    assert [p.corrupted for p in pairs] == [f"I like {y} and" for y in QUICK_WORDS[1:5]]
    assert {(p.answer, p.wrong, p.task) for p in pairs} == {(" the", " of", "toy")}
    for p in pairs:
        assert model.to_tokens(p.clean).shape == model.to_tokens(p.corrupted).shape


def test_an_unknown_task_names_the_tasks():
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    with pytest.raises(ValueError, match=f"unknown task 'nope': choose from {', '.join(TASKS)}"):
        task_pairs(model, "nope", 2)


def test_a_pair_seed_draws_other_ioi_pairs_and_is_refused_for_fixed_lists(monkeypatch):
    from ra_lens.tasks import ioi

    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    # the tiny tokenizer splits the names: keep every pair here (usable is tested with ioi)
    monkeypatch.setattr(ioi, "usable", lambda model, pairs: pairs)
    seeded = task_pairs(model, "ioi", 3, seed=7)
    assert seeded == ioi.ioi_pairs(12, seed=7)[:3]
    assert len(seeded) == 3 and seeded != task_pairs(model, "ioi", 3)
    for task in ("country-capital", "antonym", "toy"):
        with pytest.raises(ValueError, match="only ioi's pairs are drawn at random"):
            task_pairs(model, task, 3, seed=7)
