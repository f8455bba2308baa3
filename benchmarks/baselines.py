"""Reference points RA is timed against that are not ra_lens methods.

- `bare_forward`: the forward pass alone;
- `floor`: what `reversed_attention` does minus the RA hooks (RA cannot be cheaper);
- `OfficialStyleLoop`: the official Reversed-Attention code's approach (plain HuggingFace, one
  prompt at a time, a Python loop over layers and heads), re-written here from the formula in
  the README's "What RA is" section (never copied), with `plain_hf_copy` for the plain model.

Every ranking method (causal mediation, attribution patching, ...) is timed as the library's own
function from `ra_lens.ranking`, not re-implemented here.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import RESID_PRE
from ra_lens.metrics import target_nll


def bare_forward(model: Any, tokens: Int[Tensor, "batch pos"]) -> Tensor:
    """model(tokens) under no_grad."""
    with torch.no_grad():
        return model(tokens)


def floor(
    model: Any, tokens: Int[Tensor, "batch pos"], targets: Int[Tensor, " batch"]
) -> Float[Tensor, "batch pos d_model"]:
    """reversed_attention minus the RA hooks: blocks.0.hook_resid_pre made a fresh leaf, forward,
    the summed per-prompt target NLL, torch.autograd.grad to the leaf. Returns that gradient."""
    metric = target_nll(targets)
    store: dict[str, Tensor] = {}
    with capture.preserved_state(model), torch.enable_grad():
        with model.hooks(fwd_hooks=[(RESID_PRE.format(0), capture.gradient_leaf_hook(store))]):
            loss = metric(model(tokens)).sum()
            (grad,) = torch.autograd.grad(loss, [store["leaf"]])
    return grad


def plain_hf_copy(bridge: Any) -> Any:
    """A plain HuggingFace model (eager attention) with the bridge's weights, frozen, eval mode.

    The bridge wraps HF submodules in place (LinearBridge, HookPoints), so `bridge.original_model`
    is no longer plain HF; a fresh model from the same config gets the same state dict back.
    """
    from transformers import AutoModelForCausalLM

    orig = bridge.original_model
    config = orig.config.__class__.from_dict(orig.config.to_dict())
    config._attn_implementation = "eager"
    param = next(orig.parameters())
    fresh = AutoModelForCausalLM.from_config(config)
    fresh = fresh.to(device=param.device, dtype=param.dtype).eval()
    wanted = fresh.state_dict()
    source = {k.replace("._original_component", ""): v for k, v in orig.state_dict().items()}
    fresh.load_state_dict({k: v for k, v in source.items() if k in wanted}, strict=False)
    missing = [k for k in wanted if k not in source]
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied:
        raise RuntimeError(f"could not copy {sorted(set(missing) - tied)[:4]} from the bridge")
    fresh.requires_grad_(False)
    return fresh


class OfficialStyleLoop:
    """RA the official code's way: plain HF, batch size 1, Python loops over layers and heads.

    `output_attentions` gives A, a forward hook on the value projection gives V, a full backward
    hook on the attention output projection gives G = dL/d(head outputs); then for each layer and
    head R = G_h V_h^T and RA = A * (R - rowsum(A * R)) / s. Parameters are frozen and the backward
    pass goes to the input embeddings only, the same floor as reversed_attention (the official
    code also computes parameter gradients, which costs more): the favourable case for it.
    """

    def __init__(self, hf: Any, scales: list[float]):
        self.hf = hf
        cfg = hf.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.d_model = cfg.hidden_size
        self.d_head = getattr(cfg, "head_dim", None) or self.d_model // self.n_heads
        self.scales = scales
        if hasattr(hf, "transformer") and hasattr(hf.transformer, "h"):  # GPT-2
            attns = [block.attn for block in hf.transformer.h]
            self.v_modules = [a.c_attn for a in attns]
            self.o_modules = [a.c_proj for a in attns]
            self.v_slice = slice(2 * self.d_model, 3 * self.d_model)
            self.embed = hf.transformer.wte
        elif hasattr(hf, "model") and hasattr(hf.model, "layers"):  # Llama family
            attns = [layer.self_attn for layer in hf.model.layers]
            self.v_modules = [a.v_proj for a in attns]
            self.o_modules = [a.o_proj for a in attns]
            self.v_slice = slice(None)
            self.embed = hf.model.embed_tokens
        else:
            raise TypeError(f"official-style loop: unsupported architecture {type(hf).__name__}")
        self.n_layers = len(self.o_modules)

    def floor(
        self, tokens: Int[Tensor, "batch pos"], targets: Int[Tensor, " batch"], per_prompt: bool
    ) -> Float[Tensor, "batch pos d_model"]:
        """Plain HF forward+backward to the input embeddings, no RA, batched or per prompt.

        Splits the comparison: official_loop - hf_floor_per_prompt is the per-head Python loop's
        own cost, hf_floor_per_prompt / hf_floor what batching buys, floor / hf_floor what the
        bridge costs over plain HuggingFace."""
        chunks = [slice(b, b + 1) for b in range(tokens.shape[0])] if per_prompt else [slice(None)]
        grads = []
        for rows in chunks:
            embeds = self.embed(tokens[rows]).detach().requires_grad_(True)
            with torch.enable_grad():
                logits = self.hf(inputs_embeds=embeds, use_cache=False).logits
                loss = target_nll(targets[rows])(logits).sum()
                grads.append(torch.autograd.grad(loss, [embeds])[0])
        return torch.cat(grads)

    def __call__(
        self, tokens: Int[Tensor, "batch pos"], targets: Int[Tensor, " batch"]
    ) -> tuple[Float[Tensor, "batch layer head query key"], Float[Tensor, "batch layer head"]]:
        """(maps, Frobenius norms) of -log p(target) at the last position, prompt by prompt."""
        batch, n = tokens.shape
        maps = torch.zeros(batch, self.n_layers, self.n_heads, n, n, device=tokens.device)
        norms = torch.zeros(batch, self.n_layers, self.n_heads)
        values: dict[int, Tensor] = {}
        grads: dict[int, Tensor] = {}

        def save_v(layer: int):
            def hook(module: Any, inputs: Any, output: Tensor) -> None:
                values[layer] = output.detach()[..., self.v_slice]

            return hook

        def save_g(layer: int):
            def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
                grads[layer] = grad_input[0].detach()

            return hook

        handles = [m.register_forward_hook(save_v(la)) for la, m in enumerate(self.v_modules)]
        handles += [
            m.register_full_backward_hook(save_g(la)) for la, m in enumerate(self.o_modules)
        ]
        group = self.n_heads // self.n_kv
        d = self.d_head
        try:
            for b in range(batch):  # one prompt at a time, as the official code
                embeds = self.embed(tokens[b : b + 1]).detach().requires_grad_(True)
                with torch.enable_grad():
                    out = self.hf(inputs_embeds=embeds, output_attentions=True, use_cache=False)
                    loss = -out.logits[0, -1].float().log_softmax(-1)[targets[b]]
                    torch.autograd.grad(loss, [embeds])
                for la in range(self.n_layers):
                    attn = out.attentions[la][0].detach()  # [head, q, k]
                    v = values[la][0].view(n, self.n_kv, d)
                    g = grads[la][0]  # [pos, head * d]
                    for h in range(self.n_heads):
                        a = attn[h]
                        r = g[:, h * d : (h + 1) * d] @ v[:, h // group].T
                        ar = a * r
                        ra_map = (ar - a * ar.sum(-1, keepdim=True)) / self.scales[la]
                        maps[b, la, h] = ra_map
                        norms[b, la, h] = ra_map.norm().cpu()
                values.clear()
                grads.clear()
        finally:
            for handle in handles:
                handle.remove()
        return maps, norms
