"""Copy the executed notebooks into docs/notebooks/, where the site renders them with their
outputs (mkdocs-jupyter, never executing them).

    RA_LENS_NOTEBOOK_OUT=build/notebooks .venv/bin/python -m pytest -q tests/notebooks -m notebook
    .venv/bin/python tools/docs_notebooks.py build/notebooks

The test run appends one probe cell (which Python ran the kernel); it is dropped here, so each
copy holds exactly its source's cells (tests/docs/test_site.py checks it). A copy whose cells
differ from the source, or that holds an error, is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import sys\nprint(sys.prefix)"


def _cells(nb: dict) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def copy_executed(executed: Path, dest: Path = ROOT / "docs" / "notebooks") -> list[Path]:
    """Copy each executed notebook of `executed` whose source is in notebooks/; raise on one
    that is stale or errored. Returns the files written."""
    written = []
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        path = executed / source.name
        if not path.is_file():
            raise SystemExit(f"{path} missing: execute the notebooks first (see this file's doc)")
        nb = json.loads(path.read_text(encoding="utf-8"))
        if nb["cells"] and "".join(nb["cells"][-1]["source"]) == PROBE:
            nb["cells"] = nb["cells"][:-1]
        if _cells(nb) != _cells(json.loads(source.read_text(encoding="utf-8"))):
            raise SystemExit(f"{path} was executed from other cells than {source}: run it again")
        outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
        if any(o["output_type"] == "error" for o in outputs):
            raise SystemExit(f"{path} holds an error output")
        target = dest / source.name
        target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/docs_notebooks.py EXECUTED_FOLDER")
    for path in copy_executed(Path(sys.argv[1])):
        print(path.relative_to(ROOT))
