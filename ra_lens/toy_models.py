"""Tiny offline TransformerLens models with random weights, for tests, docs and benchmarks.

Nothing here touches a model hub: tokenizers are trained on a built-in corpus and weights are
random. Real HuggingFace architectures (GPT-2, Llama with GQA, OPT) are saved to a temporary folder
and booted as TransformerBridge, so they exercise the same adapters as real checkpoints.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from ra_lens._typing import Validated
from ra_lens.models import BackendUnavailableError, bridge_available, hooked_available, tl_version
from ra_lens.types import HookedModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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


#: The special token ids every tiny config gets (the tiny tokenizer's); keyword arguments of
#: mixed types (int, float): Any, as the config classes take them.
_SPECIAL_TOKENS: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 2}


def hf_config(
    arch: str,
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_ctx: int,
    dropout: float = 0.0,
) -> PretrainedConfig:
    """The HuggingFace config `tiny_model` builds a model of architecture `arch` from (e.g. for
    a plain HuggingFace copy with the same weights: `hf_model`).

    "gpt2", "llama" and "opt" are the suite's everyday models; `MATRIX_ARCHITECTURES` lists every
    architecture of the architecture matrix, each small but with its distinguishing features on
    (GQA, sliding windows of 4 tokens, soft-caps, qk-norms, partial rotary, parallel blocks, ALiBi,
    mixture of experts, post-norms).

    >>> hf_config("llama", 300, 32, 2, 4, 64).num_key_value_heads  # GQA: half the heads
    2
    >>> hf_config("gemma2", 300, 32, 2, 4, 64).attn_logit_softcapping
    2.0
    """
    builders: dict[str, Callable[[], PretrainedConfig]] = {
        **_own_name_configs(vocab, d_model, n_layers, n_heads, n_ctx, dropout),
        **_llama_family_configs(vocab, d_model, n_layers, n_heads, n_ctx, dropout),
    }
    if arch not in builders:
        raise ValueError(f"unknown HF architecture {arch!r}: use one of {sorted(builders)}")
    return builders[arch]()


def _own_name_configs(
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_ctx: int,
    dropout: float,
) -> dict[str, Callable[[], PretrainedConfig]]:
    """`hf_config`'s builders for the architectures with their own keyword names (GPT-2, OPT,
    GPT-Neo, GPT-J, BLOOM, Falcon)."""
    import transformers as tf

    special = _SPECIAL_TOKENS
    d_head = d_model // n_heads
    return {
        # transformers 5's typed __init__ omits the legacy key n_ctx, which it still takes
        # through **kwargs (4.x names it)
        "gpt2": lambda: tf.GPT2Config(  # type: ignore[call-arg]
            vocab_size=vocab, n_positions=n_ctx, n_ctx=n_ctx, n_embd=d_model, n_layer=n_layers,
            n_head=n_heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            **special,
        ),
        "opt": lambda: tf.OPTConfig(
            vocab_size=vocab, hidden_size=d_model, ffn_dim=2 * d_model,
            num_hidden_layers=n_layers, num_attention_heads=n_heads,
            max_position_embeddings=n_ctx, word_embed_proj_dim=d_model, dropout=dropout,
            attention_dropout=dropout, **special,
        ),
        "gpt_neo": lambda: tf.GPTNeoConfig(
            vocab_size=vocab, max_position_embeddings=n_ctx, hidden_size=d_model,
            num_layers=n_layers, num_heads=n_heads, window_size=4,
            attention_types=[[["global", "local"], max(1, n_layers // 2)]], **special,
        ),
        "gptj": lambda: tf.GPTJConfig(
            vocab_size=vocab, n_positions=n_ctx, n_embd=d_model, n_layer=n_layers,
            n_head=n_heads, rotary_dim=d_head // 2, **special,
        ),
        "bloom": lambda: tf.BloomConfig(
            vocab_size=vocab, hidden_size=d_model, n_layer=n_layers, n_head=n_heads, **special
        ),
        "falcon": lambda: tf.FalconConfig(
            vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, new_decoder_architecture=False, multi_query=True,
            parallel_attn=True, alibi=False, **special,
        ),
    }  # fmt: skip


def _llama_family_configs(
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_ctx: int,
    dropout: float,
) -> dict[str, Callable[[], PretrainedConfig]]:
    """`hf_config`'s builders for the architectures that take the Llama family's keyword names
    (GPT-NeoX, Llama, Mistral, Mixtral, Qwen, Gemma, Phi, OLMo, StableLM)."""
    import transformers as tf

    special = _SPECIAL_TOKENS
    d_head = d_model // n_heads
    kv = max(1, n_heads // 2)
    # The Llama family's keyword names; most architectures below take these.
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": d_model,
        "intermediate_size": 2 * d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "max_position_embeddings": n_ctx,
        "attention_dropout": dropout,
        **special,
    }
    gemma: dict[str, Any] = {
        "num_key_value_heads": kv,
        "head_dim": d_head,
        "query_pre_attn_scalar": 12,
    }
    window = ["sliding_attention", "full_attention"] * n_layers
    return {
        # rotary_pct (GPT-NeoX) and partial_rotary_factor (Phi): legacy keys transformers 5's
        # typed __init__ omits but still takes through **kwargs (4.x names them)
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common, rotary_pct=0.25, hidden_dropout=dropout),  # type: ignore[call-arg]
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=kv),
        "mistral": lambda: tf.MistralConfig(**common, num_key_value_heads=kv, sliding_window=4),
        "mixtral": lambda: tf.MixtralConfig(
            **common, num_key_value_heads=kv, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2": lambda: tf.Qwen2Config(**common, num_key_value_heads=kv),
        "qwen3": lambda: tf.Qwen3Config(**common, num_key_value_heads=kv, head_dim=d_head),
        "gemma": lambda: tf.GemmaConfig(**common, num_key_value_heads=kv, head_dim=d_head),
        "gemma2": lambda: tf.Gemma2Config(
            **common, **gemma, sliding_window=4, attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **common, **{**gemma, "num_key_value_heads": 1}, sliding_window=4,
            layer_types=window[:n_layers],
        ),
        "phi": lambda: tf.PhiConfig(**common, partial_rotary_factor=0.5),  # type: ignore[call-arg]
        "phi3": lambda: tf.Phi3Config(
            **common, num_key_value_heads=kv, original_max_position_embeddings=n_ctx
        ),
        "olmo": lambda: tf.OlmoConfig(**common),
        "olmo2": lambda: tf.Olmo2Config(**common),
        "stablelm": lambda: tf.StableLmConfig(**common, num_key_value_heads=n_heads),
    }  # fmt: skip


#: The architecture matrix: tiny random models of the architectures researchers study, each built
#: offline from transformers' config classes (`hf_config`), booted as TransformerBridges.
MATRIX_ARCHITECTURES: tuple[str, ...] = (
    "gpt2", "gpt_neo", "gptj", "gpt_neox", "opt", "bloom", "falcon", "llama", "mistral",
    "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "olmo", "olmo2",
    "stablelm",
)  # fmt: skip


def hf_model(
    arch: str,
    *,
    d_model: int = 32,
    n_layers: int = 2,
    n_heads: int = 4,
    n_ctx: int = 64,
    seed: int = 0,
    dropout: float = 0.0,
    spread: bool = False,
) -> PreTrainedModel:
    """The plain HuggingFace model (eager attention, eval mode) `tiny_model` boots: the same
    weights for the same arguments, so it serves as an independent reference.

    Args:
        spread: multiply the query/key weights by 8 and move every norm weight off its
            initial value, so that attention is sharp, soft-caps bite and norms matter (the
            architecture matrix's setting).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch, 300, d_model, n_layers, n_heads, n_ctx, dropout)
    cfg._attn_implementation = "eager"
    model: PreTrainedModel = AutoModelForCausalLM.from_config(cfg).eval()
    if spread:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "ln" in name:
                    param.add_(0.3 * torch.randn_like(param))
                if any(key in name for key in _QK_WEIGHTS):
                    param.mul_(8.0)
    return model


# Parameter names holding query/key projections (joint qkv ones included) across architectures.
_QK_WEIGHTS = ("q_proj", "k_proj", "query_key_value", "c_attn", "qkv_proj", "Wqkv")


#: The matrix architectures TransformerLens 2.18 builds as a HookedTransformer from a local
#: HuggingFace model (`hooked_matrix_model`); it knows the others (Gemma, OLMo, Falcon,
#: StableLM) only by their hub names, or not at all.
HOOKED_MATRIX_ARCHITECTURES: tuple[str, ...] = (
    "gpt2", "gpt_neo", "gptj", "gpt_neox", "opt", "bloom", "llama", "mistral", "mixtral",
    "qwen2", "qwen3", "phi", "phi3",
)  # fmt: skip


def hooked_matrix_model(
    arch: str, *, dtype: torch.dtype = torch.float64, spread: bool = True
) -> HookedModel:
    """TransformerLens 2's HookedTransformer of the tiny HuggingFace model `hf_model(arch)`,
    through TL 2's own config and weight conversion (no weight processing, so its activations
    are HuggingFace's), in eval mode. For `HOOKED_MATRIX_ARCHITECTURES` under TL 2.x.

    Raises:
        BackendUnavailableError: TransformerLens has no HookedTransformer (TL >= 4).
    """
    if not hooked_available():
        raise BackendUnavailableError(
            f"hooked_matrix_model needs TransformerLens 2.x/3.x (installed: {tl_version()})"
        )
    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer
    from transformers import AutoTokenizer

    # transformers wraps .to with functools.wraps(nn.Module.to), which mypy binds without self
    hf = hf_model(arch, spread=spread).to(dtype)  # type: ignore[arg-type]
    # TL 2 reads model families off the path's name ("llama" ...): keep it neutral
    folder = tempfile.mkdtemp(prefix="ra_lens_tiny_hooked_")
    hf.save_pretrained(folder)
    cfg = loading.get_pretrained_model_config(
        folder, hf_cfg=hf.config.to_dict(), fold_ln=False, device="cpu", dtype=dtype, n_ctx=64
    )
    model = HookedTransformer(cfg, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir()))
    state = loading.get_pretrained_state_dict(folder, cfg, hf, dtype=dtype)
    model.load_and_process_state_dict(
        state,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return cast(HookedModel, model.eval())  # HookedTransformer (absent from TL 4, so Any here)


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
    spread: bool = False,
) -> HookedModel:
    """A small randomly initialised TransformerLens model, built offline.

    Args:
        arch: "gpt2", "llama" (GQA: half as many key/value heads), "opt" (attention delegated to
            HuggingFace, so hook_pattern is not in the autograd graph), "native" (TL 4
            `boot_native`) or "hooked" (TL 2/3 `HookedTransformer`).
        frozen: set requires_grad False on every parameter, the usual interpretability set-up.
        dropout: dropout probability of the HuggingFace architectures ("gpt2": residual,
            embedding and attention; "llama", "opt": their dropouts), active in train mode.
        spread: sharper attention and norms off their initial values (`hf_model`).

    Any of `MATRIX_ARCHITECTURES` (GPT-Neo, Gemma-2, OLMo-2, ...) is built the same way as
    "gpt2", "llama" and "opt"; their plain HuggingFace twin is `hf_model`.

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
    if dropout and arch in ("native", "hooked"):
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
        model: HookedModel = HookedTransformer(
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
        # TL attaches boot_native at import of transformer_lens.model_bridge.sources.native
        model = TransformerBridge.boot_native(  # type: ignore[attr-defined]
            cfg, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        )
    else:
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import AutoTokenizer

        hf = hf_model(
            arch, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_ctx=n_ctx, seed=seed,
            dropout=dropout, spread=spread,
        )  # fmt: skip
        folder = tempfile.mkdtemp(prefix=f"ra_lens_tiny_{arch}_")
        hf.save_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        tok.save_pretrained(folder)
        from ra_lens.models import hub_offline

        with hub_offline():
            model = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tok)
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
    return [a for a in ARCHITECTURES if (bridge if a != "hooked" else hooked_available())]


def _check_arch(arch: object) -> None:
    if arch in MATRIX_ARCHITECTURES and bridge_available():
        return
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
        f"tiny model {arch!r} is {kind} (installed: {tl_version()}); here use one of "
        f"{available_architectures()}"
    )
