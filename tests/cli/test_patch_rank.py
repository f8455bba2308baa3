"""`ra-lens rank` (cli/patch_rank.py): several tasks and rankings in one run; bad names exit 2."""

from __future__ import annotations

import pytest


def test_rank_command_takes_several_tasks_and_rankings(capsys):
    from ra_lens.cli import build_parser, main

    args = build_parser().parse_args(
        ["rank", "--task", "antonym", "--task", "capitalize", "--ablation", "mean",
         "--rankings", "ra,cm_first_order,ra_temperature"]
    )  # fmt: skip
    assert args.task == ["antonym", "capitalize"] and args.ablation == "mean"
    assert (
        main(["rank", "--task", "antonym", "--rankings", "ra,nope", "--model", "tiny-llama"]) == 2
    )
    err = capsys.readouterr().err
    assert "unknown ranking 'nope'" in err and "indirect_effect" in err
    with pytest.raises(SystemExit):
        main(["rank", "--task", "antonym", "--ablation", "resample"])


def test_rank_table_has_a_legend_and_help_says_the_time(capsys, tmp_path, monkeypatch):
    import json

    from helpers import TOY_PAIRS, arch_or_hooked

    from ra_lens.cli import main
    from ra_lens.tasks import _task

    # a bundled-task folder holding one task the tiny tokenizer spells in single tokens
    (tmp_path / "toy.json").write_text(json.dumps({"name": "toy", "pairs": TOY_PAIRS}))
    monkeypatch.setattr(_task, "_data_dir", lambda: tmp_path)
    argv = ["rank", "--task", "toy", "--rankings", "ra", "--n-prompts", "4", "--n-test", "4",
            "--fractions", "0,1", "--model", f"tiny-{arch_or_hooked('llama')}"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    table, legend = out.split("columns:", 1)
    assert "rev@1" in table and "RA - it [95% CI]" in table
    for column in ("AUC@1 / AUC@3 =", "rev@1 =", "RA - it [95 % CI] =", "rho(RA) [95 % CI] =",
                   "top10 ="):  # fmt: skip
        assert column in legend, column
    with pytest.raises(SystemExit):
        main(["rank", "--help"])
    help_text = capsys.readouterr().out
    assert "rev@1 = the same top-1 area keeping the heads it puts LAST" in help_text
    assert "time: SmolLM2-135M on a CPU" in help_text


@pytest.mark.parametrize("command", ["patch", "rank"])
def test_json_to_stdout_stays_pure_json(capsys, tmp_path, monkeypatch, command):
    """--json -: the tables, the legend and the chosen scale go to stderr, stdout is the JSON."""
    import json

    from helpers import TOY_PAIRS, arch_or_hooked

    from ra_lens.cli import main
    from ra_lens.tasks import _task

    (tmp_path / "toy.json").write_text(json.dumps({"name": "toy", "pairs": TOY_PAIRS}))
    monkeypatch.setattr(_task, "_data_dir", lambda: tmp_path)
    extra = (["--rankings", "ra", "--fractions", "0,1", "--n-test", "4"] if command == "rank"
             else ["--scales", "0,-4"])  # fmt: skip
    argv = [command, "--task", "toy", "--shots", "1", "--n-prompts", "4", *extra, "--json", "-"]
    assert main([*argv, "--model", f"tiny-{arch_or_hooked('llama')}"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["task"] == "toy" and "toy, 1-shot" in err
    if command == "patch":
        assert "chosen_ra_top3" in report and "chosen on" in err
    else:
        assert "columns:" in err
