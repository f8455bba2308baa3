"""The head-ranking experiment's settings and zero-shot route (experiments/head_ranking.py);
the full run is in test_head_ranking_end_to_end.py."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked

from ra_lens import ranking as rk
from ra_lens import tasks
from ra_lens.experiments import head_ranking
from ra_lens.tasks import task_prompts
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


def test_head_ranking_zero_shot_skips_patching_and_mean_ablates(llama):
    res = head_ranking(
        llama, TOY, shots=0, n_prompts=3, fractions=(0.0, 1.0), ablation="mean",
        rankings=("ra", "activation_patching", "indirect_effect", "random"), progress=False,
    )  # fmt: skip
    assert list(res.scores) == ["ra", "random"]
    assert any("zero-shot" in note for note in res.notes)
    assert res.ablation == "mean" and res.to_dict()["ablation"] == "mean"
    # Todd et al.'s mean: every training prompt (held out from the test), aligned at the last token
    train, _ = task_prompts(llama, TOY, shots=0, equal_length=False)
    assert res.n_means == len(train) and res.to_dict()["n_means"] == len(train)
    _, test = task_prompts(llama, TOY, shots=0)
    means = rk.last_token_means(llama, [p.text for p in train])
    hooks = rk.ablation_hooks(rk.head_order(torch.zeros(2, llama.cfg.n_heads)), means=means)
    lengths = tasks.prompt_lengths(llama, test)
    for i, prompt in enumerate(test):  # one prompt at a time: no padding to misalign the means
        alone = tasks.evaluate(llama, [prompt], fwd_hooks=hooks)
        assert res.curves["ra"].accuracies[0].ranks[i] == alone.ranks[0], lengths[i]
    with pytest.raises(ValueError, match="unknown ablation"):
        head_ranking(llama, TOY, shots=0, n_prompts=2, ablation="resample")


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"n_test": -1}, "n_test must be an int >= 1, got -1"),
        ({"n_test": 0}, "n_test must be an int >= 1, got 0"),
        ({"n_prompts": -2}, "n_prompts must be an int >= 1"),
        ({"n_boot": 0}, "n_boot must be an int >= 1"),
        ({"n_means": -5}, "n_means must be an int >= 1"),
        ({"eval_batch_size": 0}, "eval_batch_size must be an int >= 1"),
        ({"shots": -1}, "shots must be an int >= 0"),
    ],
)
def test_head_ranking_refuses_negative_counts(llama, setting, message):
    with pytest.raises(ValueError, match=message):
        head_ranking(llama, TOY, **{"shots": 1, "n_prompts": 4, **setting}, progress=False)
