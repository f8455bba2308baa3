"""The attention-patching experiment (experiments/attention_patching.py) refuses counts and sweeps
that would silently shrink."""

from __future__ import annotations

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_prompts": -1}, "n_prompts must be an int >= 2"),
        ({"n_prompts": 1}, "n_prompts must be an int >= 2"),
        ({"n_test": -1}, "n_test must be an int >= 1"),
        ({"n_test": 0}, "n_test must be an int >= 1"),
        ({"scales": []}, "non-empty sequence of finite numbers"),
        ({"scales": [1.0, float("nan")]}, "non-empty sequence of finite numbers"),
        ({"shots": -1}, "shots must be an int >= 0"),
    ],
)
def test_attention_patching_refuses_bad_counts(model, kwargs, message):
    from ra_lens.experiments import attention_patching

    arguments = {"shots": 1, "n_prompts": 2, "scales": [-4.0], "progress": False} | kwargs
    with pytest.raises(ValueError, match=message):
        attention_patching(model, "antonym", **arguments)


def test_the_scale_is_chosen_on_validation_prompts_and_scored_on_test_prompts(model):
    """The headline scale is the best on prompts other than those it is scored on: the unused
    training prompts (or half the held-out ones), its test accuracy measured again by hand."""
    from helpers import TOY_PAIRS

    from ra_lens.experiments import attention_patching
    from ra_lens.experiments.attention_patching import mean_reversed_attention
    from ra_lens.patching import attention_patch_hooks
    from ra_lens.tasks import Task, evaluate, task_prompts

    task = Task("toy", TOY_PAIRS)
    scales = [0.0, -4.0, -40.0, 3.0]
    result = attention_patching(model, task, shots=1, n_prompts=3, scales=scales, progress=False)
    train, held_out = task_prompts(model, task, 1, seed=42)
    assert result.n_validation >= 2 and result.ra_validation and result.forward_validation
    if result.validation_from == "held-out":
        validation, test = held_out[: len(held_out) // 2], held_out[len(held_out) // 2 :]
    else:
        validation, test = train[3 : 3 + result.n_validation], held_out
    assert not {p.text for p in validation} & {p.text for p in test}
    assert result.n_test == len(test)
    ra = mean_reversed_attention(model, train[:3])
    val = [evaluate(model, validation, fwd_hooks=attention_patch_hooks(ra, s, model=model),
                    batch_size=32, by_length=True).top3 for s in scales]  # fmt: skip
    best = max(range(len(scales)), key=lambda i: (val[i], -abs(scales[i])))
    scale, val_top3, test_top3 = result.chosen(3)
    hooks = attention_patch_hooks(ra, scale, model=model)
    truth = evaluate(model, test, fwd_hooks=hooks, batch_size=32, by_length=True).top3
    assert (scale, val_top3, test_top3) == (scales[best], val[best], truth)
    report = result.to_dict()["chosen_ra_top3"]
    assert report == {"scale": scale, "validation_top3": val_top3, "test_top3": test_top3}
    assert f"RA scale chosen on {result.n_validation} validation prompts" in result.table()
