"""tasks/accuracy.py: `evaluate` under patch hooks on prompts of mixed lengths equals one prompt at a
time."""

from __future__ import annotations

import pytest
import torch
from helpers import live_archs

import ra_lens
from ra_lens import tasks
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def tiny(request):
    return tiny_model(request.param, n_layers=2)


def test_evaluate_with_patch_on_mixed_lengths_equals_one_prompt_at_a_time(tiny):
    task = tasks.load("antonym")
    prompts = tasks.build_prompts(task, task.pairs[:12], shots=0)
    prompts += tasks.build_prompts(task, task.pairs[12:20], shots=1, demos_from=task.pairs[30:])
    assert len(set(tasks.prompt_lengths(tiny, prompts))) > 1
    n = tasks.prompt_lengths(tiny, prompts[:1])[0]
    maps = torch.randn(tiny.cfg.n_layers, tiny.cfg.n_heads, n, n) * 0.05
    hooks = ra_lens.attention_patch_hooks(maps, -5.0)
    together = tasks.evaluate(tiny, prompts, fwd_hooks=hooks, batch_size=16)
    alone = [tasks.evaluate(tiny, [p], fwd_hooks=hooks).ranks[0] for p in prompts]
    assert together.ranks.tolist() == [int(r) for r in alone]
