"""Progress where no terminal shows a bar: `ra-lens circuit` piped (stderr not a TTY, as under
pytest's capture, `!ra-lens` in a notebook or nohup) writes plain lines per stage to stderr, none
with a carriage return, and stdout stays the report."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from helpers import arch_or_hooked

from ra_lens import progress
from ra_lens.cli import main


def test_piped_circuit_logs_plain_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        ("I like Italy", "I like Paris", " and", " the"),
        ("I like Paris", "I like Italy", " the", " and"),
    ]
    keys = ("clean", "corrupted", "answer", "wrong")
    pairs.write_text("".join(json.dumps(dict(zip(keys, r))) + "\n" for r in rows))
    argv = ["circuit", "--pairs", str(pairs), "--model", f"tiny-{arch_or_hooked('gpt2')}",
            "--method", "eap", "--sizes", "0.1,0.5,1", "--edges", "5", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout is the report alone
    lines = err.split("\n")  # (the tiny model's build, not ra-lens, may draw a bar with \r)
    ours = [line for line in lines if line.startswith(("attribute eap", "faithfulness"))]
    assert ours and not any("\r" in line for line in ours), err
    for stage in ("attribute eap", "faithfulness curve"):
        mine = [line for line in lines if line.startswith(f"{stage}: ")]
        assert mine and "(100%)" in mine[-1] and "elapsed" in mine[-1], err
    assert any(line.startswith("faithfulness curve: 0/3 (0%)") for line in lines), err


def test_lines_every_tenth_and_on_a_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    with progress.tqdm(total=100, desc="step", file=log) as bar:
        for _ in range(100):
            bar.update(1)
    shares = [line.split("(")[1].split(")")[0] for line in log.getvalue().splitlines()]
    assert shares == [f"{p}%" for p in range(0, 101, 10)]
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a slow step: a line at every update
    log = io.StringIO()
    with progress.tqdm(total=100, desc="slow", file=log) as bar:
        bar.update(1)
        bar.update(1)
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == [
        "slow: 0/100 (0%)", "slow: 1/100 (1%)", "slow: 2/100 (2%)"
    ]  # fmt: skip
    log = io.StringIO()  # an inner loop's passing bar (leave=False) writes nothing
    for _ in progress.tqdm(range(5), desc="inner", file=log, leave=False):
        pass
    assert log.getvalue() == ""
