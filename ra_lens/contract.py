"""The model contract's fixed part: what ra-lens reads from a model without running it.

Every TransformerLens hook name ra-lens uses (the constants below), the `HookedModel` protocol,
the attention geometry (`model_shape`, `attention_scale`, the query/key hook of a layer) and
checked layer lists. Running a model (state, hooks, recording, tokenising) is `ra_lens.capture`'s
job, which re-exports every name here.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.math import causal_mask

if TYPE_CHECKING:
    from typing_extensions import Self

# Every TransformerLens hook name ra-lens uses; format with the layer index.
PATTERN = "blocks.{}.attn.hook_pattern"
SCORES = "blocks.{}.attn.hook_attn_scores"
Z = "blocks.{}.attn.hook_z"
V = "blocks.{}.attn.hook_v"
Q = "blocks.{}.attn.hook_q"
K = "blocks.{}.attn.hook_k"
ROT_Q = "blocks.{}.attn.hook_rot_q"  # rotary models: q and k after the rotation
ROT_K = "blocks.{}.attn.hook_rot_k"
COS = "blocks.{}.attn.hook_cos"  # TransformerBridge rotary tables
SIN = "blocks.{}.attn.hook_sin"
ATTN_IN = "blocks.{}.attn.hook_in"  # TransformerBridge: input of the attention block
Q_IN = "blocks.{}.attn.q.hook_in"  # TransformerBridge: input of the q / k projections
K_IN = "blocks.{}.attn.k.hook_in"
RESID_PRE = "blocks.{}.hook_resid_pre"
POST_ATTN_IN = "blocks.{}.ln1_post.hook_in"  # TransformerBridge: input of a post-attention norm
MLP_IN = "blocks.{}.mlp.hook_in"  # TransformerBridge: what the MLP itself receives
LN2_IN = "blocks.{}.ln2.hook_in"  # TransformerBridge: the MLP's input before its norm
HOOKED_MLP_IN = "blocks.{}.hook_mlp_in"  # HookedTransformer, with cfg.use_hook_mlp_in
MLP_OUT = "blocks.{}.hook_mlp_out"
RESID_POST = "blocks.{}.hook_resid_post"


@runtime_checkable
class HookedModel(Protocol):
    """What ra-lens needs of a model: a TransformerLens HookedRootModule with a config.

    HookedTransformer (TL 2.x/3.x) and TransformerBridge (TL 3.x/4.x) both qualify.

    >>> isinstance(model, HookedModel), isinstance(torch.nn.Linear(2, 2), HookedModel)
    (True, False)
    """

    @property
    def hook_dict(self) -> dict[str, Any]: ...  # read-only on TransformerBridge

    cfg: Any

    def hooks(self, *args: Any, **kwargs: Any) -> AbstractContextManager[Any]: ...

    def to_tokens(self, *args: Any, **kwargs: Any) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    if TYPE_CHECKING:
        # Read where a TransformerLens model is already known (both backends have them), but
        # not part of the run-time isinstance check above, which stays as it was.
        blocks: Any
        tokenizer: Any

        def modules(self) -> Iterator[torch.nn.Module]: ...

        def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

        def named_buffers(self) -> Iterator[tuple[str, Tensor]]: ...

        def eval(self) -> Self: ...

        def to(self, *args: Any, **kwargs: Any) -> Self: ...

        def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...


_NOT_TL = (
    "ra_lens needs a TransformerLens model (HookedTransformer or TransformerBridge), "
    "e.g. ra_lens.load_model() or TransformerBridge.boot_transformers(name)"
)


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a model and the config switches that change what reads what,
    read from its config.

    positions: `cfg.positional_embedding_type` ("standard": a learned W_pos, "rotary",
        "shortformer", ...; "" where the config has none).
    norm_before_and_after: TransformerLens 2's post-norm blocks (Gemma-2/3 as HookedTransformer).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    n_ctx: int | None
    d_model: int = 0
    parallel_attn_mlp: bool = False
    positions: str = ""
    norm_before_and_after: bool = False


def model_shape(model: Validated[HookedModel]) -> ModelShape:
    """Read the attention geometry and check that the hooks ra-lens needs exist.

    Raises:
        TypeError: the model is not a TransformerLens model or lacks attention hooks.

    >>> shape = model_shape(model)
    >>> shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.d_head, shape.n_ctx, shape.d_model
    (2, 4, 4, 8, 64, 32)
    >>> shape.positions, shape.parallel_attn_mlp
    ('standard', False)
    """
    hook_dict = getattr(model, "hook_dict", None)
    cfg = getattr(model, "cfg", None)
    if hook_dict is None or cfg is None or not hasattr(model, "hooks"):
        raise TypeError(f"{type(model).__name__} has no hook_dict/cfg/hooks(): {_NOT_TL}")
    n_layers = int(cfg.n_layers)
    for layer in range(n_layers):
        for name in (PATTERN.format(layer), RESID_PRE.format(layer)):
            if name not in hook_dict:
                raise TypeError(f"model has no hook {name!r}: {_NOT_TL}")
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
    n_ctx = getattr(cfg, "n_ctx", None)
    return ModelShape(
        n_layers, n_heads, int(n_kv), int(cfg.d_head), int(n_ctx) if n_ctx else None,
        d_model=int(cfg.d_model),
        parallel_attn_mlp=bool(getattr(cfg, "parallel_attn_mlp", False)),
        positions=str(getattr(cfg, "positional_embedding_type", "") or ""),
        norm_before_and_after=bool(getattr(cfg, "use_normalization_before_and_after", False)),
    )  # fmt: skip


def check_model(model: Validated[HookedModel]) -> ModelShape:
    """`model_shape`, and weights that hold numbers: a model with weights or buffers on PyTorch's
    meta device (built without its weights, e.g. under `init_empty_weights` or moved with
    `.to("meta")`) cannot run. Weights that accelerate offloads (`device_map` with "disk": they
    sit on the meta device and its hooks load them for each call) are fine, except the first
    weight: ra-lens puts its inputs on that weight's device. Every call that runs the model checks
    this first (`capture.to_batch`, `live_attention`, the liveness probe), so the answer is this
    error rather than torch's "Cannot copy out of meta tensor" from deep inside the forward pass.

    Raises:
        TypeError: not a TransformerLens model (see `model_shape`).
        ValueError: weights or buffers on the meta device that nothing loads, naming the first;
            an offloaded first weight.

    >>> check_model(model).n_layers
    2
    """
    shape = model_shape(model)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    loaded = _offloaded_tensors(model)
    empty = [name for name, tensor in tensors if tensor.is_meta and id(tensor) not in loaded]
    if empty:
        raise ValueError(
            "the model's weights are on the meta device (the model was built without them): "
            "load them first, e.g. with ra_lens.load_model, or model.to_empty(device=...) then "
            "model.load_state_dict(...) (weights accelerate offloads with device_map are fine); "
            f"{len(empty)} of {len(tensors)} weights and buffers hold no numbers, e.g. {empty[0]!r}"
        )
    first = next(iter(model.named_parameters()), None)
    if first is not None and first[1].is_meta:
        raise ValueError(
            f"the model's first weight ({first[0]!r}) is offloaded by accelerate (on the meta "
            "device), and ra-lens puts its inputs on the first weight's device: keep the "
            "embeddings on a real device (e.g. device_map={'model.embed_tokens': 'cpu', ...}) "
            "and offload later layers only"
        )
    return shape


def _offloaded_tensors(model: HookedModel) -> set[int]:
    """ids of the parameters and buffers that accelerate's hooks load before each call: those of
    modules with an `_hf_hook` (dispatch_model / device_map / cpu_offload put one on each)."""
    return {
        id(tensor)
        for module in model.modules()
        if getattr(module, "_hf_hook", None) is not None
        for tensor in (*module.parameters(), *module.buffers())
    }


def query_hook_name(model: HookedModel, layer: int) -> str:
    """The hook point of the queries this layer's attention uses: `hook_rot_q` (after the
    rotation) on rotary models, `hook_q` otherwise.

    >>> query_hook_name(model, 1)                            # GPT-2: no rotary embedding
    'blocks.1.attn.hook_q'
    """
    rotated = ROT_Q.format(layer)
    return rotated if rotated in model.hook_dict else Q.format(layer)


def key_hook_name(model: HookedModel, layer: int) -> str:
    """The hook point of the keys this layer's attention uses: `hook_rot_k` on rotary models,
    `hook_k` otherwise.

    >>> key_hook_name(model, 0)                              # GPT-2: no rotary embedding
    'blocks.0.attn.hook_k'
    """
    rotated = ROT_K.format(layer)
    return rotated if rotated in model.hook_dict else K.format(layer)


def attention_scale(model: HookedModel, layer: int) -> float:
    """The divisor s in S = QK^T / s for one layer, read from the model rather than assumed.

    TL 2 keeps it as `attn.attn_scale`; TL-native bridges as `attn.original_component.scale`;
    HuggingFace attention modules as the multiplier `scaling` (transformers >= 5 folds GPT-2's
    `scale_attn_by_inverse_layer_idx` and Gemma's `query_pre_attn_scalar` into it) or
    `inv_norm_factor` (BLOOM, Falcon). GPT-Neo's attention has no scale at all (s = 1).

    A TransformerBridge whose attention computes the scores itself (`_bridge_scale`: GPT-2,
    NeoX-style, BLOOM) must use the scale of the HuggingFace module it wraps; where it does not
    (GPT-2 with `scale_attn_weights=False`: the bridge still divides by sqrt(d_head)), the bridge
    runs another model than the checkpoint, and the layer is refused.

    Raises:
        NotImplementedError: a HuggingFace attention module whose scale ra-lens cannot read
            (nothing is assumed: a wrong s would scale every "qk" map silently), or a bridge
            whose scale disagrees with its HuggingFace module's.

    >>> math.isclose(attention_scale(model, 0), math.sqrt(model.cfg.d_head))  # GPT-2: sqrt(d_head)
    True
    """
    attn = model.blocks[layer].attn
    if isinstance(getattr(attn, "attn_scale", None), (int, float)):
        return float(attn.attn_scale)
    inner: Any = getattr(attn, "original_component", None)
    if isinstance(getattr(inner, "scale", None), (int, float)):
        return float(inner.scale)
    if inner is None:  # no HuggingFace module behind the hooks: the config says
        cfg = model.cfg
        if getattr(cfg, "use_attn_scale", True) is False:
            return 1.0
        attn_scale = float(getattr(cfg, "attn_scale", -1.0))
        return attn_scale if attn_scale > 0 else math.sqrt(cfg.d_head)
    scale = hf_attention_scale(inner, layer)
    bridge = _bridge_scale(attn, layer, int(model.cfg.d_head))
    if bridge is not None and not math.isclose(bridge, scale, rel_tol=1e-6):
        raise NotImplementedError(
            f"layer {layer}: the TransformerBridge's {type(attn).__name__} computes QK^T / "
            f"{bridge:.6g} (TransformerLens fixes 1/sqrt(d_head)) while the HuggingFace "
            f"{type(inner).__name__} it wraps computes QK^T / {scale:.6g}"
            f"{_hf_scale_settings(inner)}: the bridge runs another model than the checkpoint, "
            f"and its attention (and a 'qk' map) would be off by {bridge / scale:.4g}x; ra-lens "
            "does not inherit that silently. Use a TransformerLens whose bridge applies the "
            "checkpoint's scale, or the nnsight route (ra_lens.nnsight), which runs HuggingFace's "
            "own attention"
        )
    return scale


#: TransformerBridge attention components that compute QK^T themselves, with a scale of their
#: own (TransformerLens 4.3): the class defining `_reconstruct_attention` -> whether the scale
#: also grows with the layer under the config's `scale_attn_by_inverse_layer_idx` (GPT-2).
_RECONSTRUCTING_BRIDGES = {
    "JointQKVAttentionBridge": True,
    "JointQKVPositionEmbeddingsAttentionBridge": False,
    "BloomAttentionBridge": False,
}


def _bridge_scale(attn: Any, layer: int, d_head: int) -> float | None:
    """The divisor a bridge's own attention code applies to QK^T (sqrt(d_head), times layer + 1
    under GPT-2's `scale_attn_by_inverse_layer_idx`), or None where the bridge leaves the scores
    to the HuggingFace module (whose scale `hf_attention_scale` reads)."""
    owner = next((k for k in type(attn).__mro__ if "_reconstruct_attention" in vars(k)), None)
    if owner is None or owner.__name__ not in _RECONSTRUCTING_BRIDGES:
        return None
    scale = math.sqrt(d_head)
    by_layer = getattr(getattr(attn, "config", None), "scale_attn_by_inverse_layer_idx", False)
    if _RECONSTRUCTING_BRIDGES[owner.__name__] and by_layer:
        scale *= layer + 1
    return scale


def _hf_scale_settings(inner: Any) -> str:
    """The HuggingFace config's attention-scale settings, for a message: ' (scale_attn_weights=
    False)' and the like, or ''."""
    config = getattr(inner, "config", None)
    names = ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "query_pre_attn_scalar")
    found = [f"{n}={getattr(config, n)!r}" for n in names if getattr(config, n, None) is not None]
    return f" (its config: {', '.join(found)})" if found else ""


def hf_attention_scale(inner: Any, layer: int) -> float:
    """`attention_scale` of a HuggingFace attention module itself (what a bridge wraps, or
    what an nnsight model holds): 1 / `scaling` or 1 / `inv_norm_factor`; 1 where unscaled."""
    for name in ("scaling", "inv_norm_factor"):
        value = getattr(inner, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return 1.0 / float(value)
    if type(inner).__name__ in _UNSCALED_ATTENTION:
        return 1.0
    raise NotImplementedError(
        f"cannot read the attention scale of {type(inner).__name__} (layer {layer}): it has no "
        "`scaling` or `inv_norm_factor` attribute, and ra-lens does not assume sqrt(d_head); "
        "the 'scores' convention (dL/d pre-softmax scores) needs no scale"
    )


#: HuggingFace attention modules that compute QK^T without any scale (GPT-Neo's softmax reads
#: the raw dot products, in float32).
_UNSCALED_ATTENTION = ("GPTNeoSelfAttention",)


def attention_softcap(model: HookedModel, layer: int) -> float | None:
    """The attention logit soft-cap c of one layer (S = c tanh(QK^T / (s c)), Gemma-2), or None.

    Read from the HuggingFace module's `attn_logit_softcapping` (TransformerBridge) or the TL 2
    config's `attn_scores_soft_cap` (HookedTransformer; <= 0 means none).

    >>> attention_softcap(model, 0) is None  # GPT-2 has no soft-cap
    True
    """
    inner = getattr(model.blocks[layer].attn, "original_component", None)
    if inner is not None:
        return hf_attention_softcap(inner)
    value = getattr(model.cfg, "attn_scores_soft_cap", None)
    if value is None or float(value) <= 0:
        return None
    return float(value)


def hf_attention_softcap(inner: Any) -> float | None:
    """`attention_softcap` of a HuggingFace attention module: its `attn_logit_softcapping`."""
    value = getattr(inner, "attn_logit_softcapping", None)
    if value is None or float(value) <= 0:
        return None
    return float(value)


def output_softcap(model: HookedModel) -> float | None:
    """The final logit soft-cap c (logits = c tanh(unembed(x) / c), Gemma-2), or None: TL 2's
    and TL 4's config both call it `output_logits_soft_cap` (<= 0 means none).

    >>> output_softcap(model) is None
    True
    """
    value = getattr(model.cfg, "output_logits_soft_cap", None)
    return float(value) if value is not None and float(value) > 0 else None


@dataclass(frozen=True)
class AttentionFacts:
    """What turns one layer's q k^T into its softmax input: S = c tanh(q k^T / (s c)) (without a
    soft-cap c: q k^T / s), plus ALiBi's bias m_h * (key position) where there is one (BLOOM),
    -inf outside the causal mask and outside a sliding window of w keys (key s visible from
    query t iff t - w < s <= t). Read by `attention_facts`; `logits` is the one recomputation of
    attention scores that attribution, circuits and dynamics share. `rotary`: q and k are
    rotated by position before q k^T (the rotation itself is `attention.rotary_function`'s)."""

    scale: float
    softcap: float | None = None
    window: int | None = None
    qk_norm: bool = False  # q/k normalised after the projection (Qwen3, Gemma-3, OLMo-2)
    alibi: bool = False  # position biases added to the scores (BLOOM)
    alibi_slopes: tuple[float, ...] | None = None  # m_h per head, where they could be read
    rotary: bool = False

    def mask(self, n_pos: int, device: torch.device | str | None = None) -> Tensor:
        """Bool [query, key]: True where the key is visible."""
        visible = causal_mask(n_pos, n_pos, device)
        if self.window is not None:
            visible = visible.triu(diagonal=1 - self.window)
        return visible

    def logits(self, raw: Tensor) -> Tensor:
        """Float[Tensor, "... query key"]: raw q k^T (query and key axes last) to the softmax
        input, -inf where masked.

        >>> facts = AttentionFacts(scale=2.0, softcap=1.0, window=2)
        >>> facts.logits(torch.full((3, 3), 4.0))[2]  # tanh(2) = 0.964; key 0 out of the window
        tensor([  -inf, 0.9640, 0.9640])
        """
        scores = raw / self.scale
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.alibi_slopes is not None:  # [.., head, query, key]: m_h * key position
            slopes = torch.tensor(self.alibi_slopes, dtype=raw.dtype, device=raw.device)
            positions = torch.arange(raw.shape[-1], dtype=raw.dtype, device=raw.device)
            scores = scores + slopes[:, None, None] * positions
        return scores.masked_fill(~self.mask(raw.shape[-1], raw.device), float("-inf"))

    def refusal(self) -> str | None:
        """Why q/k changes cannot be replayed through these facts alone (None: they can)."""
        if self.alibi and self.alibi_slopes is None:
            return "ALiBi position biases whose slopes ra-lens cannot read here are not modelled"
        if self.qk_norm:
            return (
                "q/k norms (Qwen3, Gemma-3, OLMo-2) sit between the projection and the softmax, "
                "and a q/k change is replayed through the projection only"
            )
        return None


def attention_facts(model: HookedModel, layer: int) -> AttentionFacts:
    """One layer's `AttentionFacts`, read from the model: scale (`attention_scale`), soft-cap
    (`attention_softcap`), sliding window (the HuggingFace module's `sliding_window`, else its
    config's; TL 2's `window_size` on local layers), q/k norms, ALiBi and rotary embeddings.

    >>> facts = attention_facts(model, 0)  # GPT-2: plain causal softmax attention
    >>> facts.softcap, facts.window, facts.qk_norm, facts.alibi_slopes, facts.rotary
    (None, None, False, None, False)
    >>> facts.refusal() is None
    True
    """
    inner = getattr(model.blocks[layer].attn, "original_component", None)
    cfg = model.cfg
    window: Any = None
    if inner is not None:
        config = getattr(inner, "config", None)
        window = getattr(inner, "sliding_window", None)
        if getattr(inner, "attention_type", None) == "local":  # GPT-Neo's local layers
            window = getattr(config, "window_size", None)
        elif window is None and not hasattr(inner, "sliding_window"):
            window = getattr(config, "sliding_window", None)
        qk_norm = getattr(inner, "q_norm", None) is not None or hasattr(inner, "q_layernorm")
    else:
        attn_types = getattr(cfg, "attn_types", None)
        if getattr(cfg, "use_local_attn", False) and attn_types and attn_types[layer] == "local":
            window = getattr(cfg, "window_size", None)
        qk_norm = bool(getattr(cfg, "use_qk_norm", False))
    positions = getattr(cfg, "positional_embedding_type", "")
    alibi = positions == "alibi" or type(inner).__name__.startswith("Bloom")
    return AttentionFacts(
        scale=attention_scale(model, layer),
        softcap=attention_softcap(model, layer),
        window=int(window) if window else None,
        qk_norm=bool(qk_norm),
        alibi=bool(alibi),
        alibi_slopes=_alibi_slopes(model, layer) if alibi else None,
        rotary=positions == "rotary",
    )


def _alibi_slopes(model: HookedModel, layer: int) -> tuple[float, ...] | None:
    """The per-head ALiBi slopes m_h, from the model's own code: HuggingFace's BLOOM
    (`build_alibi_tensor`) or TL 2's attention (`create_alibi_multipliers`; its bias m_h (s - t)
    differs from m_h s by a constant per row, which the softmax ignores). None elsewhere."""
    attn = model.blocks[layer].attn
    inner: Any = getattr(attn, "original_component", None)
    if type(inner).__name__.startswith("Bloom"):
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        ones = torch.ones(1, 2, dtype=torch.long)
        alibi = build_alibi_tensor(ones, int(inner.num_heads), torch.float64)  # [head, 1, 2]
        return tuple(float(m) for m in alibi[:, 0, 1])
    if inner is None and hasattr(attn, "create_alibi_multipliers"):
        return tuple(float(m) for m in attn.create_alibi_multipliers(int(model.cfg.n_heads)))
    return None


def recompute_tolerance(dtype: torch.dtype) -> float:
    """Largest |recomputed - recorded| accepted when ra-lens redoes a model's attention (softmax
    rows, rotations) from its recorded activations: 1e-4 for float32/float64 (HF's eager
    attention takes the softmax in float32 even in a float64 model), 2e-2 for half precision,
    whose activations are rounded to ~1e-3.

    >>> recompute_tolerance(torch.float32), recompute_tolerance(torch.bfloat16)
    (0.0001, 0.02)
    """
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's norms sit and what its MLP reads (`block_layout`).

    pre_norm: the norm in front of the attention (None where there is none: OLMo-2).
    post_attn_norm: the norm applied to the attention's output before it joins the residual
        (Gemma-2/3, OLMo-2), as a plain module that fires no TransformerLens hook; None in
        pre-norm blocks.
    parallel: attention and MLP read the same residual (GPT-NeoX/Pythia, GPT-J, Phi, Falcon).
    mlp_reads_attn_norm: in a parallel block, the MLP reads the attention's norm output (GPT-J,
        Phi, Falcon: one norm), not its own (GPT-NeoX's ln2).
    has_mlp: False in an attention-only model (`cfg.attn_only`).
    """

    pre_norm: Any
    post_attn_norm: Any
    parallel: bool
    mlp_reads_attn_norm: bool
    has_mlp: bool = True


def block_layout(model: HookedModel, layer: int) -> BlockLayout:
    """One block's `BlockLayout`, read from the model (TransformerBridge submodules `ln1`,
    `ln2`, `ln1_post`; TL 2's config).

    >>> layout = block_layout(model, 0)  # GPT-2: pre-norm, sequential
    >>> layout.post_attn_norm is None, layout.parallel, layout.mlp_reads_attn_norm
    (True, False, False)
    """
    block = model.blocks[layer]
    parallel = bool(getattr(model.cfg, "parallel_attn_mlp", False))
    post = getattr(block, "ln1_post", None)
    if post is not None:
        post = getattr(post, "original_component", None) or post
    return BlockLayout(
        pre_norm=getattr(block, "ln1", None),
        post_attn_norm=post,
        parallel=parallel,
        mlp_reads_attn_norm=parallel
        and not hasattr(block, "ln2")
        and MLP_IN.format(layer) in model.hook_dict,
        has_mlp=not getattr(model.cfg, "attn_only", False),
    )


@dataclass(frozen=True)
class ModelFacts:
    """What one call needs to know of a model, read once (`model_facts`) and handed down:
    its `ModelShape`, and per layer its `AttentionFacts`, `BlockLayout` and `mlp_in`, the hook
    that sees the MLP's input before its norm and feeds nothing else (edge patching rewrites
    it): a bridge's ln2.hook_in, its mlp.hook_in in a post-norm block without one (OLMo-2),
    else HookedTransformer's hook_mlp_in. `ungrouped_kv`: a grouped-query HookedTransformer
    with `cfg.ungroup_grouped_query_attention` (EAP-IG's setting), whose hook_k/hook_v repeat
    each key/value head per query head (`refuse_ungrouped_kv`)."""

    shape: ModelShape
    attention: tuple[AttentionFacts, ...]
    layouts: tuple[BlockLayout, ...]
    mlp_in: tuple[str, ...] = ()
    ungrouped_kv: bool = False


def model_facts(model: HookedModel) -> ModelFacts:
    """The model's `ModelFacts` (`model_shape`'s checks included).

    >>> facts = model_facts(model)
    >>> len(facts.layouts), facts.attention[0].scale == attention_facts(model, 0).scale
    (2, True)
    """
    shape = model_shape(model)
    layers = range(shape.n_layers)
    layouts = tuple(block_layout(model, layer) for layer in layers)
    points = model.hook_dict  # a bridge rebuilds it on every access: read once
    mlp_in = []
    for layer, layout in zip(layers, layouts):
        if LN2_IN.format(layer) in points:
            mlp_in.append(LN2_IN.format(layer))
        elif MLP_IN.format(layer) in points and layout.post_attn_norm is not None:
            mlp_in.append(MLP_IN.format(layer))
        else:
            mlp_in.append(HOOKED_MLP_IN.format(layer))
    ungrouped = bool(getattr(model.cfg, "ungroup_grouped_query_attention", False))
    return ModelFacts(
        shape,
        tuple(attention_facts(model, layer) for layer in layers),
        layouts,
        tuple(mlp_in),
        ungrouped_kv=ungrouped and shape.n_kv_heads < shape.n_heads,
    )


def refuse_ungrouped_kv(facts: ModelFacts, works: str, note: str = "") -> None:
    """Refuse a model whose hook_k/hook_v hold one copy of each key/value head per query head
    (`ModelFacts.ungrouped_kv`) where the caller works per key/value head, naming the fix.
    `works`: who does what (e.g. "attention_attribution scores keys"); `note`: what else the
    fix leaves as it is.

    >>> refuse_ungrouped_kv(model_facts(model), "attention_attribution scores keys")  # GPT-2
    """
    if facts.ungrouped_kv:
        raise NotImplementedError(
            "cfg.ungroup_grouped_query_attention=True: hook_k/hook_v hold a copy of each "
            f"key/value head per query head, while {works} per key/value head; call "
            "model.set_ungroup_grouped_query_attention(False) (the model computes the same "
            f"either way{note})"
        )
