"""benchmarks/bench_nnsight.py on a tiny Llama: the two routes it times compute the same RA on the
same weights, and its memory meter sees the tensors nnsight's trace creates."""

from __future__ import annotations

import pytest
import torch
from helpers import benchmark_modules

pytest.importorskip("nnsight.modeling", reason="nnsight needs transformers >= 5: .venv (TL 4) only")
pytestmark = pytest.mark.tl4  # the bridge side is a TransformerBridge; nnsight needs TL 4's env


@pytest.fixture(scope="module")
def bench():
    with benchmark_modules("bench_nnsight", "harness") as modules:
        yield modules


def test_routes_compute_the_same_ra_on_the_same_weights(bench):
    bridge = bench.bench_nnsight.load_bridge(tiny=True, device="cpu")
    nn_model = bench.bench_nnsight.wrap_in_nnsight(bridge)
    tokens = bench.harness.make_tokens(int(bridge.cfg.d_vocab), 2, 12, 1, "cpu")
    fns = bench.bench_nnsight.routes(bridge, nn_model, tokens, torch.tensor([5, 7]))
    ours, theirs = fns["nnsight_maps"](), fns["bridge_maps"]()
    assert theirs.maps.abs().max() > 1e-4  # not a comparison of zeros
    torch.testing.assert_close(ours.maps, theirs.maps, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fns["nnsight_norms"]().norms, theirs.norms, rtol=1e-5, atol=1e-7)
    # the plain-HF floor differentiates the same loss as the bridge floor: same gradient
    torch.testing.assert_close(fns["hf_floor"](), fns["bridge_floor"](), rtol=1e-5, atol=1e-7)


def test_the_memory_meter_sees_what_the_nnsight_trace_creates(bench):
    """The tensors the trace returns are created inside it (nnsight runs the intervention code in
    greenlets on this thread): the meter's peak holds at least their bytes, and at least the
    plain forward+backward's peak (the trace does that too)."""
    bridge = bench.bench_nnsight.load_bridge(tiny=True, device="cpu")
    nn_model = bench.bench_nnsight.wrap_in_nnsight(bridge)
    tokens = bench.harness.make_tokens(int(bridge.cfg.d_vocab), 1, 96, 1, "cpu")
    fns = bench.bench_nnsight.routes(bridge, nn_model, tokens, torch.tensor([5]))
    meter = bench.harness.PeakMemory("cpu")
    floor, ra = {}, {}
    with meter.measure(floor):
        fns["hf_floor"]()
    with meter.measure(ra):
        result = fns["nnsight_maps"]()
    returned = result.maps.nbytes + result.patterns.nbytes  # 2 layers x 4 heads x 96^2 x 4 B, x2
    assert returned == 2 * 2 * 4 * 96 * 96 * 4
    assert ra["peak_mb"] * 2**20 >= returned
    assert ra["peak_mb"] >= floor["peak_mb"] > 0


def test_ratios_and_goals_are_the_measured_quotients(bench):
    results = {
        "bridge_floor": {"median_s": 1.0, "peak_mb": 10.0},
        "hf_floor": {"median_s": 0.5, "peak_mb": 8.0},
        "bridge_norms": {"median_s": 2.0, "peak_mb": 20.0, "fresh_rss_peak_mb": 40.0},
        "nnsight_norms": {"median_s": 3.0, "peak_mb": 22.0, "fresh_rss_peak_mb": 44.0},
        "bridge_maps": {"median_s": 2.0, "peak_mb": 20.0},
        "nnsight_maps": {"median_s": 2.0, "peak_mb": 30.0},
    }
    out = bench.bench_nnsight.ratios_and_goals(results)
    r = out["ratios"]
    assert r["nnsight_vs_bridge_time_norms"] == 1.5
    assert r["nnsight_vs_bridge_peak_memory_norms"] == 1.1
    assert r["nnsight_vs_bridge_fresh_rss_peak_norms"] == 1.1
    assert "nnsight_vs_bridge_fresh_rss_peak_maps" not in r  # not measured
    assert r["bridge_floor_vs_hf_floor"] == 2.0 and r["nnsight_norms_vs_hf_floor"] == 6.0
    status = {g["ratio"]: g["status"] for g in out["goals"]}
    assert status == {
        "nnsight_vs_bridge_time_norms": "MISS",
        "nnsight_vs_bridge_peak_memory_norms": "PASS",
        "nnsight_vs_bridge_time_maps": "PASS",
        "nnsight_vs_bridge_peak_memory_maps": "MISS",
    }
