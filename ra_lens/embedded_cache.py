"""The converted copy of an embedded model: float32 safetensors, portable, checked by its manifest.

`convert_gguf` de-quantises a GGUF with transformers; `make_portable` rewrites what
transformers 5.x saves so that 4.57 reads it the same; `write_manifest` records the size and
sha256 of every file, written last; `cache_problem` checks all of them again on every load.
A copy written by an older ra-lens (sizes only) is adopted once its weights load and prove
finite (`adopt_unhashed`). `ra_lens.embedded` builds, swaps and locks these copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ra_lens.embedded_wheels import sha256
from ra_lens.files import write_file

if TYPE_CHECKING:
    from ra_lens.embedded_wheels import EmbeddedModel

_MANIFEST = "ra_lens_manifest.json"
# Format 1 throughout: the sha256 field is an addition that older ra-lens versions sharing the
# cache ignore (they check sizes, which stay recorded), so neither version rebuilds the other's copy.
CACHE_FORMAT = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


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


def make_portable(folder: Path) -> None:
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


def umask_modes(folder: Path) -> None:
    """Give every file of a fresh conversion the mode a new file gets (0o666 & ~umask), as the
    config and tokenizer files already have: transformers writes model.safetensors 0600, which a
    cache shared through RA_LENS_CACHE could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~umask)


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


def adopt_unhashed(model: EmbeddedModel, folder: Path) -> str | None:
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
    make_portable(folder)
    source = manifest["source"] if isinstance(manifest, dict) else "unknown"
    write_manifest(model, folder, source=source, hashed="adopted: written unhashed, checked finite")
    return None


# ---------------------------------------------------------------------------------------------
# One converter at a time, and the leftovers of killed ones
# ---------------------------------------------------------------------------------------------
