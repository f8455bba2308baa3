"""benchmarks/bench_long_context.py's --quick run end to end on a tiny model (slow: the file name's
`_end_to_end`): the JSON it writes."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO_ROOT


@pytest.mark.tl4  # the benchmark's --quick model is a TransformerBridge Llama
def test_long_context_benchmark_quick_run_writes_its_json(tmp_path):
    pytest.importorskip("transformer_lens.model_bridge")
    import importlib.util
    import json

    folder = REPO_ROOT / "benchmarks"
    sys.path.insert(0, str(folder))  # as `python benchmarks/bench_long_context.py` sees it
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_long_context", folder / "bench_long_context.py"
        )
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(folder))
    out = tmp_path / "long.json"
    bench.main(
        ["--quick", "--compare", "64", "--repeats", "1", "--lengths", "96", "--json", str(out)]
    )
    results = json.loads(out.read_text())
    compare = results["compare_64"]
    assert set(compare["peak_mb"]) == {"floor", "full_norms", "layerwise_norms", "layerwise_rows"}
    assert all(v > 0 for v in compare["peak_mb"].values())
    assert compare["ratios"]["layerwise_norms_time_vs_floor"] > 0
    assert results["layerwise_96_rows"]["peak_mb"] > 0
    assert len(results["layerwise_96_norms"]["top_heads"]) == 3
