"""Smoke test of benchmarks/bench_ra.py on tiny models: plumbing and correctness, never wall-clock."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import ra_lens
from ra_lens.metrics import target_nll, target_prob
from ra_lens.patching import head_ablation_hooks

pytest.importorskip("transformer_lens.model_bridge")  # the benchmark measures TransformerBridge
pytestmark = pytest.mark.tl4

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ra.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ra", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ra"] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_official_style_loop_matches_reversed_attention(bench, arch):
    """The re-implemented official loop (plain HF copy, per head) gives the library's maps."""
    from ra_lens.toy_models import tiny_model

    model = tiny_model(arch, d_model=32, n_layers=2, n_heads=4, n_ctx=16)
    tokens = bench.make_tokens(int(model.cfg.d_vocab), 2, 9, 1, "cpu")
    targets = torch.tensor([5, 7])
    scales = [ra_lens.capture.attention_scale(model, la) for la in range(model.cfg.n_layers)]
    loop = bench.OfficialStyleLoop(bench.plain_hf_copy(model), scales)
    maps, norms = loop(tokens, targets)
    ref = ra_lens.reversed_attention(model, tokens, target_nll(targets), keep="maps")
    torch.testing.assert_close(maps, ref.maps, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(norms, ref.norms, atol=1e-6, rtol=1e-4)


def test_baselines(bench):
    from ra_lens.toy_models import tiny_model

    model = tiny_model("gpt2", d_model=32, n_layers=2, n_heads=4, n_ctx=16)
    tokens = bench.make_tokens(int(model.cfg.d_vocab), 2, 8, 1, "cpu")
    corrupted = bench.make_tokens(int(model.cfg.d_vocab), 2, 8, 3, "cpu")
    targets = torch.tensor([5, 7])
    scores = bench.attribution_patching(model, tokens, corrupted, targets)
    assert scores.shape == (2, 4) and torch.isfinite(scores).all() and scores.abs().sum() > 0
    per_head: list[float] = []
    effects = bench.causal_mediation_scan(model, tokens, targets, per_head_s=per_head)
    assert effects.shape == (2, 4) and len(per_head) == 8
    metric = target_prob(targets)
    with torch.no_grad():
        clean = metric(model(tokens))
        with model.hooks(fwd_hooks=head_ablation_hooks([(1, 2)])):
            ablated = metric(model(tokens))
    assert math.isclose(float(effects[1, 2]), float((ablated - clean).mean()), abs_tol=1e-6)
    grad = bench.floor(model, tokens, targets)
    assert grad.shape == (2, 8, 32)


def test_tiny_run_writes_every_figure(bench, tmp_path):
    out = tmp_path / "bench.json"
    res = bench.main(["--tiny", "--quiet", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "tiny"
    for key in (
        "maps_vs_floor",
        "norms_vs_floor",
        "norms_peak_memory_vs_floor",
        "causal_mediation_vs_ra",
        "official_loop_vs_ra",
    ):
        assert isinstance(data["ratios"][key], float) and data["ratios"][key] > 0, key
    assert {g["status"] for g in data["goals"]} <= {"PASS", "MISS"}
    assert len(data["goals"]) == 6
    for model in data["models"].values():
        for setting in model["settings"].values():
            for name, m in setting["measurements"].items():
                assert m["median_s"] > 0 and m["reps"] >= 1, name
                if name in ("floor", "ra_norms"):  # always measured (others skip heavy settings)
                    assert math.isfinite(m["peak_mb"]) and m["peak_mb"] > 0, name
        assert model["causal_mediation"]["heads_measured"] > 0
    assert res["ratios"]["official_loop_vs_ra"] == data["ratios"]["official_loop_vs_ra"]
    assert data["meta"]["memory_calibration"]["measured_mb"] == pytest.approx(320.0, abs=1.0)


def test_live_tensor_bytes_counts_temporaries_and_frees(bench):
    tracker = bench.LiveTensorBytes()
    x = torch.ones(1000)  # created before: not counted
    with tracker:
        y = x * 2  # 4000 bytes
        z = torch.empty(2000)  # 8000 bytes, peak 12000
        del y, z
        w = x[:10] + 1  # 40 bytes
    assert tracker.peak == 12000
    assert tracker.live == 40
    del w
    assert tracker.live == 0


def test_baselines_agree_with_library_ranking(bench):
    """When ra_lens.ranking is there, the benchmark's own baselines give its scores."""
    ranking = pytest.importorskip("ra_lens.ranking")
    from ra_lens.toy_models import tiny_model

    model = tiny_model("gpt2", d_model=32, n_layers=2, n_heads=4, n_ctx=16)
    tokens = bench.make_tokens(int(model.cfg.d_vocab), 2, 8, 1, "cpu")
    corrupted = bench.make_tokens(int(model.cfg.d_vocab), 2, 8, 3, "cpu")
    targets = torch.tensor([5, 7])
    effects = bench.causal_mediation_scan(model, tokens, targets)
    torch.testing.assert_close(-effects, ranking.causal_mediation(model, tokens, targets))
    # The benchmark differentiates on the clean run, the library on the corrupted one: same cost
    # (one backward pass), different first-order estimates; only shapes and finiteness compare.
    lib = ranking.attribution_patching(model, tokens, corrupted, targets)
    assert lib.shape == bench.attribution_patching(model, tokens, corrupted, targets).shape
