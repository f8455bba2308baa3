"""Which circuit `ra-lens circuit` saves: by default the smallest reaching faithfulness 0.8
(`--faithfulness F` for another target), or with `--edges N` the N edges counted as MIB counts
them (ungrouped), on a grouped-query model where the two counts differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import one_layer_model

from ra_lens import circuits
from ra_lens.cli import main
from ra_lens.tasks.ioi import PromptPair, paired_batch

PAIRS = [
    PromptPair("I like Italy", "I like Paris", " and", " the"),
    PromptPair("I like Paris", "I like Italy", " the", " and"),
    PromptPair("The capital of Italy is", "The capital of Paris is", " the", " and"),
]


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, *extra: str):
    import ra_lens.cli.circuit as cli_circuit

    model = one_layer_model(n_layers=2, n_key_value_heads=2)  # 4 query heads on 2 kv heads
    monkeypatch.setattr(cli_circuit, "load_model_of", lambda args: model)
    pairs = tmp_path / "pairs.jsonl"
    keys = ("clean", "corrupted", "answer", "wrong")
    pairs.write_text("".join(json.dumps({k: getattr(p, k) for k in keys}) + "\n" for p in PAIRS))
    argv = ["circuit", "--pairs", str(pairs), "--method", "exact", "--sizes", "0.05,0.5,1",
            "--out", str(tmp_path / "out"), "--json", str(tmp_path / "run.json"), *extra]  # fmt: skip
    assert main(argv) == 0
    clean, corrupted, metric = paired_batch(model, PAIRS)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    saved = circuits.Circuit.from_json(tmp_path / "out" / "circuit.json", model)
    report = json.loads((tmp_path / "run.json").read_text())
    return model, scores, saved, report, capsys.readouterr().out, (clean, corrupted, metric)


def test_edges_counts_mib_ungrouped_edges(tmp_path, monkeypatch, capsys) -> None:
    model, scores, saved, report, out, _ = _run(tmp_path, monkeypatch, capsys, "--edges", "30")
    expected = scores.top(30, units="ungrouped")
    assert scores.top(30, units="grouped").n_edges_ungrouped > 30  # grouped would overshoot
    assert saved.edge_names == expected.edge_names and saved.n_edges_ungrouped <= 30
    assert report["circuit"]["n_edges_ungrouped"] == saved.n_edges_ungrouped
    assert report["circuit"]["chosen_by"] == "edges" and report["circuit"]["edges_asked"] == 30
    assert "counted as MIB counts (ungrouped)" in out


@pytest.mark.parametrize("extra", [(), ("--faithfulness", "0.995")])
def test_default_is_the_smallest_circuit_reaching_a_faithfulness(
    tmp_path, monkeypatch, capsys, extra
) -> None:
    model, scores, saved, report, out, data = _run(tmp_path, monkeypatch, capsys, *extra)
    target = float(extra[1]) if extra else 0.8
    curve = circuits.faithfulness_curve(model, scores, *data, sizes=[0.05, 0.5, 1])
    found = circuits.smallest_circuit(model, scores, *data, curve, target)
    assert saved.edge_names == found.circuit.edge_names
    kept = circuits.faithfulness(model, saved, *data).value
    assert kept >= target and report["circuit"]["faithfulness"] == pytest.approx(kept, abs=1e-9)
    assert report["circuit"]["chosen_by"] == "faithfulness" and report["circuit"]["reached"]
    assert report["circuit"]["target_faithfulness"] == target
    assert f"smallest circuit reaching faithfulness {target:g}" in out
    assert f"{saved.n_edges_ungrouped} ungrouped edges" in out
