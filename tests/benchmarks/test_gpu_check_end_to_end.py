"""benchmarks/gpu_check.py --smoke end to end (slow: the file name's `_end_to_end`): every section
of the GPU run sheet runs on the CPU with a tiny model, and the JSON it prints holds sane values."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
from helpers import benchmark_modules

from ra_lens.models import bridge_available

SECTIONS = {
    "bf16_vs_fp32",
    "norms_vs_floor",
    "causal_mediation_vs_ra",
    "layerwise_long",
    "nnsight_vs_bridge",
    "split_vs_unsplit",
}


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_smoke_run_prints_every_section_with_sane_values(tmp_path, capsys):
    with benchmark_modules("gpu_check") as modules:
        status = modules.gpu_check.main(["--smoke", "--quiet", "--json", str(tmp_path / "g.json")])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "g.json").read_text())
    assert status == 0
    assert SECTIONS <= set(printed) and set(printed["seconds"]) == SECTIONS
    for name in SECTIONS:
        assert "error" not in printed[name], (name, printed[name])
    assert printed["meta"]["smoke"] and printed["meta"]["device"] == "cpu"

    bf16 = printed["bf16_vs_fp32"]
    # bfloat16 keeps 8 bits of mantissa: a few 1e-3 on a tiny model, never zero (not the same run)
    for key in ("maps_rel_error", "norms_rel_error"):
        assert 0 < bf16[key] < 0.1, key
    assert 0 <= bf16["top_heads_overlap"] <= 1

    floor = printed["norms_vs_floor"]
    assert all(positive(s) for s in floor["seconds"].values())
    assert floor["norms_vs_floor"] == floor["seconds"]["ra_norms"] / floor["seconds"]["floor"]
    assert positive(floor["norms_peak_memory_vs_floor"])

    cm = printed["causal_mediation_vs_ra"]
    assert cm["heads"] == 2 * 4  # the tiny Llama: 2 layers x 4 heads, one forward pass each
    assert cm["causal_mediation_vs_ra"] == cm["causal_mediation_s"] / cm["ra_norms_s"]

    long = printed["layerwise_long"]
    assert long["tokens"] == printed["meta"]["sizes"]["long_len"] and long["peak_bytes"] > 0
    assert long["tokens_per_s"] == pytest.approx(long["tokens"] / long["seconds"])

    nn, split = printed["nnsight_vs_bridge"], printed["split_vs_unsplit"]
    if not bridge_available():  # TransformerLens 2.18: no nnsight (transformers < 5), no bridge
        assert "nnsight" in nn["skipped"] and "TransformerBridge" in split["skipped"]
        return
    assert nn["max_norm_rel_diff"] <= 1e-5  # the two routes compute the same RA
    for keep in ("norms", "maps"):
        assert positive(nn["ratios"][f"nnsight_vs_bridge_time_{keep}"])
        assert positive(nn["ratios"][f"nnsight_vs_bridge_peak_memory_{keep}"])
    assert [g["ratio"] for g in nn["goals"]] == [
        "nnsight_vs_bridge_time_norms",
        "nnsight_vs_bridge_peak_memory_norms",
        "nnsight_vs_bridge_time_maps",
        "nnsight_vs_bridge_peak_memory_maps",
    ]
    assert split["devices"] == ["cpu", "disk"]  # no second device here: disk offload stands in
    for key in ("maps_max_rel_diff", "norms_max_rel_diff", "layerwise_norms_max_rel_diff"):
        assert split[key] <= 1e-5, key


def test_sections_that_cannot_run_say_why(tmp_path):
    with benchmark_modules("gpu_check") as modules:
        gc = modules.gpu_check
        assert isinstance(gc.split_devices("cpu", smoke=False), str)
        with mock.patch.object(gc.torch.cuda, "device_count", return_value=2):
            assert gc.split_devices("cuda", smoke=False) == ("cuda:0", "cuda:1")
        with mock.patch.object(gc.torch.cuda, "device_count", return_value=1):
            assert "mixes a GPU with CPU/disk offload" in gc.split_devices("cuda", smoke=False)
        report = {"seconds": {}}
        with gc.section(report, "broken", lambda s: None):
            raise ValueError("no such thing")
    assert report["broken"] == {"error": "ValueError: no such thing"}
    assert report["seconds"]["broken"] >= 0
