"""The benchmark scripts as the tests of tests/benchmarks/ import them."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO_ROOT

BENCH_DIR = REPO_ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """benchmarks/{bench_ra,harness,baselines}.py, imported the way `python benchmarks/bench_ra.py`
    imports them (benchmarks/ first on sys.path)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        yield SimpleNamespace(
            **{name: importlib.import_module(name) for name in ("bench_ra", "harness", "baselines")}
        )
    finally:
        sys.path.remove(str(BENCH_DIR))
