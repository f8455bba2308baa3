"""Build ra-lens's sdist and wheel, install the wheel into a fresh virtual environment outside the
repository (not editable), and run the README's ten lines and `ra-lens --help` there.

A file the package needs at run time but the wheel leaves out (the circuit page's assets, the task
data, `py.typed`, the embedded model registry) fails here, where `pip install -e .` inside the
repository would still find it. `make check-wheel` runs it; `make test` runs it first.

    python tools/check_wheel.py                     # build, install, run; prints each step's seconds
    python tools/check_wheel.py --keep DIR          # build and install into DIR (kept) instead of a temporary folder

torch is installed first at TORCH_VERSION (the Makefile's pin, default 2.13.0), as the Makefile does,
so pip takes the CPU build from its cache instead of resolving a multi-GB CUDA one; pip's cache is
allowed. The embedded SmolLM2 comes from the ra-lens cache (RA_LENS_CACHE, default
~/.cache/ra_lens), which `make models` fills.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Files the wheel must carry (glob patterns inside it) and the sdist must carry (beside the package).
WHEEL_FILES = (
    "ra_lens/py.typed",
    "ra_lens/viz/page_assets/page.html",
    "ra_lens/viz/page_assets/page.css",
    "ra_lens/viz/page_assets/page.js",
    "ra_lens/tasks/data/antonym.json",
    "ra_lens/smollm2.py",
    "ra_lens/gemma3.py",
    "ra_lens-*.dist-info/licenses/LICENSE",
)
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "CITATION.cff", "pyproject.toml")

#: Run after the README's ten lines, in the installed package: what they print must be what the
#: README's comments say, and the package must be the installed one, with its data.
AFTER_TEN_LINES = """
import importlib.metadata, importlib.resources, pathlib
assert "site-packages" in ra_lens.__file__, ra_lens.__file__
assert ra_lens.__version__ == importlib.metadata.version("ra-lens"), ra_lens.__version__
assert tuple(ra.maps.shape) == (1, 30, 9, 12, 12), ra.maps.shape
top = [(layer, head, round(value, 4)) for layer, head, value in ra.top_heads(3)]
assert top == [(23, 4, 0.0697), (23, 3, 0.0279), (23, 5, 0.0219)], top
assert logits.shape[-1] == model.cfg.d_vocab, logits.shape
assert len(ra_lens.tasks.available()) == 8 and len(ra_lens.tasks.load("antonym")) == 141
assets = importlib.resources.files("ra_lens.viz").joinpath("page_assets")
assert all(assets.joinpath(name).is_file() for name in ("page.html", "page.css", "page.js"))
assert importlib.resources.files("ra_lens").joinpath("py.typed").is_file()
print("ten lines ok:", ra_lens.__file__, top)
"""


def ten_lines(readme: Path) -> str:
    """The first ```python block after the README's "## Ten lines" heading."""
    text = readme.read_text(encoding="utf-8")
    match = re.search(r"^## Ten lines\b.*?^```python\n(.*?)^```", text, flags=re.M | re.S)
    if match is None:
        raise SystemExit(f"{readme}: no ```python block under '## Ten lines'")
    return match.group(1)


def run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command, echoing it; on failure print its output and stop."""
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout + done.stderr)
        raise SystemExit(f"failed (exit status {done.returncode}): {' '.join(cmd)}")
    return done.stdout


def check_archives(dist: Path) -> Path:
    """The wheel and sdist hold WHEEL_FILES and SDIST_FILES; returns the wheel's path."""
    (wheel,) = dist.glob("ra_lens-*.whl")
    (sdist,) = dist.glob("ra_lens-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    missing = [p for p in WHEEL_FILES if not any(Path(n).match(p) for n in names)]
    with tarfile.open(sdist) as tar:
        top = {"/".join(n.split("/")[1:]) for n in tar.getnames()}
    missing += [f"{sdist.name}: {p}" for p in SDIST_FILES if p not in top]
    if missing:
        raise SystemExit(f"missing from {wheel.name} / the sdist: {missing}")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ra-lens-wheel-"))
    if ROOT in work.resolve().parents or work.resolve() == ROOT:
        raise SystemExit(f"--keep {work}: must be outside the repository {ROOT}")
    work.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["MPLBACKEND"] = "Agg"

    start = time.perf_counter()
    dist = work / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=work, env=env)
    wheel = check_archives(dist)
    seconds["build"] = time.perf_counter() - start

    start = time.perf_counter()
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=work, env=env)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-compile",
    ]
    run([*pip, f"torch=={os.environ.get('TORCH_VERSION', '2.13.0')}"], cwd=work, env=env)
    run([*pip, str(wheel)], cwd=work, env=env)
    seconds["install"] = time.perf_counter() - start

    start = time.perf_counter()
    script = work / "ten_lines.py"
    script.write_text(ten_lines(ROOT / "README.md") + AFTER_TEN_LINES, encoding="utf-8")
    print(run([str(venv / "bin" / "python"), str(script)], cwd=work, env=env).strip())
    usage = run([str(venv / "bin" / "ra-lens"), "--help"], cwd=work, env=env)
    for command in ("maps", "patch", "rank", "attribute", "circuit"):
        if command not in usage:
            raise SystemExit(f"ra-lens --help does not list {command!r}:\n{usage}")
    seconds["run"] = time.perf_counter() - start

    print("wheel check ok:", ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    if args.keep is None:
        import shutil

        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
