"""`attention_attribution`: one forward and backward pass on the run that gets patched, one
forward pass on the other run (and, for "exact-ig", one pass per point of the path), then every
head's query, key and pattern estimate, layer by layer (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import einops
import torch
from torch import Tensor

from ra_lens import attention, capture, contract, pairs
from ra_lens._typing import Validated
from ra_lens.attribution.result import AttentionAttribution
from ra_lens.attribution.softmax import (
    DIRECTIONS,
    METHODS,
    NODES,
    Direction,
    Method,
    key_terms,
)
from ra_lens.capture import PATTERN, RESID_PRE, Batch, HookedModel
from ra_lens.checks import check_count
from ra_lens.core import metric_loss
from ra_lens.types import Hook, MetricFn, Tokens


@dataclass
class _Run:
    """What one forward (and backward) pass captured, per chosen layer."""

    patterns: dict[int, Tensor]
    queries: dict[int, Tensor]
    keys: dict[int, Tensor]
    grads: dict[int, Tensor]
    metric: Tensor
    embed: Tensor | None = None  # what entered the first block (exact-ig interpolates it)


def attention_attribution(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    layers: Validated[Sequence[int]] | None = None,
    nodes: Sequence[str] = NODES,
    method: Validated[Method] = "exact",
    direction: Validated[Direction] = "denoise",
    steps: int = 5,
) -> AttentionAttribution:
    """Attribution of every head's query, key and pattern, with an exact softmax.

    Args:
        model: a TransformerLens model whose `hook_pattern` is in the autograd graph
            (TransformerBridge on GPT-2/Llama-style adapters, TL-native bridges, HookedTransformer).
        clean, corrupted: Int[Tensor, "batch pos"], Batch, a string or strings; pair i must have
            the same token length in both (position-by-position patching).
        metric: logits Float[Tensor, "batch pos vocab"] -> Float[Tensor, "batch"], as in
            `reversed_attention` (e.g. `metrics.logit_diff(correct, incorrect)`).
        layers: layers to attribute (default all).
        nodes: any of "pattern", "query", "key".
        method: "exact" (the real softmax of the changed rows, AtP*'s fix), "exact-ig" (the same
            averaged along the path between the two runs' embeddings, module docstring) or
            "linear" (first order through the softmax, what linear attribution tools compute).
            Pattern nodes are the same for "exact" and "linear".
        direction: "denoise" (gradient on the corrupted run, node moved corrupted -> clean, as in
            TransformerLens 4) or "noise" (gradient on the clean run, node moved clean ->
            corrupted, as in AtP*).
        steps: points on the path ("exact-ig" only; one forward and backward pass each).

    Returns:
        AttentionAttribution: `.scores[kind]` Float[Tensor, "layer head"] (key: "layer
        kv_head"), `.by_position[kind]` [batch layer head pos], `.edges` [batch layer head query
        key], `.top_heads(k, node)`, `.to_transformer_lens()`, `.to_dict()`, `.save(path)`.

    Raises:
        ValueError: unknown node/method/direction, pairs of unequal token length, attention that
            the recomputed softmax(c tanh(q k^T / (s c)) + ALiBi + causal or window mask) does
            not reproduce (`capture.AttentionFacts`).
        RuntimeError: `hook_pattern` outside the autograd graph (no R; e.g. OPT on TL 4).

    method="linear" is dM/dq . (q_clean - q) on the corrupted run, here checked with autograd
    (`model`: a tiny random GPT-2-style model, `ra_lens.toy_models.tiny_model`):

    >>> from ra_lens.metrics import logit_diff
    >>> clean = model.to_tokens("The capital of France is")
    >>> corrupted = model.to_tokens("The capital of Italy is")
    >>> metric, name, kept = logit_diff([294], [52]), capture.Q.format(1), {}
    >>> att = attention_attribution(model, clean, corrupted, metric, method="linear")
    >>> with model.hooks(fwd_hooks=[(name, lambda q, hook: kept.setdefault(name, q))]):
    ...     (grad,) = torch.autograd.grad(metric(model(corrupted)).sum(), kept[name])
    >>> with capture.recorded(model, [name]) as clean_run:
    ...     _ = model(clean)
    >>> expected = (grad * (clean_run[name] - kept[name])).sum(-1)  # [batch pos head]
    >>> torch.allclose(att.by_position["query"][:, 1], expected.transpose(1, 2), atol=1e-6)
    True
    """
    nodes = _check_choices(nodes, method, direction)
    check_count(steps, "steps")
    n_steps = steps if method == "exact-ig" else 1
    facts = contract.model_facts(model)  # read once, handed to every layer and IG step
    shape = facts.shape
    contract.refuse_ungrouped_kv(facts, "attention_attribution scores keys")
    chosen = capture.check_layers(layers, shape.n_layers)
    clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
    capture.require_live_patterns(model, chosen, "attention_attribution needs R = dM/dA there")
    base, other = (corrupted_b, clean_b) if direction == "denoise" else (clean_b, corrupted_b)
    with capture.preserved_state(model):
        patched = _capture(model, base, chosen, metric, backward=True)
        source = _capture(model, other, chosen, metric, backward=False)
        assert patched.embed is not None and source.embed is not None
        points = [
            _capture(
                model, base, chosen, metric, backward=True,
                embed=source.embed + (k / n_steps) * (patched.embed - source.embed),
            )
            for k in range(1, n_steps)
        ]  # fmt: skip

    def estimates(layer: int, at: _Run | None = None) -> dict[str, Tensor]:
        return _layer_estimates(
            patched, source, layer, facts.attention[layer], base.lengths, nodes,
            "exact" if method == "exact-ig" else method, at=at,
        )  # fmt: skip

    per_layer = [estimates(layer) for layer in chosen]
    if points:  # exact-ig: the estimates averaged over the path (the patched run is its end)
        averaged = [kind for kind in (*nodes, "key_by_head", "edges") if kind in per_layer[0]]
        for out, layer in zip(per_layer, chosen, strict=True):
            for point in points:
                at_point = estimates(layer, at=point)
                for kind in averaged:
                    out[kind] = out[kind] + at_point[kind]
            for kind in averaged:
                out[kind] = out[kind] / n_steps

    def stack(key: str, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.stack([out[key] for out in per_layer], dim=1).to("cpu", dtype)

    by_position = {kind: stack(kind) for kind in nodes}
    scores = {kind: values.double().sum(-1).mean(0).float() for kind, values in by_position.items()}
    return AttentionAttribution(
        by_position=by_position,
        scores=scores,
        key_by_head=stack("key_by_head") if "key" in nodes else None,
        edges=stack("edges"),
        patterns=stack("pattern_a"),
        other_patterns=stack("other_pattern_a"),
        pattern_grads=stack("grad"),
        clean_metric=(source if direction == "denoise" else patched).metric.float().cpu(),
        corrupted_metric=(patched if direction == "denoise" else source).metric.float().cpu(),
        layers=chosen,
        method=method,
        direction=direction,
        n_heads=shape.n_heads,
        n_kv_heads=int(patched.keys[chosen[0]].shape[2]),
        tokens=base.tokens.cpu(),
        other_tokens=other.tokens.cpu(),
        lengths=base.lengths.cpu(),
        str_tokens=capture.str_tokens(model, base),
        _logits=stack("logits", torch.float64),
        _query_logits=stack("query_logits", torch.float64),
        _key_logit_change=stack("key_logit_change", torch.float64),
    )


def _check_choices(nodes: Sequence[str], method: str, direction: str) -> list[str]:
    if isinstance(nodes, str):
        nodes = [nodes]
    unknown = [n for n in nodes if n not in NODES]
    if unknown or not nodes:
        raise ValueError(f"unknown nodes {list(nodes)}: choose among {NODES}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {METHODS}")
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}: choose one of {DIRECTIONS}")
    return [n for n in NODES if n in nodes]


def _capture(
    model: HookedModel,
    batch: Batch,
    layers: list[int],
    metric: MetricFn,
    backward: bool,
    embed: Tensor | None = None,
) -> _Run:
    """Forward pass saving A, q and k of every chosen layer and what entered the first block;
    with backward, R = dM/dA too. `embed` replaces what enters the first block (a point of the
    exact-ig path)."""
    patterns = [PATTERN.format(layer) for layer in layers]
    queries = [capture.query_hook_name(model, layer) for layer in layers]
    keys = [capture.key_hook_name(model, layer) for layer in layers]
    leaf: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    # R is read on the raw input of hook_pattern: a tensor hook on this forward's own tensor,
    # so it still fires after the module hooks are gone.
    keep_grad: dict[str, Callable[[Tensor], None]] = (
        {name: partial(_keep, grads, name) for name in patterns} if backward else {}
    )
    entered: dict[str, Tensor] = {}

    def first_block(value: Tensor, hook: Any) -> Tensor:
        if embed is not None:
            value = embed.to(value.device, value.dtype)
        entered["embed"] = value.detach()
        return value

    # In this order: the input is replaced before the gradient leaf is taken (layers[0] == 0).
    hooks: list[Hook] = [(RESID_PRE.format(0), first_block)]
    hooks.append((RESID_PRE.format(layers[0]), capture.gradient_leaf_hook(leaf)))
    with torch.enable_grad():
        with (
            model.hooks(fwd_hooks=hooks),
            capture.recorded(
                model, patterns + queries + keys + attention.rotation_hooks(layers)
            ) as acts,
            capture.raw_input_hooks(model, {}, keep_grad),
        ):
            logits = model(batch.tokens)
        # The hooks are off before the metric runs: a metric may run the model itself (e.g.
        # reference logits under no_grad), and that forward must not replace the gradient leaf.
        values, loss = metric_loss(metric, logits, batch)
        if backward:
            torch.autograd.grad(loss, [leaf["leaf"]], allow_unused=True)
    attention.fill_rotated(model, acts, layers)
    attention.require_fired(
        [name for pair in zip(queries, keys) for name in pair], acts, "the softmax cannot be redone"
    )
    missing = [layer for layer, name in zip(layers, patterns) if backward and name not in grads]
    if missing:
        raise RuntimeError(
            f"no gradient reached hook_pattern of layers {missing}: the metric must depend on "
            "the logits at positions these layers feed"
        )

    def by_layer(names: list[str], store: dict[str, Tensor]) -> dict[int, Tensor]:
        return {layer: store[name] for layer, name in zip(layers, names) if name in store}

    return _Run(
        by_layer(patterns, acts),
        by_layer(queries, acts),
        by_layer(keys, acts),
        by_layer(patterns, grads),
        values.detach(),
        entered.get("embed"),
    )


def _keep(store: dict[str, Tensor], name: str, grad: Tensor) -> None:
    store[name] = grad.detach()


def _layer_estimates(
    patched: _Run,
    source: _Run,
    layer: int,
    facts: capture.AttentionFacts,
    lengths: Tensor,
    nodes: list[str],
    method: str,
    at: _Run | None = None,
) -> dict[str, Tensor]:
    """Every estimate of one layer, in float64 on the model's device. With `at` (a point of the
    exact-ig path), the node moves by the same difference (other - patched) from that run's q, k
    and A, weighted by its R."""
    run = patched if at is None else at
    q, k = run.queries[layer].double(), run.keys[layer].double()
    q_other, k_other = source.queries[layer].double(), source.keys[layer].double()
    if at is not None:
        q_other = q + (q_other - patched.queries[layer].double())
        k_other = k + (k_other - patched.keys[layer].double())
    group = q.shape[2] // k.shape[2]

    def per_head(keys: Tensor) -> Tensor:
        return attention.per_query_head(keys, group)

    n_pos = q.shape[1]
    causal = facts.mask(n_pos, q.device)

    def logits_of(queries: Tensor, keys: Tensor) -> Tensor:
        return attention.attention_logits(queries, keys, facts)

    logits = logits_of(q, k)
    log_pattern = logits.log_softmax(dim=-1)
    pattern = run.patterns[layer].double()
    real = torch.arange(n_pos, device=q.device)[None, :] < lengths.to(q.device)[:, None]
    rows = real[:, None, :, None]
    attention.check_recomputed(
        layer,
        log_pattern.exp(),
        run.patterns[layer],
        rows,
        facts,
        "attention_attribution models scale, soft-cap, causal mask and sliding window",
    )
    grad = run.grads[layer].double().masked_fill(~causal, 0.0) * rows
    other_pattern = source.patterns[layer].double()
    edges = grad * (other_pattern - patched.patterns[layer].double())  # the same A' - A on the path
    out: dict[str, Tensor] = {
        "edges": edges,
        "pattern_a": pattern,
        "other_pattern_a": other_pattern,
        "grad": grad,
        "logits": logits,
    }
    if "pattern" in nodes:
        out["pattern"] = edges.sum(-1)

    query_logits = logits_of(q_other, k)
    out["query_logits"] = query_logits
    if "query" in nodes:
        if method == "exact":
            change = query_logits.softmax(dim=-1) - log_pattern.exp()
            out["query"] = (change * grad).sum(-1)
        else:
            a = log_pattern.exp()
            scores_grad = a * (grad - (a * grad).sum(-1, keepdim=True))
            query_change = (query_logits - logits).masked_fill(~causal, 0.0)
            out["query"] = (scores_grad * query_change).sum(-1)
        out["query"] = out["query"] * real[:, None, :]

    delta = (logits_of(q, k_other) - logits).masked_fill(~causal, 0.0)
    out["key_logit_change"] = delta
    if "key" in nodes:
        terms = key_terms(log_pattern, grad, delta, method)  # type: ignore[arg-type]
        by_head = terms.sum(-2) * real[:, None, :]
        out["key_by_head"] = by_head
        out["key"] = einops.reduce(by_head, "b (g r) pos -> b g pos", "sum", r=group)
    # Pattern-shaped tensors go to [batch, head, ...]; estimates are [batch, head, pos].
    return out
