"""The files a release carries beside the code, and what tools/check_wheel.py reads from them.

`make check-wheel` builds and installs the wheel itself (minutes); these checks are instant.
"""

from __future__ import annotations

import importlib.util
import re

import yaml
from helpers import REPO_ROOT

import ra_lens


def _check_wheel():
    spec = importlib.util.spec_from_file_location(
        "check_wheel", REPO_ROOT / "tools" / "check_wheel.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_version_is_in_the_changelog_and_the_citation() -> None:
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(
        rf"^## {re.escape(ra_lens.__version__)} \(\d{{4}}-\d\d-\d\d\)$", changelog, re.M
    )
    citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert citation["version"] == ra_lens.__version__
    (paper,) = citation["references"]
    assert (
        paper["title"] == "Reversed Attention: On the Gradient Descent of Attention Layers in GPT"
    )
    assert [a["family-names"] for a in paper["authors"]] == ["Katz", "Wolf"]


def test_license_and_typed_marker() -> None:
    assert (REPO_ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    assert (REPO_ROOT / "ra_lens" / "py.typed").is_file()


def test_check_wheel_finds_the_readmes_ten_lines() -> None:
    code = _check_wheel().ten_lines(REPO_ROOT / "README.md")
    assert "ra_lens.load_model()" in code and "ra.top_heads(3)" in code
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    compile(code, "README.md", "exec")
