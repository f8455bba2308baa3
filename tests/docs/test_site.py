"""The documentation site: it builds with --strict (no warning: a broken link, cross-reference
or docstring fails), every public name has an API entry, the pages show what the README and the
notebooks hold, and the docstrings' doctests render as code."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
from docs_site import build_site, documented, mkdocs_missing
from helpers import REPO_ROOT

import ra_lens

_MISSING = mkdocs_missing()
needs_mkdocs = pytest.mark.skipif(_MISSING is not None, reason=f"cannot build the site: {_MISSING}")
DOCS = REPO_ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))


def public_packages() -> list[str]:
    """ra_lens and each of its public subpackages."""
    found = ["ra_lens"]
    for info in pkgutil.iter_modules(ra_lens.__path__, "ra_lens."):
        if info.ispkg and not info.name.rsplit(".", 1)[1].startswith("_"):
            found.append(info.name)
    return found


def _home(package: str, name: str) -> set[str]:
    """The paths under which a public name may be documented: where it is exported, and where
    it is defined (a function sharing its module's name, such as circuits.attribute, is
    documented from its module)."""
    obj: Any = getattr(importlib.import_module(package), name)
    paths = {f"{package}.{name}"}
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        paths.add(f"{module}.{qualname}")
    return paths


@pytest.mark.slow  # builds the whole site (mkdocs, about a minute)
@needs_mkdocs
def test_every_public_name_has_an_api_entry(site: Path) -> None:
    entries = documented(site)
    missing = [
        f"{package}.{name}"
        for package in public_packages()
        for name in getattr(importlib.import_module(package), "__all__", [])
        if not _home(package, name) & entries
    ]
    assert len(public_packages()) >= 8
    assert missing == [], f"public names without an API entry (docs/api/*.md): {missing}"


@pytest.mark.slow  # builds the whole site (mkdocs, about a minute)
@needs_mkdocs
def test_every_page_is_built_with_its_figures(site: Path) -> None:
    for page in ("index", "getting-started", "concepts/ra", "concepts/circuits", "api/ra_lens",
                 "notebooks/01_quickstart", "results/head-ranking"):  # fmt: skip
        assert (site / f"{page}.html").is_file(), page
    home = (site / "index.html").read_text()
    assert 'src="figures/figure1_top_heads.png"' in home
    assert (site / "figures" / "figure1_top_heads.png").is_file()
    # the API page renders each doctest as a code block (not as nested Markdown quotes)
    api = (site / "api" / "ra_lens.html").read_text()
    assert 'id="ra_lens.reversed_attention"' in api
    assert "<code>&gt;&gt;&gt; import ra_lens" in api
    assert "<blockquote>" not in api


def test_ten_lines_on_the_site_are_the_readme_s() -> None:
    """The home page and Getting started include docs/_snippets/ten_lines.txt, which must be
    the README's ten lines (the ones `make check-wheel` runs)."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("## Ten lines", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert (DOCS / "_snippets" / "ten_lines.txt").read_text() == block
    for page in ("index.md", "getting-started.md"):
        assert '--8<-- "docs/_snippets/ten_lines.txt"' in (DOCS / page).read_text()


def _cells(path: Path) -> list[tuple[str, str]]:
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


@pytest.mark.parametrize("source", sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")),
                         ids=lambda p: p.stem)  # fmt: skip
def test_rendered_notebook_is_the_executed_source(source: Path) -> None:
    """docs/notebooks/ holds each notebook executed (tools/docs_notebooks.py copies them from
    `make notebooks`): the same cells as the committed source, every code cell run, no error."""
    rendered = DOCS / "notebooks" / source.name
    assert rendered.is_file(), f"{rendered} missing: run tools/docs_notebooks.py"
    assert _cells(rendered) == _cells(source), (
        f"{rendered.name} is stale: run tools/docs_notebooks.py"
    )
    code = [c for c in json.loads(rendered.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code)
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]


def test_every_page_and_notebook_is_in_the_nav() -> None:
    """A page left out of mkdocs.yml's nav would be built but unreachable."""
    config = (REPO_ROOT / "mkdocs.yml").read_text()
    pages = [
        p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb")
    ]
    skipped = re.compile(r"^(architecture\.md|results/[^/]*_[^/]*\.md|results/ranking_study/.*)$")
    assert [p for p in pages if not skipped.match(p) and p not in config] == []


def test_doctest_blocks_are_fenced() -> None:
    """The griffe extension turns a docstring's doctest lines into a pycon block, keeps code
    that is already fenced, and escapes index brackets in prose."""
    import sys

    pytest.importorskip(
        "griffe", reason="the docs extra is not installed (pip install -e '.[docs]')"
    )
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from griffe_doctests import fence_doctests, split_grouped_args
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    text = "Intro [layer][head] lists.\n\n    >>> x = 1\n    >>> x\n    1\n\nAfter.\n```\n>>> kept\n```"
    assert fence_doctests(text) == (
        "Intro [layer]\\[head] lists.\n\n    ```pycon\n    >>> x = 1\n    >>> x\n    1\n    ```\n\n"
        "After.\n```\n>>> kept\n```"
    )
    args = "Args:\n    clean, corrupted: the prompts.\n    metric: M."
    assert split_grouped_args(args) == (
        "Args:\n    clean: the prompts.\n    corrupted: as `clean`.\n    metric: M."
    )
