"""benchmarks/bench_nnsight.py --tiny end to end (slow: the file name's `_end_to_end`): the ratios
and goals it reports are quotients of its own measurements; a fresh-process RSS figure."""

from __future__ import annotations

import json
import math

import pytest
from helpers import benchmark_modules

pytest.importorskip("nnsight.modeling", reason="nnsight needs transformers >= 5: .venv (TL 4) only")
pytestmark = pytest.mark.tl4  # the bridge side is a TransformerBridge; nnsight needs TL 4's env


def test_tiny_run_reports_its_own_quotients(tmp_path):
    out = tmp_path / "nn.json"
    with benchmark_modules("bench_nnsight") as modules:
        res = modules.bench_nnsight.main(["--tiny", "--no-rss", "--quiet", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["ratios"] == res["ratios"] and data["meta"]["tiny"]
    m = data["measurements"]
    assert set(m) == {
        "bridge_floor", "hf_floor", "bridge_norms", "nnsight_norms", "bridge_maps", "nnsight_maps"
    }  # fmt: skip
    for name, r in m.items():
        assert r["reps"] == len(r["times_s"]) == 1 and r["median_s"] > 0, name
        assert math.isfinite(r["peak_mb"]) and r["peak_mb"] > 0, name
    assert data["max_norm_rel_diff"] <= 1e-5
    for keep in ("norms", "maps"):
        n, b = m[f"nnsight_{keep}"], m[f"bridge_{keep}"]
        r = data["ratios"]
        assert r[f"nnsight_vs_bridge_time_{keep}"] == n["median_s"] / b["median_s"]
        assert r[f"nnsight_vs_bridge_peak_memory_{keep}"] == n["peak_mb"] / b["peak_mb"]
    for goal in data["goals"]:
        ok = goal["value"] <= 1.3
        assert goal["status"] == ("PASS" if ok else "MISS"), goal


def test_a_fresh_process_reports_the_peak_resident_set_of_one_call():
    """One child (each loads the models: ~20 s); `make bench` runs one per RA route."""
    with benchmark_modules("bench_nnsight") as modules:
        out = modules.bench_nnsight.rss_peaks(True, 1, 32, ["nnsight_norms"], lambda s: None)
    assert set(out) == {"nnsight_norms"}
    assert 0 <= out["nnsight_norms"]["fresh_rss_peak_mb"] < 1024  # a tiny model: well under 1 GiB
