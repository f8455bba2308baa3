"""The benchmark on tiny models: its baselines give the library's numbers, its timed callables
compute what they are named for, and its report is consistent with its own timings. Never
wall-clock: timings are checked against a fake clock or against each other, never a threshold."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import FakeClock, benchmark_modules

import ra_lens
from ra_lens import ranking, timing
from ra_lens.metrics import target_nll

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


def _official(bench, model):
    scales = [ra_lens.capture.attention_scale(model, la) for la in range(model.cfg.n_layers)]
    return bench.baselines.OfficialStyleLoop(bench.baselines.plain_hf_copy(model), scales)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_official_style_loop_matches_reversed_attention(bench, arch):
    """The official-style loop (plain HF copy, per prompt, per head) gives the library's maps."""
    model = _model(arch)
    tokens = bench.harness.make_tokens(int(model.cfg.d_vocab), 2, 9, 1, "cpu")
    targets = torch.tensor([5, 7])
    maps, norms = _official(bench, model)(tokens, targets)
    ref = ra_lens.reversed_attention(model, tokens, target_nll(targets), keep="maps")
    assert ref.maps.abs().max() > 1e-3  # the comparison below is not between zeros
    torch.testing.assert_close(maps, ref.maps, atol=1e-6, rtol=0)
    torch.testing.assert_close(norms, ref.norms, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_floors_agree(bench, arch):
    """The bridge floor (gradient at blocks.0.hook_resid_pre) equals plain HF's gradient at the
    input embeddings (the same tensor for GPT-2 and Llama), batched and prompt by prompt."""
    model = _model(arch)
    tokens = bench.harness.make_tokens(int(model.cfg.d_vocab), 3, 8, 1, "cpu")
    targets = torch.tensor([5, 7, 9])
    official = _official(bench, model)
    grad = bench.baselines.floor(model, tokens, targets)
    assert grad.shape == (3, 8, 32) and grad.abs().max() > 1e-4
    torch.testing.assert_close(official.floor(tokens, targets, per_prompt=False), grad)
    torch.testing.assert_close(official.floor(tokens, targets, per_prompt=True), grad)


def test_timed_callables_compute_what_they_are_named_for(bench):
    """Every configuration of a setting returns the library's own result for its name (so the
    benchmark times ra_lens.ranking's attribution patching, not a copy)."""
    model = _model("gpt2")
    mp = bench.bench_ra.ModelPlan(
        key="tiny",
        label="tiny",
        settings=[(2, 8)],
        attribution_at=(2, 8),
        official_at=(2, 8),
        official_breakdown=True,
    )
    configs = bench.bench_ra.setting_configs(model, mp, 2, 8, 1, official=_official(bench, model))
    got = {c.name: c.fn() for c in configs}
    assert set(got) == {
        "forward",
        "floor",
        "ra_norms",
        "ra_maps",
        "attribution",
        "official_loop",
        "hf_floor_per_prompt",
        "hf_floor",
    }
    vocab = int(model.cfg.d_vocab)
    tokens = bench.harness.make_tokens(vocab, 2, 8, 1, "cpu")
    targets = bench.harness.make_tokens(vocab, 1, 2, 2, "cpu")[0]
    corrupted = bench.harness.make_tokens(vocab, 2, 8, 3, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(got["forward"], model(tokens))
    ref = ra_lens.reversed_attention(model, tokens, target_nll(targets), keep="maps")
    torch.testing.assert_close(got["ra_maps"].maps, ref.maps)
    torch.testing.assert_close(got["ra_norms"].norms, ref.norms)
    torch.testing.assert_close(got["official_loop"][0], ref.maps, atol=1e-6, rtol=0)
    torch.testing.assert_close(got["hf_floor"], got["floor"])
    torch.testing.assert_close(
        got["attribution"], ranking.attribution_patching(model, tokens, corrupted, targets)
    )


def test_clock_is_passed_in(bench):
    h = bench.harness
    clock = h.Clock("fake", FakeClock(0.5))
    seconds: dict[str, float] = {}
    with timing.timed(seconds, "run", clock=clock.read):  # the one timer the harness uses
        pass
    assert seconds == {"run": 0.5}
    assert h.choose_clock("cpu", 1) is h.CPU_CLOCK
    assert h.choose_clock("cpu", 2) is h.WALL_CLOCK
    assert h.choose_clock("cpu", 1, wall=True) is h.WALL_CLOCK
    assert h.choose_clock("cuda", 1) is h.WALL_CLOCK


def test_live_tensor_bytes_counts_temporaries_and_frees(bench):
    tracker = bench.harness.LiveTensorBytes()
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


def test_circuits_benchmark_times_every_method_and_the_evaluator_agrees(bench):
    bench_circuits = importlib.import_module("bench_circuits")
    threads = torch.get_num_threads()
    result = bench_circuits.run(tiny=True, n_pairs=4, threads=threads, log=lambda line: None)
    assert torch.get_num_threads() == threads
    assert set(result["seconds"]) == {*bench_circuits.METHODS, "discover", "faithfulness_per_call", "faithfulness_evaluator"}  # fmt: skip
    assert all(s > 0 for s in result["seconds"].values())
    assert result["evaluator_max_difference"] < 1e-6
    assert result["ratios"]["exact/eap"] == pytest.approx(result["seconds"]["exact"] / result["seconds"]["eap"])  # fmt: skip
    assert result["ratios"]["discover/eap-ig-5"] == pytest.approx(result["seconds"]["discover"] / result["seconds"]["eap-ig-5"])  # fmt: skip
    assert len(result["curve"]["faithfulness"]) == len(bench_circuits.FRACTIONS)
