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
        ({"n_prompts": -1}, "n_prompts must be a whole number >= 2"),
        ({"n_prompts": 1}, "n_prompts must be a whole number >= 2"),
        ({"n_test": -1}, "n_test must be a whole number >= 1"),
        ({"n_test": 0}, "n_test must be a whole number >= 1"),
        ({"scales": []}, "non-empty sequence of finite numbers"),
        ({"scales": [1.0, float("nan")]}, "non-empty sequence of finite numbers"),
        ({"shots": -1}, "shots must be a whole number >= 0"),
    ],
)
def test_attention_patching_refuses_bad_counts(model, kwargs, message):
    from ra_lens.experiments import attention_patching

    arguments = {"shots": 1, "n_prompts": 2, "scales": [-4.0], "progress": False} | kwargs
    with pytest.raises(ValueError, match=message):
        attention_patching(model, "antonym", **arguments)
