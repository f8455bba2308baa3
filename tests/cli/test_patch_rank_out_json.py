"""`ra-lens patch` / `ra-lens rank`: --json naming a file that --out writes (or the --out folder)
is refused before the model loads, as for the other commands."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ra_lens.cli import main
from ra_lens.experiments.head_ranking import PLOT_FILES

CASES = [
    (["patch", "--task", "antonym", "--shots", "2"], "patching_antonym_2shot.png"),
    *((["rank", "--task", "antonym"], name) for name in PLOT_FILES),
    (["rank", "--task", "antonym", "--task", "capitalize"], "capitalize/ranking_maps.png"),
]


@pytest.mark.parametrize(("argv", "clash"), CASES)
def test_json_naming_a_file_out_writes_is_refused(tmp_path: Path, capsys, monkeypatch, argv, clash):
    from ra_lens import cli

    loaded: list[str] = []
    monkeypatch.setattr(cli._shared, "_load", lambda name, *a, **k: loaded.append(name))
    out = tmp_path / "out"
    base = [*argv, "--model", "tiny-gpt2", "--out", str(out)]
    assert main([*base, "--json", str(out / clash)]) == 2
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert last == (
        f"ra-lens {argv[0]}: error: --json {out / clash} is the {clash} that --out {out} "
        f"writes: give the report another name, such as {out}/report.json"
    )
    assert main([*base, "--json", str(out)]) == 2
    assert f"--json {out} is the --out folder" in capsys.readouterr().err
    assert loaded == [] and not out.exists()  # refused before the model and before any file


def test_the_names_checked_are_the_names_written(tmp_path: Path):
    """`HeadRankingResult.plots` writes exactly PLOT_FILES (the names rank's check uses)."""
    import torch

    from ra_lens.experiments.head_ranking import HeadRankingResult

    result = HeadRankingResult.__new__(HeadRankingResult)
    result.task, result.shots, result.fractions = "antonym", 2, [0.0, 1.0]
    curve = SimpleNamespace(curve=lambda k: [0.2, 0.9])  # what plots reads of a curve
    result.curves, result.reverse_curves = {"ra": curve}, {"ra": curve}
    result.scores = {"ra": torch.rand(2, 4)}
    written = result.plots(tmp_path)
    assert [p.name for p in written] == list(PLOT_FILES)
    assert all(p.is_file() for p in written)
