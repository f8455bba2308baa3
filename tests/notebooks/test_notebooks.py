"""The tutorial notebooks run top to bottom on the default model, and are committed without outputs.

Each notebook is executed with nbclient in a temporary copy (so nothing it writes lands in the
repository), on a kernel pinned to this interpreter: a kernel spec written to a temporary
JUPYTER_PATH runs `sys.executable -m ipykernel_launcher`, so a user-level "python3" kernel of some
other Python can never be picked up. The notebooks carry their own `assert` cells on real values
(RA rows sum to zero, RA patching beats the unpatched model, predicted vs actual cosine > 0.99), so
"no cell errored" is a meaningful check.

The kernel runs torch on one thread (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS is already set:
the notebooks make many small forward passes, which gain little from threads, and on a shared
CPU oversubscribed threads made them 3-5 times slower. Set OMP_NUM_THREADS to override.

Set RA_LENS_NOTEBOOK_OUT=<folder> to keep the executed copies (with outputs and figures).
Executing them is marked `notebook` (and `real_model`): `make test-fast` leaves them out, `make
notebooks` runs only this file. The checks on the committed files run everywhere.

The sources are the jupytext percent scripts notebooks/0N_name.py (linted by ruff); each committed
.ipynb must hold exactly their cells (`test_notebook_matches_its_source`). The notebooks use only
public ra_lens names that work on TransformerBridge (TL 4) and HookedTransformer (TL 2.18) alike,
except 04_edit_dynamics and 07_nnsight (see TL4_ONLY).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 600
KERNEL = "python3"
#: Every tutorial notebook; a new one is added here (and to docs/notebooks/index.md and
#: mkdocs.yml's nav; tools/docs_notebooks.py copies its executed copy to docs/notebooks/).
EXPECTED = (
    "01_quickstart",
    "02_attention_patching",
    "03_circuits",
    "04_edit_dynamics",
    "05_circuits_qk",
    "06_circuit_discovery",
    "07_nnsight",
)
#: Notebooks that need TransformerLens 4, with the reason.
TL4_ONLY = {
    # edit_dynamics refuses HookedTransformer, and tiny_model boots HF models as TransformerBridge
    "04_edit_dynamics": "edit_dynamics and tiny_model need TransformerBridge",
    # nnsight 0.8.1 needs transformers >= 5, installed in the TL 4 environment only
    "07_nnsight": "nnsight needs transformers >= 5 (the TL 4 environment)",
}


def _marked(path: Path):
    """The notebook as a pytest parameter, marked tl4 when it is in TL4_ONLY."""
    marks = [pytest.mark.tl4] if path.stem in TL4_ONLY else []
    return pytest.param(path, marks=marks, id=path.stem)


def test_notebooks_are_present() -> None:
    names = {path.stem for path in NOTEBOOKS}
    for expected in EXPECTED:
        assert expected in names, f"notebooks/{expected}.ipynb is missing"
    unlisted = sorted(names - set(EXPECTED))
    assert not unlisted, f"add {unlisted} to EXPECTED in tests/notebooks/test_notebooks.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_documented(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} of {path.name} has outputs: strip them"
            assert cell.execution_count is None, f"cell {i} of {path.name} has an execution count"
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name} must open with a markdown cell"
    assert "What this shows" in first.source and "Runtime" in first.source, (
        f"the first cell of {path.name} must say what it shows and how long it takes"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_source(path: Path) -> None:
    """The committed .ipynb holds exactly the cells of its jupytext percent script."""
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    source = path.with_suffix(".py")
    assert source.exists(), (
        f"{path.name} has no source: write {source.name} (jupytext --to py:percent {path.name})"
    )
    expected = [(c.cell_type, c.source) for c in jupytext.read(source).cells]
    committed = [(c.cell_type, c.source) for c in nbformat.read(path, as_version=4).cells]
    fix = f"rebuild it: jupytext --sync notebooks/{source.name}"
    assert len(committed) == len(expected), (
        f"{path.name} has {len(committed)} cells, {source.name} {len(expected)}: {fix}"
    )
    for i, (got, want) in enumerate(zip(committed, expected, strict=True)):
        assert got == want, f"cell {i} of {path.name} differs from {source.name}: {fix}"


def test_every_source_has_its_notebook() -> None:
    for source in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py")):
        assert source.with_suffix(".ipynb").exists(), (
            f"{source.name} has no notebook: jupytext --sync notebooks/{source.name}"
        )


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory):
    """A JUPYTER_PATH whose "python3" kernel is this interpreter's ipykernel (and the thread
    default described in the module docstring), for the duration of the module."""
    pytest.importorskip("ipykernel")
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ra-lens test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    old = {name: os.environ.get(name) for name in ("JUPYTER_PATH", "OMP_NUM_THREADS")}
    os.environ["JUPYTER_PATH"] = str(root) + (
        os.pathsep + old["JUPYTER_PATH"] if old["JUPYTER_PATH"] else ""
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by the kernel's torch at import
    try:
        yield root
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _execute(path: Path, workdir: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    copy = workdir / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    # Last cell: report which Python environment ran the notebook (checked by the caller).
    probe = nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)")
    probe.id = "test-probe"
    nb.cells.append(probe)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute()
    finally:
        keep = os.environ.get("RA_LENS_NOTEBOOK_OUT")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, Path(keep) / path.name)
    return nb


@pytest.mark.real_model
@pytest.mark.notebook
@pytest.mark.parametrize("path", [_marked(p) for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_env: Path, tmp_path: Path) -> None:
    began = time.perf_counter()
    nb = _execute(path, tmp_path)  # raises CellExecutionError (with the traceback) on failure
    seconds = time.perf_counter() - began
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"cell {i} of {path.name} raised {errors[0].ename}"
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    assert Path(probe) == Path(sys.prefix), f"{path.name} ran in {probe}, not in {sys.prefix}"
    images = sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert images >= 1, f"{path.name} produced no figure"
    print(f"{path.name}: {seconds:.0f} s")  # reported, never asserted
