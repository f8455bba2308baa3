"""files.py, the one writer: through symlinks with the mode kept, into FIFOs and /dev/stdout directly,
atomically (a failed write leaves the old file and no temporary); every save, --json and circuit
file goes through it."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

import ra_lens
from ra_lens.cli import main
from ra_lens.files import write_file
from ra_lens.models import bridge_available
from ra_lens.result import ReversedAttention

ARCH = "gpt2" if bridge_available() else "hooked"


MAPS = ["maps", "--prompt", "I like Italy", "--target", " the", "--model", f"tiny-{ARCH}"]


def test_json_through_a_symlink_keeps_the_link_and_the_mode(tmp_path: Path) -> None:
    real_dir, link_dir = tmp_path / "real", tmp_path / "links"
    real_dir.mkdir(), link_dir.mkdir()
    real = real_dir / "report.json"
    real.write_text("old")
    real.chmod(0o600)
    link = link_dir / "report.json"
    link.symlink_to(real)
    assert main([*MAPS, "--json", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["model"] == f"tiny-{ARCH}"
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    # no temporary file left in either folder
    assert [p.name for p in real_dir.iterdir()] == ["report.json"]
    assert [p.name for p in link_dir.iterdir()] == ["report.json"]


def test_json_keeps_the_mode_of_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    path.chmod(0o640)
    assert main([*MAPS, "--json", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert json.loads(path.read_text())["top_heads"]


def read_fifo(fifo: Path, into: list[bytes]) -> threading.Thread:
    """A reader that collects everything written into `fifo` (a writer blocks without one)."""

    def read() -> None:
        with open(fifo, "rb") as f:
            into.append(f.read())

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_json_into_a_fifo_is_written_directly(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = read_fifo(fifo, got)
    assert main([*MAPS, "--json", str(fifo)]) == 0
    reader.join()
    assert json.loads(got[0])["model"] == f"tiny-{ARCH}"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # still a FIFO, not replaced by a file


def test_json_to_dev_stdout_follows_the_tables(capfd: pytest.CaptureFixture[str]) -> None:
    # Under capfd, /dev/stdout is the capture file: a regular file that must be appended to,
    # never renamed over (and /dev/stdout itself must stay the link it is).
    assert main([*MAPS, "--json", "/dev/stdout"]) == 0
    out = capfd.readouterr().out
    table, report = out.split("\n{\n", 1)
    assert "RA norm" in table
    assert json.loads("{\n" + report)["model"] == f"tiny-{ARCH}"
    assert os.path.islink("/dev/stdout")


def test_save_uses_the_same_writer(tmp_path: Path) -> None:
    model = ra_lens.toy_models.tiny_model(ARCH)
    ra = ra_lens.reversed_attention(model, "I like Italy", ra_lens.metrics.target_nll([3]))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = read_fifo(fifo, got)
    ra.save(fifo)
    reader.join()
    torch.testing.assert_close(load_safetensors(got[0])["maps"], ra.maps)
    # and a file keeps its mode, as --json does
    path = tmp_path / "ra.safetensors"
    path.write_bytes(b"old")
    path.chmod(0o604)
    ra.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o604
    torch.testing.assert_close(ReversedAttention.load(path).maps, ra.maps)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_file(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_circuit_to_json_uses_the_same_writer(tmp_path: Path) -> None:
    """Through a symlink (the link stays, the mode is kept), into a FIFO, never over a folder."""
    from ra_lens.circuits import Circuit, Graph

    graph = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    circuit = Circuit.from_edges(graph, ["input->a0.h1<q>", "a0.h1->logits"])
    real = tmp_path / "real" / "circuit.json"
    real.parent.mkdir()
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    circuit.to_json(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert Circuit.from_json(real, graph) == circuit
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["circuit.json", "link.json", "real"]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = read_fifo(fifo, got)
    circuit.to_json(fifo)
    reader.join()
    edges = json.loads(got[0])["edges"]
    assert [name for name, edge in edges.items() if edge["in_graph"]] == circuit.edge_names
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(ValueError) as error:
        circuit.to_json(real.parent)
    assert str(error.value) == (
        f"{real.parent} exists and is not a regular file: give the path of a file"
    )
