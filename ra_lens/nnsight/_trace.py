"""The nnsight trace that computes Reversed Attention: one forward and one backward pass.

SERVER-SAFE: this module imports only torch and the standard library, never ra_lens, so its
function can be shipped by value to a server that has nnsight and torch but not ra-lens (NDIF),
and local and remote runs share one code path. The softmax VJP below is the formula of
`ra_lens.math.convert`; the tests check the two against each other and against HuggingFace's own
attention internals.
"""

from __future__ import annotations

from typing import Any, cast

import torch


def ra_in_trace(
    model: Any,
    tokens: torch.Tensor,
    attention_paths: list[str],
    metric: Any,
    *,
    keep: str,
    convention: str,
    scales: list[float],
    softcaps: list[float | None],
    score_paths: list[str | None],
    embed_path: str,
    rows_at: torch.Tensor | None,
    lengths: torch.Tensor | None,
    real: torch.Tensor | None,
    trace_kwargs: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Run `model.trace(tokens)` once and return RA reduced on the spot, as saved tensors.

    Args:
        model: an nnsight model (e.g. `nnsight.TransformersModel`) wrapping a HuggingFace causal
            LM with eager attention; its attention modules return (output, weights).
        tokens: Int[Tensor, "batch pos"], right-padded ids (no attention mask: causal attention
            keeps real positions blind to right padding).
        attention_paths: per chosen layer, the dotted path of its attention module from the
            model's root, e.g. "model.layers.3.self_attn" (digits index module lists). Its
            `.output[1]` is the softmax output A, Float[Tensor, "batch head query key"].
        metric: logits Float[Tensor, "batch pos vocab"] -> Float[Tensor, "batch"] or a scalar;
            called as metric(logits, lengths=lengths) when `lengths` is given, else metric(logits).
        keep: "maps" (maps and patterns), "norms" (per-head norms only) or "rows" (norms and the
            row of each prompt at `rows_at`).
        convention: "qk" (dL/d(QK^T)), "scores" (dL/d softmax input) or "pattern" (dL/dA,
            masked to the causal triangle).
        scales: per chosen layer, the attention scale s (S = QK^T / s).
        softcaps: per chosen layer, the attention soft-cap c, or None.
        score_paths: per chosen layer, the path (from the attention module) of the softmax call,
            whose input is the capped scores; needed only where a soft-cap meets convention "qk".
        embed_path: dotted path of the input embedding module; its output is made to require
            grad, so the backward pass reaches the attention even with frozen parameters.
        rows_at: Int[Tensor, "batch"], each prompt's row position (keep="rows").
        lengths: Int[Tensor, "batch"] for the metric, or None to call metric(logits).
        real: Bool[Tensor, "batch pos"], real (non-pad) positions, or None without padding.
        trace_kwargs: extra keyword arguments for `model.trace` (e.g. remote=True).

    Returns:
        {"values": metric values, "norms"/"pattern_norms": Float[Tensor, "batch layer head"]},
        plus "rows" Float[Tensor, "batch layer head key"] (keep="rows") or "maps"/"patterns"
        Float[Tensor, "batch layer head query key"] (keep="maps"); computed in float32 (float64
        for a float64 model), on the model's device.
    """
    # The results are plain names saved inside the block, not entries of a dict: a remote
    # server returns the block's saved top-level names (and nnsight pushes them back into this
    # frame), while a dict filled on the server would stay there.
    values: Any = None
    norms: Any = None
    pattern_norms: Any = None
    rows: Any = None
    maps: Any = None
    patterns: Any = None
    n = len(attention_paths)
    with model.trace(tokens, **(trace_kwargs or {})):
        embedded = _resolve(model, embed_path).output
        # Parameters may be frozen (and are on NDIF, where an untracked gradient is silently
        # None, nnsight #251): the embedding output requiring grad makes backward reach the
        # attention of every layer.
        if not embedded.requires_grad:
            embedded.requires_grad_(True)
        weights, scores = [], []
        for i, path in enumerate(attention_paths):
            attn = _resolve(model, path)
            needs_scores = softcaps[i] is not None and convention == "qk"
            # a soft-capped layer has a score path (the cast only tells the type checker)
            scores.append(_resolve(attn, cast(str, score_paths[i])).input if needs_scores else None)
            weights.append(attn.output[1])
        logits = model.output.logits
        value = metric(logits) if lengths is None else metric(logits, lengths=lengths)
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            raise ValueError(
                "the metric's value has no gradient path to the model: compute it from the "
                "logits without .detach(), .item() or torch.no_grad()"
            )
        grads: list[Any] = [None] * n
        with value.sum().backward():
            # nnsight serves gradients in backward order: last layer first.
            for i in reversed(range(n)):
                grads[i] = weights[i].grad
        reduced = [
            _reduce(weights[i], grads[i], scores[i], convention, scales[i], softcaps[i], real)
            for i in range(n)
        ]
        # Inside the trace these are nnsight proxies, which have .save() (a Tensor has not)
        values = value.detach().save()  # type: ignore[attr-defined]
        norms = torch.stack([r[0] for r in reduced], 1).save()  # type: ignore[attr-defined]
        pattern_norms = torch.stack([r[1] for r in reduced], 1).save()  # type: ignore[attr-defined]
        if keep == "rows":
            prompts = torch.arange(tokens.shape[0], device=reduced[0][2].device)
            at = cast(torch.Tensor, rows_at).to(prompts.device)  # given with keep="rows"
            rows = torch.stack([r[2][prompts, :, at] for r in reduced], 1).save()  # type: ignore[attr-defined]
        if keep == "maps":
            maps = torch.stack([r[2] for r in reduced], 1).save()  # type: ignore[attr-defined]
            patterns = torch.stack([r[3] for r in reduced], 1).save()  # type: ignore[attr-defined]
    found = {"values": values, "norms": norms, "pattern_norms": pattern_norms}
    found.update(rows=rows, maps=maps, patterns=patterns)
    return {k: v for k, v in found.items() if v is not None}


def _reduce(
    weights: torch.Tensor,
    grad: torch.Tensor | None,
    scores: torch.Tensor | None,
    convention: str,
    scale: float,
    softcap: float | None,
    real: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norms [batch head], pattern norms [batch head], map, pattern) of one layer."""
    a = _upcast(weights.detach())
    # No gradient reached this layer's weights (the metric does not read past them): RA is 0.
    r = torch.zeros_like(a) if grad is None else _upcast(grad)
    if convention == "pattern":
        q, k = a.shape[-2], a.shape[-1]
        causal = torch.ones(q, k, dtype=torch.bool, device=a.device).tril(k - q)
        maps = r.masked_fill(~causal, 0.0)
    else:
        maps = a * r
        maps = maps - a * maps.sum(-1, keepdim=True)  # softmax VJP: A * (R - rowsum(A * R))
        if convention == "qk":
            if softcap is not None:
                # the scores are read wherever a soft-cap meets convention "qk"
                ratio = (
                    _upcast(cast(torch.Tensor, scores).detach()).clamp(-softcap, softcap) / softcap
                )
                maps = maps * (1.0 - ratio * ratio)
            maps = maps / scale
    if real is not None:
        real = real.to(a.device)
        both = real[:, None, :, None] & real[:, None, None, :]
        maps, a = maps * both, a * both
    norms = torch.linalg.vector_norm(maps, dim=(-2, -1))
    return norms, torch.linalg.vector_norm(a, dim=(-2, -1)), maps, a


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _resolve(root: Any, path: str) -> Any:
    """root.a.b.3.c: attributes, digits indexing module lists."""
    node = root
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node
