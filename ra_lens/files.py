"""Writing a file so that no reader ever sees half of it: the one writer every ra-lens output uses
(`ReversedAttention.save`, the experiments' `save`, `ra-lens --json`, circuit files, the model
cache); `check_writable`, to refuse an output path before the work; `load_json`, the one JSON
reader of the command lines, whose errors name the file.

    >>> import os, shutil, stat, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> real, link = os.path.join(folder, "real.json"), os.path.join(folder, "link.json")
    >>> _ = write_file(real, "old")
    >>> os.chmod(real, 0o600)
    >>> os.symlink(real, link)
    >>> write_file(link, '{"a": 1}') == Path(real).resolve()   # through the link, onto its target
    True
    >>> os.path.islink(link), open(real).read(), oct(stat.S_IMODE(os.stat(real).st_mode))
    (True, '{"a": 1}', '0o600')
    >>> shutil.rmtree(folder)
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from ra_lens._typing import StrPath

__all__ = ["check_writable", "check_writable_folder", "is_stream", "load_json", "write_file"]


def is_stream(path: StrPath) -> bool:
    """Whether `path` is written in place rather than replaced: a FIFO, a terminal or other
    character device, a socket, or anything under /dev or /proc (``/dev/stdout`` may stand for a
    pipe or for the file the shell redirected it to: either way it must not be renamed over).

    >>> is_stream("/dev/null"), is_stream("out.json")
    (True, False)
    """
    absolute = os.path.abspath(path)
    if absolute.startswith(("/dev/", "/proc/")):
        return True
    try:
        mode = os.stat(absolute).st_mode
    except OSError:  # missing (a new file) or unreadable: the atomic path reports the problem
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def write_file(path: StrPath, data: str | bytes, *, make_folders: bool = False) -> Path:
    """Write `data` (text is UTF-8) to `path`; returns the file actually written.

    - A symlink is followed: the file it points to gets the data, the link stays a link.
    - An existing file keeps its permission bits; a new one gets ``0o666 & ~umask``.
    - A stream (see `is_stream`: a FIFO, ``/dev/stdout``) is written directly, appending.
    - Anything else is written to a temporary file in the target's real folder, then renamed
      onto it: a crash or a full disk leaves the old file whole and no temporary file behind.

    Args:
        make_folders: create the target's missing folders (else a missing folder is an error).

    Raises:
        ValueError: `path` is a folder or another thing that is not a regular file.
        FileNotFoundError: the folder does not exist and `make_folders` is False.
        OSError: the write itself failed (read-only folder, disk full); the target is unchanged.
    """
    payload = data.encode() if isinstance(data, str) else data
    if is_stream(path):
        with open(path, "ab") as stream:
            stream.write(payload)
        return Path(path)
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        raise ValueError(f"{path} exists and is not a regular file: give the path of a file")
    if make_folders:
        target.parent.mkdir(parents=True, exist_ok=True)
    elif not target.parent.is_dir():
        raise FileNotFoundError(f"folder {target.parent} does not exist: create it first")
    mode = _mode_for(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def check_writable(path: StrPath, flag: str) -> None:
    """Refuse, before any work, a `path` that `write_file(path, ..., make_folders=True)` could
    not write: a folder or another thing that is not a regular file, or a place whose nearest
    existing folder is not writable. A stream (`is_stream`) is always accepted. `flag` names the
    option in the message (e.g. "--json").

    Raises:
        ValueError: the path cannot be written; the message names `flag` and the fix.
    """
    if is_stream(path):
        return
    target = Path(os.path.realpath(path))  # a symlink is written through: check its target
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give the name of a file (in it or elsewhere)")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {path} exists and is not a regular file: give a file name")
    check_writable_folder(target.parent, flag)


def check_writable_folder(folder: StrPath, flag: str) -> None:
    """Refuse a `folder` that cannot be created and written into (its nearest existing ancestor
    decides); `flag` names the option in the message (e.g. "--out").

    Raises:
        ValueError: the folder cannot be written; the message names `flag`.
    """
    existing = Path(folder)
    while not existing.exists():
        existing = existing.parent
    try:  # a real write: os.access says yes to root even on read-only file systems
        if not existing.is_dir():
            raise NotADirectoryError(existing)
        tempfile.TemporaryFile(dir=existing).close()
    except OSError:
        raise ValueError(
            f"{flag}: cannot write into {existing}: choose a writable folder"
        ) from None


def load_json(path: StrPath, what: str) -> Any:
    """The JSON value in the file at `path`, read as UTF-8. Every failure names the file and,
    where the file is not what was expected, `what` it should be (e.g. "a saved study
    (circuit_study --json)").

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: a folder, an unreadable file, text that is not UTF-8, or not JSON.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not {what}") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}), so not {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): pass {what}") from None


def _mode_for(target: Path) -> int:
    """The target's permission bits if it exists, else what a new file gets under the umask."""
    if target.exists():
        return stat.S_IMODE(target.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
