"""The claims that matter, on the embedded SmolLM2-135M-Instruct (marked real_model; run in CI).

Everything here runs under both TransformerLens worlds: the ``smollm2`` fixture is a
TransformerBridge under TL 4 and a HookedTransformer under TL 2.18. TL 4.3 no longer ships
HookedTransformer and TL 2.18 has no TransformerBridge, so the two backends are compared across
the two environments: the other one runs ``backend_outputs`` below in a subprocess on the same
cached weights and saves its maps, and the test compares them with this environment's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO_ROOT

import ra_lens
from ra_lens import cli, models
from ra_lens.experiments import attention_patching, head_ranking
from ra_lens.metrics import target_nll

pytestmark = pytest.mark.real_model

FIGURE_1 = "I like Italy and France. I visited the city of"
# A right-padded batch of three prompts of different lengths, and each one's target.
BATCH = ["The capital of France is", FIGURE_1, "Q: hot\nA: cold\n\nQ: big\nA: small\n\nQ: up\nA:"]
BATCH_TARGETS = [" Paris", " Florence", " down"]
# The last prompt is longer than the positions a HookedTransformer is built for (256): TL 2.18
# extends its causal mask and rotary tables on demand, which this checks too.
LOGIT_PROMPTS = [
    *BATCH,
    "When Mary and John went to the store, John gave a drink to",
    "The quick brown fox jumps over the lazy dog. " * 30,
]
TABLE_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$")


def florence_ra(model):
    target = model.to_tokens(" Florence", prepend_bos=False)[0, 0]
    return ra_lens.reversed_attention(model, FIGURE_1, target_nll([target]))


def first_token(model: Any, text: str) -> int:
    return int(model.to_tokens(text, prepend_bos=False)[0, 0])


def backend_outputs(model: Any, json_path: Path) -> dict[str, Any]:
    """What one backend computes: Figure-1 and padded-batch RA, and `ra-lens maps` output.

    The CLI runs on this very model (its loading is tested in test_models.py), with --json.
    """
    figure = florence_ra(model)
    targets = [first_token(model, t) for t in BATCH_TARGETS]
    batch = ra_lens.reversed_attention(model, BATCH, target_nll(targets))
    real_load = cli._shared._load
    cli._shared._load = lambda name, backend="auto": model
    try:
        argv = ["maps", "--prompt", FIGURE_1, "--target", " Florence", "--top", "5"]
        code = cli.main([*argv, "--json", str(json_path)])
    finally:
        cli._shared._load = real_load
    assert code == 0
    return {
        "backend": type(model).__name__,
        "figure_maps": figure.maps,
        "figure_top5": figure.top_heads(5),
        "batch_maps": batch.maps,
        "batch_lengths": batch.lengths,
        "batch_top5": batch.top_heads(5),
        "cli": json.loads(json_path.read_text()),
    }


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_figure_1_top_head_is_stable_and_points_at_italy(smollm2):
    first, second = florence_ra(smollm2), florence_ra(smollm2)
    assert first.top_heads(5) == second.top_heads(5)
    assert torch.equal(first.maps, second.maps)
    layer, head, norm = first.top_heads(1)[0]
    # The top head's loss row: gradient descent (-RA) raises attention to " Italy", lowers " France".
    row = first.head(layer, head)[-1]
    tokens = first.str_tokens[0]
    assert row[tokens.index(" Italy")] < 0 < row[tokens.index(" France")]
    assert norm > 5 * first.head_norms().median()
    # The RA map is far sparser than the forward map of the same head.
    forward = first.patterns[0, layer, head]
    assert (row.abs() > 0.1 * row.abs().max()).sum() < (
        forward[-1] > 0.1 * forward[-1].max()
    ).sum() + 3


def test_logits_match_plain_huggingface(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        models.smollm2_hf_dir(), attn_implementation="eager", dtype=torch.float32
    ).eval()
    worst = 0.0
    for prompt in LOGIT_PROMPTS:
        tokens = smollm2.to_tokens(prompt)
        assert tokens[0, 0].item() == 1 and (tokens[0, 1:] != 1).all()  # exactly one BOS
        with torch.no_grad():
            worst = max(worst, float((smollm2(tokens) - hf(tokens).logits).abs().max()))
    assert tokens.shape[1] > 256
    assert worst <= 1e-3


def test_hooked_ra_does_not_depend_on_weight_processing(smollm2):
    if type(smollm2).__name__ != "HookedTransformer":
        pytest.skip("HookedTransformer only: the bridge keeps HuggingFace's weights unprocessed")
    folder = models.smollm2_hf_dir()
    hf, tokenizer = models.load_hf(folder, torch.float32)
    raw = models._hooked_from_hf(hf, tokenizer, folder, "cpu", torch.float32, fold_ln=False)
    assert smollm2.cfg.normalization_type == "RMSPre" and raw.cfg.normalization_type == "RMS"
    folded, unfolded = florence_ra(smollm2), florence_ra(raw.eval())
    assert relative_difference(folded.patterns, unfolded.patterns) <= 1e-5
    assert relative_difference(folded.maps, unfolded.maps) <= 1e-4
    assert [h[:2] for h in folded.top_heads(5)] == [h[:2] for h in unfolded.top_heads(5)]


# Run in the other environment: the same outputs from its backend, saved for this one.
OTHER_ENV_SCRIPT = """
import sys, torch
from pathlib import Path
sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]) / "models")]  # helpers, and this file
import ra_lens
from test_smollm2 import backend_outputs
model = ra_lens.load_model(device="cpu")
torch.save(backend_outputs(model, Path(sys.argv[2]) / "maps.json"), Path(sys.argv[2]) / "out.pt")
"""


def test_bridge_and_hooked_backends_agree(smollm2, other_env_python, tmp_path, capsys):
    here = backend_outputs(smollm2, tmp_path / "here.json")
    table_here = [TABLE_ROW.match(line) for line in capsys.readouterr().out.splitlines()]
    repo = REPO_ROOT
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [other_env_python, "-c", OTHER_ENV_SCRIPT, str(repo / "tests"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    there = torch.load(tmp_path / "out.pt")
    table_there = [TABLE_ROW.match(line) for line in done.stdout.splitlines()]
    assert {here["backend"], there["backend"]} == {"TransformerBridge", "HookedTransformer"}

    for key in ("figure", "batch"):
        rel = relative_difference(here[f"{key}_maps"], there[f"{key}_maps"])
        print(f"{key}: RA relative difference {rel:.2e}", file=sys.stderr)
        assert rel <= 1e-4
        assert [h[:2] for h in here[f"{key}_top5"]] == [h[:2] for h in there[f"{key}_top5"]]
    assert torch.equal(here["batch_lengths"], there["batch_lengths"])
    assert len(set(here["batch_lengths"].tolist())) == 3  # three lengths: the batch is padded

    # `ra-lens maps` prints the same table and JSON under both.
    rows_here = [m.groups()[:3] for m in table_here if m]
    rows_there = [m.groups()[:3] for m in table_there if m]
    assert rows_here == rows_there and len(rows_here) == 5
    cli_here, cli_there = here["cli"], there["cli"]
    assert [p["token"] for p in cli_here["predictions"]] == [
        p["token"] for p in cli_there["predictions"]
    ]
    for a, b in zip(cli_here["top_heads"], cli_there["top_heads"]):
        assert (a["layer"], a["head"]) == (b["layer"], b["head"])
        assert a["ra_norm"] == pytest.approx(b["ra_norm"], rel=1e-4)
        assert a["forward_norm"] == pytest.approx(b["forward_norm"], rel=1e-4)


def test_attention_patching_lifts_zero_shot_antonyms(smollm2):
    result = attention_patching(
        smollm2,
        "antonym",
        shots=0,
        n_prompts=12,
        scales=[0.0, -10.0, 2.0],
        n_test=20,
        progress=False,
    )
    unpatched, patched, positive = result.ra
    assert unpatched.top3 == result.unpatched.top3
    assert patched.top3 >= unpatched.top3 + 0.4
    assert positive.top3 <= unpatched.top3 + 0.05
    assert result.forward[1].top3 <= unpatched.top3 + 0.1


def test_head_ranking_and_ablation_on_the_real_model(smollm2):
    result = head_ranking(
        smollm2,
        "antonym",
        shots=5,
        n_prompts=4,
        n_test=8,
        fractions=[0.0, 1.0],
        rankings=["ra", "forward", "attribution_patching"],
        progress=False,
    )
    assert set(result.scores) == {"ra", "forward", "attribution_patching"}
    ra = result.scores["ra"]
    assert ra.shape == (30, 9) and bool((ra >= 0).all()) and float(ra.max()) > 0
    for curve in result.curves.values():
        kept_none, kept_all = curve.accuracies
        assert torch.equal(kept_all.ranks, result.unablated.ranks)  # every head kept: the model
        assert curve.n_kept == [0, 270]
    assert result.unablated.top3 >= 0.5  # five-shot SmolLM2 knows antonyms
    assert result.curves["ra"].accuracies[0].top3 < result.unablated.top3  # no heads: it does not
