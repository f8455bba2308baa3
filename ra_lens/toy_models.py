"""Tiny offline TransformerLens models with random weights, for tests, docs and benchmarks.

Nothing here touches a model hub: tokenizers are trained on a built-in corpus and weights are
random. Real HuggingFace architectures (GPT-2, Llama with GQA, OPT) are saved to a temporary folder
and booted as TransformerBridge, so they exercise the same adapters as real checkpoints.
"""

from __future__ import annotations

import tempfile
from functools import lru_cache
from typing import Literal

import torch

from ra_lens._typing import Validated
from ra_lens.models import BackendUnavailableError, _has_hooked, _tl_version, bridge_available
from ra_lens.types import HookedModel

Architecture = Literal["gpt2", "llama", "opt", "native", "hooked"]
ARCHITECTURES: tuple[str, ...] = ("gpt2", "llama", "opt", "native", "hooked")

_CORPUS = [
    "I like Italy and France. I visited the city of Florence and Paris.",
    "The quick brown fox jumps over the lazy dog.",
    "Q: hot\nA: cold\n\nQ: big\nA: small\n\nQ: up\nA: down\n\n",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "When Mary and John went to the store, John gave a drink to Mary.",
]


@lru_cache(maxsize=1)
def tiny_tokenizer_dir() -> str:
    """Train a 300-token byte-level BPE on a built-in corpus and save it; returns the folder.

    >>> from transformers import AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    >>> len(tokenizer), tokenizer.tokenize(" Paris"), tokenizer.pad_token_id
    (300, ['ĠPar', 'is'], 2)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<unk>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    folder = tempfile.mkdtemp(prefix="ra_lens_tiny_tok_")
    hf_tok.save_pretrained(folder)
    return folder


def hf_config(
    arch: str,
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_ctx: int,
    dropout: float = 0.0,
):
    """The HuggingFace config `tiny_model` builds a "gpt2", "llama" or "opt" model from (e.g.
    for a plain HuggingFace copy with the same weights: seed, then `from_config`).

    >>> hf_config("llama", 300, 32, 2, 4, 64).num_key_value_heads  # GQA: half the heads
    2
    """
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    special = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 2}
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab,
            n_positions=n_ctx,
            n_embd=d_model,
            n_layer=n_layers,
            n_head=n_heads,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **special,
        )
    if arch == "llama":
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            intermediate_size=2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=max(1, n_heads // 2),
            max_position_embeddings=n_ctx,
            attention_dropout=dropout,
            **special,
        )
    if arch == "opt":
        return OPTConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            ffn_dim=2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            max_position_embeddings=n_ctx,
            word_embed_proj_dim=d_model,
            dropout=dropout,
            attention_dropout=dropout,
            **special,
        )
    raise ValueError(f"unknown HF architecture {arch!r}")


def tiny_model(
    arch: Validated[Architecture] = "gpt2",
    *,
    d_model: int = 32,
    n_layers: int = 2,
    n_heads: int = 4,
    n_ctx: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    frozen: bool = False,
    dropout: float = 0.0,
) -> HookedModel:
    """A small randomly initialised TransformerLens model, built offline.

    Args:
        arch: "gpt2", "llama" (GQA: half as many key/value heads), "opt" (attention delegated to
            HuggingFace, so hook_pattern is not in the autograd graph), "native" (TL 4
            `boot_native`) or "hooked" (TL 2/3 `HookedTransformer`).
        frozen: set requires_grad False on every parameter, the usual interpretability set-up.
        dropout: dropout probability of the HuggingFace architectures ("gpt2": residual,
            embedding and attention; "llama", "opt": their dropouts), active in train mode.

    Returns:
        A TransformerBridge (or HookedTransformer for "hooked") in eval mode.

    The bridge architectures need TransformerLens >= 3, "hooked" TransformerLens 2.x or 3.x:

    >>> from ra_lens.models import bridge_available
    >>> model = tiny_model("gpt2" if bridge_available() else "hooked", frozen=True)
    >>> model.cfg.n_layers, model.cfg.n_heads, model.training, model.W_Q.requires_grad
    (2, 4, False, False)

    Raises:
        ValueError: an unknown architecture.
        BackendUnavailableError: the installed TransformerLens cannot build it (the message
            names the architectures it can build); also an ImportError and a RuntimeError.
    """
    _check_arch(arch)
    if dropout and arch not in ("gpt2", "llama", "opt"):
        raise ValueError(f"dropout is available for 'gpt2', 'llama' and 'opt', not {arch!r}")
    torch.manual_seed(seed)
    if arch == "hooked":
        from transformer_lens import HookedTransformer, HookedTransformerConfig
        from transformers import AutoTokenizer

        cfg = HookedTransformerConfig(
            d_model=d_model,
            d_head=d_model // n_heads,
            n_layers=n_layers,
            n_heads=n_heads,
            n_ctx=n_ctx,
            d_vocab=300,
            act_fn="gelu",
            normalization_type="LN",
            seed=seed,
        )
        model = HookedTransformer(
            cfg, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        )
    elif arch == "native":
        from transformer_lens.config import TransformerBridgeConfig
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import AutoTokenizer

        cfg = TransformerBridgeConfig(
            d_model=d_model,
            d_head=d_model // n_heads,
            n_layers=n_layers,
            n_ctx=n_ctx,
            n_heads=n_heads,
            d_vocab=300,
            act_fn="gelu",
            seed=seed,
        )
        model = TransformerBridge.boot_native(
            cfg, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        )
    else:
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_cfg = hf_config(arch, 300, d_model, n_layers, n_heads, n_ctx, dropout)
        hf_cfg._attn_implementation = "eager"
        hf_model = AutoModelForCausalLM.from_config(hf_cfg).eval()
        folder = tempfile.mkdtemp(prefix=f"ra_lens_tiny_{arch}_")
        hf_model.save_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        tok.save_pretrained(folder)
        from ra_lens.models import hub_offline

        with hub_offline():
            model = TransformerBridge.boot_transformers(folder, hf_model=hf_model, tokenizer=tok)
    if dtype != torch.float32:
        model = model.to(dtype)
    model.eval()
    if frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def available_architectures() -> list[str]:
    """The tiny architectures the installed TransformerLens builds: the bridge ones on
    TransformerLens >= 3, "hooked" where HookedTransformer exists (TransformerLens 2.x/3.x).

    >>> archs = available_architectures()
    >>> set(archs) <= set(ARCHITECTURES), ("gpt2" in archs) == bridge_available()
    (True, True)
    """
    bridge = bridge_available()
    return [a for a in ARCHITECTURES if (bridge if a != "hooked" else _has_hooked())]


def _check_arch(arch: object) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}: use one of {list(ARCHITECTURES)}")
    if arch in available_architectures():
        return
    kind = (
        "a HookedTransformer, which TransformerLens 4 removed"
        if arch == "hooked"
        else "a TransformerBridge, which needs TransformerLens >= 3"
    )
    raise BackendUnavailableError(
        f"tiny model {arch!r} is {kind} (installed: {_tl_version()}); here use one of "
        f"{available_architectures()}"
    )
