"""EAP-IG's "EAP-IG-activations" (`attribute(method="eap-ig-act")`): integrated gradients along
each node's activations, one node at a time.

For one batch, with `base` the run whose side the gradient is taken on and `other` the other run
(direction "noise": base = clean, as EAP-IG's `get_scores_ig_activations` does):

1. both runs are recorded once; every writer's difference other - base (as the residual stream
   receives it, `EdgeRun.residual_effects`) is fixed for the whole batch, as EAP-IG's
   `activation_difference`;
2. for each node of EAP-IG's list - the embeddings, then per layer its attention (all heads at
   once) and its MLP - and each k = 1..steps, the base run is repeated with only that node's
   output replaced by other + (k / steps) (base - other), a constant (so, as in EAP-IG, no
   gradient flows through that node, even at k = steps where the value is the base run's own),
   and the gradient is taken at every reader's input;
3. score[w, r] = diff_w . (the sum of those gradients at r) / (n_nodes * steps), EAP-IG's
   division by `total_steps`.

Where EAP-IG replaces `hook_embed` (the token embeddings) this replaces the first block's
residual input: the positional embedding is the same in both runs, so the two interpolations are
the same tensor. Where EAP-IG replaces `attn.hook_result` (each head's z_h W_O[h]) this replaces
`attn.hook_z`: W_O is linear and b_O the same in both runs, so the layer writes the same. MLPs are
replaced at `hook_mlp_out` as in EAP-IG.

One property of EAP-IG's code is kept on purpose, so that the numbers are the ones MIB published:
its gradients come from backward hooks, which fire only where the reader's input requires grad.
When the embeddings are held, a model whose positional embedding is not a learned parameter
(rotary, ALiBi: every model MIB uses but GPT-2) has nothing that requires grad between them and
the first layer's readers (its q/k/v inputs, and a parallel block's MLP input), so EAP-IG adds no
gradient there in the embeddings' passes, while a learned W_pos (GPT-2) gives them one. ra-lens
drops the same gradients (`_drop_embedding_readers`). Attention-only models have no MLP nodes (EAP-IG's list
would ask for them and fail). The scores are linear in the gradients, so the gradients (and on
grouped-query models each query head's key/value copies) are summed over the n_nodes * steps
passes first and multiplied by the differences once: the same numbers as EAP-IG's per-pass
products, at one product's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import HookedModel
from ra_lens.circuits import _edges
from ra_lens.circuits.graph import Graph
from ra_lens.contract import ModelShape
from ra_lens.weights import LayerWeights

MLP_OUT = _edges.MLP_OUT
#: A node of EAP-IG's list: ("input", 0), ("attn", layer) or ("mlp", layer).
Node = tuple[str, int]


@runtime_checkable
class GradientStep(Protocol):
    """What `attribute`'s one pass at one point gives (attribute._Step)."""

    grads: list[Tensor]
    firsts: list[int]
    kv_copies: dict[int, tuple[Tensor | None, Tensor]]

    def scores(self, diffs: Tensor, real: Tensor) -> tuple[Tensor, Tensor | None]: ...


#: (input_value or None, extra forward hooks) -> the pass with those replacements.
MakeStep = Callable[[Tensor | None, list[tuple[str, Any]]], GradientStep]


def nodes(graph: Graph, attn_only: bool) -> list[Node]:
    """EAP-IG's node list for EAP-IG-activations: input, then a{l} and m{l} for each layer."""
    out: list[Node] = [("input", 0)]
    for layer in range(graph.n_layers):
        out.append(("attn", layer))
        if not attn_only:
            out.append(("mlp", layer))
    return out


def _record(
    model: HookedModel, graph: Graph, weights: list[LayerWeights], tokens: Tensor
) -> tuple[_edges.EdgeRun, dict[str, Tensor]]:
    """One plain run (no gradient): its EdgeRun (writer outputs, post-norm inputs) and every
    layer's hook_z."""
    layers = range(graph.n_layers)
    run = _edges.EdgeRun(graph, weights)
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=run.hooks(model)),
        capture.recorded(model, [capture.Z.format(la) for la in layers]) as acts,
    ):
        model(tokens)
    missing = [la for la in layers if capture.Z.format(la) not in acts]
    if missing:
        raise NotImplementedError(
            f"layers {missing} fire no hook_z, so their attention output cannot be "
            "interpolated; use method='eap-ig'"
        )
    return run, acts


def _replace(value: Tensor) -> Callable[[Tensor, Any], Tensor]:
    def hook(activation: Tensor, hook: Any) -> Tensor:
        return value.to(activation.device, activation.dtype)

    return hook


def batch_scores(
    model: HookedModel,
    graph: Graph,
    shape: ModelShape,
    weights: list[LayerWeights],
    base_tokens: Tensor,
    other_tokens: Tensor,
    make_step: MakeStep,
    steps: int,
    real: Tensor,
    on_pass: Callable[[], None] = lambda: None,
) -> tuple[Float[Tensor, "writer reader"], Float[Tensor, "writer layer kv head"] | None]:
    """Edge scores of one batch summed over its pairs (module docstring), and on grouped-query
    models each query head's key/value copies (None otherwise). `real`: Bool[Tensor, "batch
    pos"], the positions that are not padding; `on_pass` runs after each of the
    n_nodes * steps passes (progress)."""
    base_run, base_z = _record(model, graph, weights, base_tokens)
    other_run, other_z = _record(model, graph, weights, other_tokens)
    base_out, other_out = base_run.outputs(), other_run.outputs()
    diffs = base_run.residual_effects(other_out - base_out)
    attn_only = not weights[0].layout.has_mlp
    # EAP-IG's backward hooks see the embeddings' direct readers only through a learned W_pos
    learned_positions = shape.positions == "standard"
    parallel = shape.parallel_attn_mlp
    grads: list[Tensor] = []
    copies: dict[int, tuple[Tensor | None, Tensor]] = {}
    step: GradientStep | None = None
    count = 0
    for kind, layer in nodes(graph, attn_only):
        if kind == "input":
            start, end = other_out[0], base_out[0]
        elif kind == "attn":
            name = capture.Z.format(layer)
            start, end = other_z[name], base_z[name]
        else:
            first = graph.writer_index[f"m{layer}"]
            start, end = other_out[first], base_out[first]
        for k in range(1, steps + 1):
            value = start + (k / steps) * (end - start)
            if kind == "input":
                step = make_step(value, [])
                if not learned_positions:
                    _drop_embedding_readers(step, graph, parallel)
            else:
                point = capture.Z.format(layer) if kind == "attn" else MLP_OUT.format(layer)
                step = make_step(None, [(point, _replace(value))])
            grads = [g.clone() for g in step.grads] if not grads else _add(grads, step.grads)
            for la, (key, val) in step.kv_copies.items():
                key_sum, val_sum = copies.get(la, (None, torch.zeros_like(val)))
                key_sum = None if key is None else (key if key_sum is None else key_sum + key)
                copies[la] = (key_sum, val_sum + val)
            count += 1
            on_pass()
    assert step is not None
    # The last pass scores the summed gradients: its own are no longer needed.
    step.grads = [g / count for g in grads]
    step.kv_copies = {
        la: (None if key is None else key / count, val / count) for la, (key, val) in copies.items()
    }
    return step.scores(diffs, real)


def _drop_embedding_readers(step: GradientStep, graph: Graph, parallel: bool) -> None:
    """Zero the gradients (and key/value copies) of the readers that read the embeddings
    directly: layer 0's q/k/v inputs, and its MLP input in a parallel block (module docstring)."""
    per_layer = graph.n_heads + 2 * graph.n_kv_heads + 1
    direct = {0} | ({per_layer - 1} if parallel else set())
    step.grads = [
        torch.zeros_like(g) if first in direct else g
        for first, g in zip(step.firsts, step.grads, strict=True)
    ]
    if 0 in step.kv_copies:
        k, v = step.kv_copies[0]
        step.kv_copies[0] = (None if k is None else torch.zeros_like(k), torch.zeros_like(v))


def _add(total: list[Tensor], new: list[Tensor]) -> list[Tensor]:
    """Element-wise total + new."""
    return [t + n for t, n in zip(total, new, strict=True)]
