"""`circuits.files`: what `export_mib` leaves in a folder it writes into again."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ra_lens.circuits import EdgeScores, Graph, export_mib
from ra_lens.circuits.files import MIB_SUBMISSION_FRACTIONS

GRAPH = Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)


def _scores(seed: int) -> EdgeScores:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*GRAPH.real.shape, generator=generator, dtype=torch.float64)
    return EdgeScores(GRAPH, values * GRAPH.real, "eap", "denoise")


def test_scores_only_export_removes_an_earlier_exports_circuits(tmp_path: Path) -> None:
    """circuits=False into the folder of an earlier export: the earlier nine circuits (of other
    scores) are gone, a file of the user's own in circuits/ stays, and so does the folder."""
    folder = tmp_path / "ioi_toy"
    export_mib(_scores(0), folder, circuits=True)
    names = [f"circuit_{k:g}.json" for k in MIB_SUBMISSION_FRACTIONS]
    assert sorted(p.name for p in (folder / "circuits").iterdir()) == sorted(names)
    paths = export_mib(_scores(1), folder, circuits=False)
    assert paths == [folder / "importances.json"]
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["importances.json"]  # fmt: skip
    edges = json.loads(paths[0].read_text())["edges"]
    assert edges["input->logits"]["score"] == float(_scores(1).scores[GRAPH.edge_index("input->logits")])  # fmt: skip
    # only ra-lens's own names are removed
    export_mib(_scores(0), folder, circuits=True)
    (folder / "circuits" / "notes.txt").write_text("mine")
    export_mib(_scores(1), folder, circuits=False)
    assert [p.name for p in (folder / "circuits").iterdir()] == ["notes.txt"]


def test_default_export_is_the_scores_file_alone(tmp_path: Path) -> None:
    """MIB takes one file of scores or nine circuits: the default writes the scores only."""
    assert export_mib(_scores(0), tmp_path / "a") == [tmp_path / "a" / "importances.json"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["importances.json"]
    paths = export_mib(_scores(0), tmp_path / "b", circuits=True, progress=True)
    assert len(paths) == 1 + len(MIB_SUBMISSION_FRACTIONS)
