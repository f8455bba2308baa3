"""benchmarks/bench_ra.py run end to end on tiny models (slow: the file name's `_end_to_end`): its
report agrees with its own timings, taken against a fake clock or each other, never a threshold."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from helpers import FakeClock, benchmark_modules

pytest.importorskip("transformer_lens.model_bridge")  # the benchmark measures TransformerBridge
pytestmark = pytest.mark.tl4


@pytest.fixture(scope="module")
def bench():
    """benchmarks/{bench_ra,harness,baselines}.py."""
    with benchmark_modules("bench_ra", "harness", "baselines") as modules:
        yield modules


def _model(arch: str):
    from ra_lens.toy_models import tiny_model

    return tiny_model(arch, d_model=32, n_layers=2, n_heads=4, n_ctx=16)


def test_run_group_interleaves_and_takes_medians(bench):
    h = bench.harness
    calls: list[str] = []
    configs = [
        h.Config("a", lambda: calls.append("a"), reps=3),
        h.Config("b", lambda: calls.append("b"), reps=1, memory=False),
    ]
    results = h.run_group(
        configs, clock=h.Clock("fake", FakeClock(2.0)), device="cpu", memory=h.PeakMemory("cpu"),
        log=lambda s: None,
    )  # fmt: skip
    # one memory run of "a" (the warm-up), then round-robin with a rotating order
    assert calls == ["a", "a", "b", "a", "a"]
    assert results["a"]["times_s"] == [2.0, 2.0, 2.0] and results["a"]["median_s"] == 2.0
    assert results["a"]["reps"] == 3 and results["b"]["reps"] == 1
    assert results["a"]["memory_run_s"] == 2.0 and results["a"]["peak_mb"] >= 0
    assert math.isnan(results["b"]["peak_mb"])


def test_causal_mediation_is_timed_on_the_library_scan(bench):
    model = _model("llama")
    clock = bench.harness.Clock("fake", FakeClock(3.0))
    out = bench.bench_ra.measure_causal_mediation(model, 1, 8, clock, "cpu", lambda s: None)
    assert out == {"median_s": 3.0, "reps": 1, "heads": 8}


def test_tiny_run_is_consistent_with_its_timings(bench, tmp_path):
    out = tmp_path / "bench.json"
    res = bench.bench_ra.main(["--tiny", "--quiet", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "tiny" and data["meta"]["time_basis"] == "cpu"
    assert data["meta"]["memory_calibration"]["measured_mb"] == pytest.approx(320.0, abs=1.0)
    assert res["ratios"]["official_loop_vs_ra"] == data["ratios"]["official_loop_vs_ra"]

    def m(model: str, setting: str, name: str, what: str = "median_s") -> float:
        return data["models"][model]["settings"][setting]["measurements"][name][what]

    for model in data["models"].values():
        for setting in model["settings"].values():
            for name, r in setting["measurements"].items():
                assert r["reps"] == len(r["times_s"]) >= 1, name
                assert r["median_s"] == statistics.median(r["times_s"]) > 0, name
                if name in ("floor", "ra_norms"):  # always measured (others skip heavy settings)
                    assert math.isfinite(r["peak_mb"]) and r["peak_mb"] > 0, name
        assert model["causal_mediation"]["heads"] == model["n_layers"] * model["n_heads"]

    d, g, ratios = "tiny-llama", "tiny-gpt2", data["ratios"]
    cm = data["models"][d]["causal_mediation"]
    expected = {
        "maps_vs_floor": m(d, "b1_n32", "ra_maps") / m(d, "b1_n32", "floor"),
        "norms_vs_floor": m(d, "b1_n32", "ra_norms") / m(d, "b1_n32", "floor"),
        "norms_peak_memory_vs_floor": m(d, "b1_n32", "ra_norms", "peak_mb")
        / m(d, "b1_n32", "floor", "peak_mb"),
        "causal_mediation_vs_ra": cm["median_s"] / m(d, "b1_n8", "ra_norms"),
        "official_loop_vs_ra": m(g, "b2_n8", "official_loop") / m(g, "b2_n8", "ra_maps"),
        "attribution_vs_ra_norms": m(d, "b1_n8", "attribution") / m(d, "b1_n8", "ra_norms"),
        "floor_vs_forward": m(d, "b1_n32", "floor") / m(d, "b1_n32", "forward"),
    }
    for key, value in expected.items():
        assert math.isfinite(ratios[key]) and ratios[key] > 0, key
        assert ratios[key] == pytest.approx(value, rel=1e-12), key

    assert len(data["goals"]) == 6
    for goal in data["goals"]:
        op, threshold = goal["target"].split()
        value = ratios[goal["ratio"]]
        assert goal["value"] == value
        ok = value <= float(threshold) if op == "<=" else value >= float(threshold)
        assert goal["status"] == ("PASS" if ok else "MISS"), goal
