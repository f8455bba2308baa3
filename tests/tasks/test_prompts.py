"""tasks/prompts.py: shuffled-label prompts keep their queries and move every label."""

from __future__ import annotations

import pytest
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked

from ra_lens import tasks
from ra_lens.tasks import shuffled_label_prompts, task_prompts
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


def _toy_prompts(model):
    return task_prompts(model, TOY, shots=2)


def test_shuffled_label_prompts_keep_queries_and_move_every_label(llama):
    train, _ = _toy_prompts(llama)
    corrupted = shuffled_label_prompts(train, seed=0)
    for clean, bad in zip(train, corrupted, strict=True):
        assert (bad.query, bad.answer) == (clean.query, clean.answer)
        assert [x for x, _ in bad.demos] == [x for x, _ in clean.demos]
        assert sorted(y for _, y in bad.demos) == sorted(y for _, y in clean.demos)
        assert all(a != b for (_, a), (_, b) in zip(bad.demos, clean.demos, strict=True))
        assert bad.text == tasks.format_prompt(bad.demos, bad.query)
    assert tasks.prompt_lengths(llama, corrupted) == tasks.prompt_lengths(llama, train)
    one_shot = tasks.build_prompts(TOY, shots=1)
    moved = shuffled_label_prompts(one_shot)
    assert all(a.demos[0][1] != b.demos[0][1] for a, b in zip(moved, one_shot, strict=True))
    with pytest.raises(ValueError, match="demonstrations"):
        shuffled_label_prompts(tasks.build_prompts(TOY, shots=0))
