"""The documentation site, built once per test module: `mkdocs build --strict` into a temporary
folder (the same command as `make docs`), and its inventory of documented Python objects."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

from helpers import REPO_ROOT


def mkdocs_missing() -> str | None:
    """Why the site cannot be built here, or None when it can."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[docs]')"
    return None


def build_site(dest: Path) -> Path:
    """Build the site into `dest` with --strict (any warning fails) and return it."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest)],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return dest


def documented(site: Path) -> set[str]:
    """Every Python object the API reference documents: the names in the site's objects.inv
    (Sphinx's inventory format, which mkdocstrings writes: four header lines, then zlib)."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if " py:" in line}
