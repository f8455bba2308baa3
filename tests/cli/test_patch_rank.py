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
