"""First paint of the circuit page: how long headless Chromium takes from navigation to the first
drawing of a 2,000-edge circuit on the screen (the goal: under a second on this machine).

    python benchmarks/bench_circuit_page.py [--edges 2000] [--repeats 5] [--json FILE]
    python benchmarks/bench_circuit_page.py --tiny --json out.json   # seconds: a tiny model

The page is built as `ra-lens circuit --html` builds it, from SmolLM2-135M-Instruct's "eap" edge
scores on 3 IOI pairs (no faithfulness curve: measuring it takes minutes and adds a few hundred
bytes to the page): the circuits at MIB's fractions, and the circuit of the top |score| edges
that keeps at least --edges edges after pruning, which the page opens on; each head of the
largest circuit carries its pattern and RA on the 3 pairs. Each repeat opens the page afresh
(network off) and reads `window.raLensFirstPaint`, which the page sets on the first animation
frame after its drawing (`performance.now()`: milliseconds since navigation began, so reading and
parsing the page, its JSON and script, and drawing are all in it). Wall clock: the browser is another process. Median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ra_lens import circuits
from ra_lens.files import write_file

# The headless browser lives with the tests (tests/browser.py), outside the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from browser import browser_missing, console_errors, headless_chromium, open_page  # noqa: E402


def setting(tiny: bool) -> tuple[Any, str, list[Any]]:
    """(model, its name, 3 pairs): SmolLM2 and IOI, or a tiny Llama and toy pairs."""
    from ra_lens.experiments.circuit_study import task_pairs

    if tiny:
        from ra_lens.models import bridge_available
        from ra_lens.toy_models import tiny_model

        arch = "llama" if bridge_available() else "hooked"
        model = tiny_model(arch, n_layers=4)
        return model, f"tiny-{arch}", task_pairs(model, "toy", 3)
    from ra_lens.models import load_model

    model = load_model(device="cpu")
    return model, "smollm2-135m", task_pairs(model, "ioi", 3)


def circuit_with(scores: circuits.EdgeScores, edges: int) -> circuits.Circuit:
    """The top-|score| circuit that keeps at least `edges` edges after pruning (all of the
    graph's if it has fewer)."""
    n = min(edges, scores.graph.n_edges)
    while True:
        circuit = scores.top(n)
        if circuit.n_edges >= edges or n == scores.graph.n_edges:
            return circuit
        n = min(scores.graph.n_edges, n + max(1, (edges - circuit.n_edges) * 2))


def run(tiny: bool, edges: int, repeats: int, log: Any = print) -> dict[str, Any]:
    from ra_lens.tasks import ioi

    reason = browser_missing()
    if reason is not None:
        raise SystemExit(f"no headless browser: {reason}")
    model, name, pairs = setting(tiny)
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    scores = circuits.attribute(model, clean, corrupted, metric, method="eap")
    circuit = circuit_with(scores, edges)
    start = time.perf_counter()
    page = scores.to_html(circuit=circuit, model=model, clean=clean, metric=metric)
    build = time.perf_counter() - start
    log(f"{name}: {scores.graph.n_edges:,} edges in the graph, circuit of {circuit.n_edges:,}; "
        f"page {len(page.html) / 1e6:.2f} MB built in {build:.1f} s")  # fmt: skip
    first_paint, drawn = [], 0
    with (
        tempfile.TemporaryDirectory(prefix="ra_lens_page_bench_") as folder,
        headless_chromium() as driver,
    ):
        path = page.save(Path(folder) / "circuit.html")
        for i in range(repeats + 1):  # the first load warms the browser's caches: not counted
            open_page(driver, path)
            value = None
            for _ in range(200):
                value = driver.execute_script("return window.raLensFirstPaint")
                if value is not None:
                    break
                time.sleep(0.05)
            if value is None:
                raise RuntimeError("the page never reported its first paint")
            errors = console_errors(driver)
            if errors:
                raise RuntimeError(f"console errors: {errors}")
            drawn = driver.execute_script(
                "return document.querySelectorAll('#graph-svg path.edge').length"
            )
            if i:
                first_paint.append(value / 1e3)
            log(f"load {i}{' (warm-up)' if not i else ''}: first paint {value / 1e3:.3f} s")
    median = statistics.median(first_paint)
    log(f"first paint of {circuit.n_edges:,} edges ({drawn:,} paths): median {median:.3f} s "
        f"over {repeats} loads (goal < 1 s: {'met' if median < 1 else 'missed'})")  # fmt: skip
    return {
        "model": name,
        "graph_edges": scores.graph.n_edges,
        "circuit_edges": circuit.n_edges,
        "paths_drawn": drawn,
        "page_bytes": len(page.html.encode()),
        "build_seconds": build,
        "first_paint_seconds": first_paint,
        "first_paint_median_seconds": median,
        "goal_seconds": 1.0,
        "goal_met": median < 1.0,
        "clock": "wall (navigation start to the first animation frame after the drawing)",
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=2000, help="edges of the circuit (2000)")
    parser.add_argument("--repeats", type=int, default=5, help="page loads timed (5)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.tiny, args.edges, args.repeats)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_file(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
