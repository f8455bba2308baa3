"""Every output of a command against every other, before any work: two options naming one file
(or a file inside MIB's folder), --mib an existing file and --html a folder are one line naming
the options, exit status 2, and nothing loaded or written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ra_lens import cli
from ra_lens.cli import main

CLASHES = [
    # (options; D, F, M are replaced by folders/files in tmp_path), the line's key words
    (["--out", "D", "--html", "D/circuit.json"], "--html D/circuit.json is the circuit.json that --out D writes"),
    (["--json", "F", "--html", "F"], "--json F and --html F name the same file"),
    (["--mib", "M", "--json", "M/importances.json"], "--json M/importances.json is the importances.json that --mib M writes"),
    (["--mib", "M", "--html", "M/circuits/page.html"], "--html M/circuits/page.html is in the circuits/ folder that --mib M writes"),
    (["--mib", "M", "--out", "M/circuits"], "--out M/circuits is in the circuits/ folder that --mib M writes"),
    (["--out", "D", "--html", "D"], "--html D is the --out folder"),
    (["--json", "PAIRS"], "--json PAIRS and --pairs PAIRS name the same file"),
    (["--mib", "EXISTING"], "--mib EXISTING is a file: give a folder"),
    (["--html", "D"], "--html D is a folder"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "expected"), CLASHES)
def test_circuit_outputs_are_checked_against_each_other_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    options: list[str], expected: str,
) -> None:  # fmt: skip
    loaded: list[str] = []
    monkeypatch.setattr(cli._shared, "_load", lambda name, *a, **k: loaded.append(name))
    pairs = tmp_path / "pairs.jsonl"
    row = {"clean": "I like Italy", "corrupted": "I like Paris", "answer": " and", "wrong": " the"}
    pairs.write_text(json.dumps(row) + "\n")
    (tmp_path / "EXISTING").write_text("keep me")
    if options == ["--html", "D"]:
        (tmp_path / "D").mkdir()
    places = {"PAIRS": pairs.name}

    def path(text: str) -> str:
        return str(tmp_path / places.get(text, text))

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = ["circuit", "--pairs", str(pairs), "--model", "tiny-gpt2"]
    code = main([*argv, *[path(o) if not o.startswith("--") else o for o in options]])
    err = capsys.readouterr().err
    assert code == 2 and loaded == [], err
    line = expected
    for name in ("M/importances.json", "M/circuits/page.html", "M/circuits", "D/circuit.json",
                 "EXISTING", "PAIRS", "D", "F", "M"):  # fmt: skip
        line = line.replace(f" {name} ", f" {path(name)} ").replace(f" {name}:", f" {path(name)}:")
    assert err.startswith(f"ra-lens circuit: error: {line}"), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "EXISTING").read_text() == "keep me"


def test_out_and_mib_may_share_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their names differ (circuit.json, the pictures; importances.json, circuits/): no clash, so
    the run goes on to load the model."""
    loaded: list[str] = []

    def load(name: str, *args: object, **kwargs: object) -> None:
        loaded.append(name)
        raise RuntimeError("stop here")

    monkeypatch.setattr(cli._shared, "_load", load)
    pairs = tmp_path / "pairs.jsonl"
    row = {"clean": "I like Italy", "corrupted": "I like Paris", "answer": " and", "wrong": " the"}
    pairs.write_text(json.dumps(row) + "\n")
    argv = ["circuit", "--pairs", str(pairs), "--out", str(tmp_path), "--mib", str(tmp_path)]
    main([*argv, "--model", "tiny-gpt2"])
    assert loaded == ["tiny-gpt2"]
