"""One forward pass in which every reader of the residual stream reads its own input.

The machinery behind `faithfulness` (edge patching) and `attribute` (gradients at each reader's
input). Writers' outputs are read where TransformerLens exposes them: `input` at
`blocks.0.hook_resid_pre`, a head's output as z_h @ W_O[h] from `hook_z`, an MLP's at
`hook_mlp_out`. Readers get their input rewritten without touching the residual stream itself:

- a query head's (key/value head's) input: its q (k, v) is recomputed from ln1(resid - delta_r)
  with the layer's own norm and weights and put in at `hook_q` (`hook_k`, `hook_v`), before any
  rotary embedding, so the model rotates and attends as usual;
- an MLP's input: `blocks.{l}.ln2.hook_in` on TransformerBridge (it feeds ln2 only), or
  `blocks.{l}.hook_mlp_in` on HookedTransformer (`ModelFacts.mlp_in`; switched on by
  `state.enable_mlp_in` and back by `capture.preserved_state`);
- the logits' input: the last block's `hook_resid_post` (it feeds ln_final only).

Post-norm blocks (Gemma-2, Gemma-3, OLMo-2) add N(a) to the residual, a = sum_h o_h the heads'
outputs and N the norm after the attention. A head's writer output there is o_h itself (before
the norm), and a reader sees the block's contribution through the real norm: with S the sum of
the differences of the heads patched for that reader, it reads N(a - S) where the model wrote
N(a). Patching any set of a head's edges is therefore exactly patching that head for those
readers (one head, several, or all). Edge scores use each head's exact effect on the residual,
N(a + d_h) - N(a), where d_h is the head's change (`residual_effects`). The MLP writes N2(m),
one writer.

delta_r = sum over the writers w in `mask[:, r]` of (w's output in this run - `reference[w]`)
(edge patching), plus `leaf[r]` (a zero tensor whose gradient is dM/d input_r) when gradients are
wanted. Readers with nothing to change keep the model's own value bit for bit.

Per-copy patching (`copy_mask` [writer, ureader], EAP-IG's ungrouped readers): on a grouped-query
model query head h then reads its own key and value, computed from its own patched input (its
copy's delta) through ln1, W_K/W_V and whatever the model does after hook_k/hook_v (rotary, q/k
norms), as on EAP-IG's ungrouped model. The model's attention shares a key/value head among its
group, so the batch runs in `group` slots (`expand`): in slot j every key/value head g holds the
copy of query head g * group + j, and at hook_z each head's z is taken from its own slot (head h
from slot h % group) and handed to every slot. Everything else is the same in all slots: the
residual stream is reset to slot 0's at each block, q and the other readers are patched alike,
and writers, metric and logits are read from slot 0 (`first_slot`). It costs `group` times the
forward pass, and is used only for circuits whose copies of some edge differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import no_type_check
from ra_lens.capture import RESID_PRE, HookedModel
from ra_lens.circuits.graph import Graph
from ra_lens.contract import MLP_OUT, RESID_POST
from ra_lens.weights import LayerWeights


# repr=False: TransformerLens formats a hook's repr when adding it, and a repr of the
# tensors held here costs seconds.
@dataclass(repr=False)
class EdgeRun:
    """Hooks for one forward pass of a batch (see the module docstring).

    Args:
        graph: the model's graph.
        weights: `weights.layer_weights` of every layer.
        reference: Float[Tensor, "writer batch pos d_model"] or None: what each writer's output
            is compared with (the corrupted run's, its mean, or zeros).
        mask: Bool[Tensor, "writer reader"]: the edges to patch (graph.real and not in the circuit).
        leaves: add a zero leaf per reader whose gradient is dM/d(its input).
        input_value: replace the embeddings (`input`'s output) with this tensor (the IG path).
        copy_mask: Bool[Tensor, "writer ureader"] or None: per-copy patching (module docstring):
            the edges to patch into each query head's copy of a key/value input (`mask`'s
            key/value columns are then not read); the batch must be `expand`ed.
    """

    graph: Graph
    weights: list[LayerWeights]
    reference: Tensor | None = None
    mask: Tensor | None = None
    leaves: bool = False
    input_value: Tensor | None = None
    chunks: list[Tensor] = field(default_factory=list)
    leaf: dict[int, Tensor] = field(default_factory=dict)
    resid: dict[int, Tensor] = field(default_factory=dict)
    _deltas: dict[int, dict[int, Tensor]] = field(default_factory=dict)
    # Edge patching: every writer's (output - reference) so far, filled in as writers fire, and
    # their running sum (the delta of a reader that keeps no edge).
    _diffs: Tensor | None = None
    _diff_total: Tensor | None = None
    # Post-norm blocks: each layer's sum of head outputs a, the norm's input in this run.
    post_input: dict[int, Tensor] = field(default_factory=dict)
    # leaves=True: each layer's key (value) readers' inputs [kv_head batch pos d_model] and what
    # they project to [batch pos kv_head d_head], in the autograd graph, keyed (layer, "k"/"v"):
    # attribute splits a key/value head's gradient among its query heads from them.
    kv_inputs: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    _post_row_cache: dict[int, slice] | None = None
    copy_mask: Tensor | None = None
    # copy_mask: each layer's deltas of the key/value copies, keyed by ungrouped reader index
    _copy_deltas: dict[int, dict[int, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.copy_mask is not None and (self.leaves or self.input_value is not None):
            raise ValueError("per-copy patching (copy_mask) takes neither leaves nor input_value")

    # ---- slots (per-copy patching)

    @property
    def slots(self) -> int:
        """Copies of the batch in one pass: `group` with per-copy patching, else 1."""
        return self.graph.group if self.copy_mask is not None else 1

    def expand(self, tokens: Tensor) -> Tensor:
        """The batch as the model must run it: `slots` copies, slot-major."""
        return tokens if self.slots == 1 else tokens.repeat(self.slots, *[1] * (tokens.dim() - 1))

    def first_slot(self, value: Tensor) -> Tensor:
        """Slot 0's rows of a batch-first tensor (the logits of the expanded batch)."""
        return value if self.slots == 1 else value[: value.shape[0] // self.slots]

    def _spread(self, value: Tensor) -> Tensor:
        """A slot's batch handed to every slot."""
        return value if self.slots == 1 else value.repeat(self.slots, *[1] * (value.dim() - 1))

    # ---- writers

    def _writer_count(self) -> int:
        return sum(chunk.shape[0] for chunk in self.chunks)

    def _add_writers(self, outputs: Tensor) -> None:
        """outputs: [n_writers_here, batch, pos, d_model] in graph.writers order."""
        if self.reference is not None and self.mask is not None:
            first, reference = self._writer_count(), self.reference
            if self._diffs is None:
                self._diffs = reference.new_empty(reference.shape)
            diffs = outputs.detach().to(reference.device, reference.dtype)
            diffs = diffs - reference[first : first + outputs.shape[0]]
            self._diffs[first : first + outputs.shape[0]] = diffs
            total = diffs.sum(0)
            self._diff_total = total if self._diff_total is None else self._diff_total + total
        self.chunks.append(outputs.detach())

    def outputs(self) -> Float[Tensor, "writer batch pos d_model"]:
        """Every writer's output in this run, detached, on the first layer's device."""
        return torch.cat([c.detach().to(self.chunks[0].device) for c in self.chunks])

    # ---- readers

    def _readers_of(self, layer: int) -> list[int]:
        """Indices of layer's readers (q..., k..., v..., mlp) or of the logits (layer = n_layers)."""
        g = self.graph
        if layer == g.n_layers:
            return [len(g.readers) - 1]
        per_layer = g.n_heads + 2 * g.n_kv_heads + 1
        return list(range(layer * per_layer, (layer + 1) * per_layer))

    def _delta(self, readers: list[int], like: Tensor) -> dict[int, Tensor]:
        """reader index -> delta [batch pos d_model] for the readers that need one."""
        out: dict[int, Tensor] = {}
        n = self._writer_count()
        if self.reference is not None and self.mask is not None:
            cols = self.mask[:n, readers]
            needed = cols.any(0)
            if bool(needed.any()):
                picked = [r for r, need in zip(readers, needed.tolist()) if need]
                real = self.graph.real[:n, picked]
                out = dict(zip(picked, self._patched_sum(cols[:, needed], real).to(like)))
        if self.leaves:
            block = like.new_zeros((len(readers), *like.shape)).requires_grad_(True)
            self.leaf[readers[0]] = block
            for i, r in enumerate(readers):
                out[r] = out[r] - block[i] if r in out else -block[i]
        return out

    def _copy_delta(self, layer: int, like: Tensor) -> dict[int, Tensor]:
        """ungrouped reader index -> delta [batch pos d_model] of this layer's key/value copies
        with a patched edge (`copy_mask`)."""
        assert self.copy_mask is not None
        g, n = self.graph, self._writer_count()
        first = layer * (3 * g.n_heads + 1) + g.n_heads  # the k copies, then the v copies
        copies = list(range(first, first + 2 * g.n_heads))
        cols = self.copy_mask[:n, copies]
        needed = cols.any(0)
        if not bool(needed.any()):
            return {}
        picked = [u for u, need in zip(copies, needed.tolist()) if need]
        real = g.real[:n, g.ungrouped_target[picked]]
        return dict(zip(picked, self._patched_sum(cols[:, needed], real).to(like)))

    def _patched_sum(self, cols: Tensor, real: Tensor) -> Tensor:
        """[readers batch pos d_model]: sum of the diffs of the writers in cols (writers so far x
        readers; `real`: which of those are edges). A small circuit patches almost every edge, so when the circuit's own edges are
        fewer the sum is taken as (all writers' diffs) - (the circuit's): the cost follows the
        smaller side."""
        assert self._diffs is not None and self._diff_total is not None
        post = {la: r for la, r in self._post_rows().items() if r.start < cols.shape[0]}
        if post:
            return self._through_post_norms(cols, post)
        kept = real & ~cols
        if bool(real.all()) and int(kept.sum()) < int(cols.sum()):
            return self._diff_total[None] - self._weighted(kept)
        return self._weighted(cols)

    def _through_post_norms(self, cols: Tensor, post: dict[int, slice]) -> Tensor:
        """[readers batch pos d_model]: sum over writers w of cols[w, r] * diff_w, the heads
        behind a post-norm (`post`: layer -> their writer rows) seen through it: the reader sees
        N(a) - N(a - S), S those heads' weighted sum. cols: Bool (patching) or weights (a
        learned mask's 1 - m, `masks.MaskedRun`)."""
        linear = cols.clone()
        for rows in post.values():
            linear[rows] = 0
        total = self._weighted(linear)
        for layer, rows in post.items():
            norm, a = self.weights[layer].post_attn, self.post_input[layer]
            patched = self._weighted(cols[rows], offset=rows.start).to(a)
            total = total + (norm(a)[None] - norm(a[None] - patched)).to(total)
        return total

    def _weighted(self, select: Tensor, offset: int = 0) -> Tensor:
        """sum over writers w of select[w, r] * diff_(offset + w), reading only the writers in
        use."""
        assert self._diffs is not None
        rows = select.any(1).nonzero().squeeze(1) + offset
        shape = (select.shape[1], *self._diffs.shape[1:])
        if rows.numel() == 0:
            return self._diffs.new_zeros(shape)
        used = self._diffs.index_select(0, rows.to(self._diffs.device)).flatten(1)
        weights = select[rows - offset].T.to(used.device, used.dtype)
        return (weights @ used).view(shape)

    # ---- hooks

    def hooks(self, model: HookedModel) -> list[tuple[str, Any]]:
        g = self.graph
        hooks: list[tuple[str, Any]] = [(RESID_PRE.format(0), self._input_hook)]
        for layer in range(g.n_layers):
            hooks += [
                (RESID_PRE.format(layer), self._resid_hook(layer)),
                (capture.Q.format(layer), self._qkv_hook(layer, "q")),
                (capture.K.format(layer), self._qkv_hook(layer, "k")),
                (capture.V.format(layer), self._qkv_hook(layer, "v")),
                (capture.Z.format(layer), self._z_hook(layer)),
            ]
            if self.weights[layer].post_attn is not None:  # heads write through N(a)
                hooks.append((capture.POST_ATTN_IN.format(layer), self._post_in_hook(layer)))
            layout = self.weights[layer].layout
            if layout.has_mlp:  # attention-only: the m{l} writers output zero (z hook below)
                if layout.mlp_reads_attn_norm:  # give it its own
                    mlp_in = (capture.MLP_IN.format(layer), self._renorm_hook(layer))
                else:
                    mlp_in = (self.weights[layer].mlp_in, self._subtract_hook(layer, "mlp"))
                hooks += [mlp_in, (MLP_OUT.format(layer), self._mlp_out_hook)]
        hooks.append((RESID_POST.format(g.n_layers - 1), self._subtract_hook(g.n_layers, "logits")))
        return hooks

    def _input_hook(self, value: Tensor, hook: Any) -> Tensor:
        if self.input_value is not None:
            value = self.input_value.to(value.device, value.dtype)
        self._add_writers(self.first_slot(value)[None])
        return value

    def _resid_hook(self, layer: int) -> Callable[[Tensor, Any], Tensor | None]:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> Tensor | None:
            base = self.first_slot(value)
            self.resid[layer] = base
            readers = self._readers_of(layer)[:-1]  # the MLP reads after this layer's heads
            if self.copy_mask is None:
                self._deltas[layer] = self._delta(readers, base)
                return None
            # per copy: the key/value readers are patched copy by copy, in their slots
            self._deltas[layer] = self._delta(readers[: self.graph.n_heads], base)
            self._copy_deltas[layer] = self._copy_delta(layer, base)
            return self._spread(base)  # every slot starts the block from slot 0's stream

        return hook

    def _qkv_hook(self, layer: int, kind: str) -> Callable[[Tensor, Any], Tensor]:
        g = self.graph
        n_q, n_kv = g.n_heads, g.n_kv_heads
        first = {"q": 0, "k": n_q, "v": n_q + n_kv}[kind]

        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> Tensor:
            if self.copy_mask is not None:
                return self._slot_qkv(layer, kind, value)
            deltas = self._deltas[layer]
            base = self._readers_of(layer)[0] + first
            heads = [h for h in range(value.shape[2]) if base + h in deltas]
            if not heads:
                return value
            x = self.resid[layer]
            inputs = torch.stack([x - deltas[base + h] for h in heads])  # [h batch pos d]
            new = self._project(layer, kind, heads, inputs, value)
            index = torch.tensor(heads, device=value.device)
            if self.leaves and kind != "q":
                self.kv_inputs[(layer, kind)] = (inputs, new)
            out = value.clone()
            out[:, :, index] = new.to(value.dtype)
            return out

        return hook

    def _project(
        self, layer: int, kind: str, heads: list[int], inputs: Tensor, like: Tensor
    ) -> Tensor:
        """[batch pos len(heads) d_head]: ln1(inputs[i]) @ W[heads[i]] + b[heads[i]] for the
        `kind` ("q", "k", "v") weights; inputs [len(heads) batch pos d_model]."""
        w = self.weights[layer]
        W, b = {"q": (w.W_Q, w.b_Q), "k": (w.W_K, w.b_K), "v": (w.W_V, w.b_V)}[kind]
        normed = w.ln1(inputs)
        index = torch.tensor(heads, device=like.device)
        return torch.einsum("hbpd,hde->bphe", normed, W[index].to(normed.dtype)) + b[index].to(
            normed.dtype
        )

    def _slot_qkv(self, layer: int, kind: str, value: Tensor) -> Tensor:
        """Per-copy patching's hook_q/k/v (module docstring): q patched alike in every slot;
        in slot j, key/value head g holds query head g * group + j's copy."""
        g, x = self.graph, self.resid[layer]
        slots = value.view(self.slots, -1, *value.shape[1:])
        out = slots[:1].expand_as(slots).clone()  # slot 0's values everywhere
        if kind == "q":
            deltas = self._deltas[layer]
            heads = [h for h in range(g.n_heads) if self._readers_of(layer)[0] + h in deltas]
            if heads:
                base = self._readers_of(layer)[0]
                inputs = torch.stack([x - deltas[base + h] for h in heads])
                new = self._project(layer, "q", heads, inputs, value)
                out[:, :, :, heads] = new.to(value.dtype)[None]
            return out.view_as(value)
        deltas = self._copy_deltas[layer]
        first = layer * (3 * g.n_heads + 1) + (g.n_heads if kind == "k" else 2 * g.n_heads)
        found = [(h, first + h) for h in range(g.n_heads) if first + h in deltas]
        if found:
            kv_heads = [h // g.group for h, _ in found]
            inputs = torch.stack([x - deltas[u] for _, u in found])
            new = self._project(layer, kind, kv_heads, inputs, value).to(value.dtype)
            for i, (h, _) in enumerate(found):
                out[h % g.group, :, :, h // g.group] = new[:, :, i]
        return out.view_as(value)

    def _z_hook(self, layer: int) -> Callable[[Tensor, Any], Tensor | None]:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> Tensor | None:
            z = value
            if self.slots > 1:  # each head's z from its own slot (module docstring)
                heads = torch.arange(value.shape[2], device=value.device)
                slots = value.view(self.slots, -1, *value.shape[1:])
                z = slots[heads % self.graph.group, :, :, heads].permute(1, 2, 0, 3)
            W_O = self.weights[layer].W_O.to(value.dtype)
            self._add_writers(torch.einsum("bphe,hed->hbpd", z, W_O))
            if not self.weights[layer].layout.has_mlp:
                self._add_writers(
                    torch.zeros_like(z[None, :, :, 0, :1]).expand(1, -1, -1, W_O.shape[-1])
                )
            return None if self.slots == 1 else self._spread(z.contiguous())

        return hook

    def _post_in_hook(self, layer: int) -> Callable[[Tensor, Any], None]:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> None:
            self.post_input[layer] = self.first_slot(value).detach()

        return hook

    def residual_effects(
        self, diffs: Float[Tensor, "writer batch pos d_model"]
    ) -> Float[Tensor, "writer batch pos d_model"]:
        """Each writer's change as the residual stream receives it: post-norm heads' changes d_h
        become N(a + d_h) - N(a) (a: this run's sum of the layer's heads), others are as given.
        """
        out = diffs.clone()
        for layer, rows in self._post_rows().items():
            norm, a = self.weights[layer].post_attn, self.post_input[layer].to(diffs)
            d = diffs[rows]
            out[rows] = (norm(a[None] + d) - norm(a)[None]).to(diffs)
        return out

    def _post_rows(self) -> dict[int, slice]:
        """Writer rows of the heads of each post-norm layer (found once per run: every reader
        group asks)."""
        if self._post_row_cache is None:
            g, rows = self.graph, {}
            for layer, weights in enumerate(self.weights):
                if weights.post_attn is not None:
                    first = g.writer_index[f"a{layer}.h0"]
                    rows[layer] = slice(first, first + g.n_heads)
            self._post_row_cache = rows
        return self._post_row_cache

    def _mlp_out_hook(self, value: Tensor, hook: Any) -> None:
        self._add_writers(self.first_slot(value)[None])

    def _renorm_hook(self, layer: int) -> Callable[[Tensor, Any], Tensor]:
        """A parallel block whose MLP reads the attention's norm (GPT-J, Phi, Falcon): the MLP's
        input is ln1(resid - delta), recomputed only when its delta is not empty."""

        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> Tensor:
            (reader,) = self._readers_of(layer)[-1:]
            deltas = self._delta([reader], self.first_slot(value))
            if reader not in deltas:
                return value
            new = self.weights[layer].ln1(self.resid[layer] - deltas[reader]).to(value.dtype)
            return self._spread(new)

        return hook

    def _subtract_hook(self, layer: int, kind: str) -> Callable[[Tensor, Any], Tensor]:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> Tensor:
            (reader,) = self._readers_of(layer)[-1:]
            deltas = self._delta([reader], self.first_slot(value))
            return value - self._spread(deltas[reader]) if reader in deltas else value

        return hook

    def leaves_in_order(self) -> list[Tensor]:
        """The leaves (with leaves=True), one [readers batch pos d_model] block per reader
        group, in reader order: their gradients are dM/d(each reader's input)."""
        return [self.leaf[first] for first in sorted(self.leaf)]
