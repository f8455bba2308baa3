"""The ra-lens command on a tiny offline model: outputs exist, JSON parses and agrees with the API."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import TOY_PAIRS, live_archs

import ra_lens
from ra_lens import cli
from ra_lens.cli import main
from ra_lens.models import bridge_available
from ra_lens.toy_models import tiny_model

# TransformerLens 4: bridges of two architectures; TransformerLens 2: HookedTransformer
ARCH, OTHER_ARCH = ("gpt2", "llama") if bridge_available() else ("hooked", "hooked")

PROMPT = "I like Italy and France. I visited the city of"


def test_maps_writes_files_and_json_matching_the_api(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        ["maps", "--prompt", PROMPT, "--target", " the", "--model", f"tiny-{ARCH}", "--top", "3",
         "--out", str(out), "--json", str(out / "maps.json")]
    )  # fmt: skip
    assert code == 0
    for name in ("head_norms.png", "top_heads.png", "reversed_attention.html"):
        assert (out / name).stat().st_size > 1000
    report = json.loads((out / "maps.json").read_text())
    model = tiny_model(ARCH)
    target = model.to_tokens(" the", prepend_bos=False)[0, 0].item()
    ra = ra_lens.reversed_attention(model, PROMPT, ra_lens.metrics.target_nll([target]))
    expected = ra.top_heads(3)
    assert [(h["layer"], h["head"]) for h in report["top_heads"]] == [
        (la, h) for la, h, _ in expected
    ]
    assert report["top_heads"][0]["ra_norm"] == pytest.approx(expected[0][2], rel=1e-5)
    torch.testing.assert_close(torch.tensor(report["ra_norms"]), ra.head_norms())
    assert len(report["predictions"]) == 5 and "reversed_attention" in report["seconds"]
    printed = capsys.readouterr().out
    assert "RA norm" in printed and f"{expected[0][2]:.5f}" in printed


def test_maps_json_to_stdout_is_pure_json(capsys):
    assert main(["maps", "--prompt", PROMPT, "--target", " the", "--model", f"tiny-{OTHER_ARCH}",
                 "--json", "-", "--completion"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["metric"] > 0 and len(report["ra_norms"]) == 2


def test_bad_input_gives_a_clear_error(capsys):
    assert main(["maps", "--prompt", PROMPT, "--target", "", "--model", f"tiny-{ARCH}"]) == 2
    assert "--target is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["maps", "--prompt", PROMPT])  # argparse: --target is required
    assert main(["patch", "--task", "nope", "--model", f"tiny-{ARCH}"]) == 2
    assert "available tasks" in capsys.readouterr().err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(word in text for word in ("maps", "patch", "rank", "attribute", "circuit"))


def test_patch_end_to_end_matches_the_api(tmp_path, capsys, monkeypatch):
    from ra_lens.experiments import attention_patching
    from ra_lens.tasks import _task

    # A bundled-task folder holding one task the tiny tokenizer spells in single tokens.
    (tmp_path / "toy.json").write_text(
        json.dumps({"name": "toy", "pairs": [list(p) for p in TOY_PAIRS]})
    )
    monkeypatch.setattr(_task, "_data_dir", lambda: tmp_path)
    out = tmp_path / "out"
    args = ["--task", "toy", "--shots", "1", "--n-prompts", "4", "--scales", "0,-4"]
    code = main(["patch", *args, "--model", f"tiny-{ARCH}", "--out", str(out),
                 "--json", str(out / "patch.json")])  # fmt: skip
    assert code == 0
    report = json.loads((out / "patch.json").read_text())
    expected = attention_patching(
        tiny_model(ARCH), "toy", shots=1, n_prompts=4, scales=[0.0, -4.0], progress=False
    ).to_dict()
    report.pop("seconds"), expected.pop("seconds")
    assert report == expected
    assert report["n_prompts"] == 4 and report["scales"] == [0.0, -4.0]
    assert (out / "patching_toy_1shot.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "toy, 1-shot: RA averaged over 4 training prompts" in printed


def test_a_tiny_model_this_transformer_lens_cannot_build_is_one_line_exit_2(capsys):
    from ra_lens.toy_models import available_architectures

    other = "tiny-hooked" if bridge_available() else "tiny-gpt2"
    here = f"here use one of {available_architectures()}"
    for model, why in [(other, "tiny model"), ("tiny-nope", "unknown tiny architecture 'nope'")]:
        code = main(["maps", "--prompt", PROMPT, "--target", " the", "--model", model])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith(f"ra-lens maps: error: {why}") and err.count("\n") == 1, err
        assert "Traceback" not in err
        assert here in err or model == "tiny-nope"


def test_cli_refuses_text_longer_than_context(capsys):
    model = "tiny-" + live_archs()[0]
    code = cli.main(["maps", "--model", model, "--prompt", " a" * 200, "--target", " b"])
    assert code == 2
    assert "n_ctx=" in capsys.readouterr().err


def test_cli_checks_outputs_before_computing(tmp_path, capsys, monkeypatch):
    computed = []
    monkeypatch.setattr(cli._shared, "_load", lambda name, *a, **k: computed.append(name))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    args = ["maps", "--model", "tiny-gpt2", "--prompt", "a b", "--target", " c"]
    assert cli.main([*args, "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert cli.main([*args, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root writes into a 0500 folder anyway; /sys is read-only for everyone
    unwritable = locked if not os.access(locked, os.W_OK) else Path("/sys")
    try:
        assert cli.main([*args, "--json", str(unwritable / "sub" / "r.json")]) == 2
        assert "cannot write" in capsys.readouterr().err
        assert cli.main([*args, "--out", str(unwritable / "plots")]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)
    assert computed == []  # nothing was loaded or computed


def test_cli_json_is_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    target.write_text('{"old": true}')

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cli.json, "dumps", lambda *a, **k: "{}")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        cli.emit_json(str(target), {"new": True})
    assert target.read_text() == '{"old": true}'  # untouched, and no temporary left behind
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_cli_top_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["maps", "--prompt", "a", "--target", " b", "--top", "-3"])
    assert ">= 1" in capsys.readouterr().err


def test_cli_attribute_refuses_a_negative_top(capsys):
    from ra_lens import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["attribute", "--clean", "a", "--corrupted", "b", "--target", " c",
                  "--top", "-3"])  # fmt: skip
    assert exit_.value.code == 2
    assert "expected a whole number >= 1, got '-3'" in capsys.readouterr().err
