"""Query, key and pattern attribution of every attention head, with an exact softmax.

Attribution patching estimates what patching one node from another run would do to a metric M.
For the attention pattern itself that estimate is sum_s R_ts (A_other - A)_ts with R = dM/dA (the
gradient at `hook_pattern`). For the query and key of a head, tools linear through the softmax
(TransformerLens 4's `attribution_patch`, EAP) multiply R by the *first-order* change of A; on a
saturated (near one-hot) row that change is almost zero even when the real one is large. AtP*
(Kramar et al. 2024) fixes it by recomputing the changed attention rows exactly, then
multiplying by R. This module does that for every head and position at once, from one forward
and backward pass on the run that gets patched plus one forward pass on the other run:

- query node (layer, head h, position t): row t becomes softmax(q'_t K^T / s + mask), with q'_t
  taken from the other run;
- key node (layer, key/value head g, position s): in every query head reading g (GQA: heads
  g*r .. g*r + r - 1, r = n_heads / n_kv_heads), every row t >= s changes in the single logit
  (t, s) by delta = q_t . (k'_s - k_s) / s. Closed form: the new weight on s is
  p' = sigmoid(logit(A_ts) + delta) and the row's estimate is (p' - A_ts) (R_ts - Rbar_t^(-s)),
  Rbar^(-s) the mean of R over the other keys weighted by A (computed in log space, so a
  saturated row and a large delta stay exact);
- pattern node (layer, head h, query row t): sum_s R_ts (A_other - A)_ts; `edges` keeps the
  per-link terms.

`method="linear"` gives the first-order estimate through the softmax instead (what linear tools
compute; it equals dM/dq . (q' - q) and dM/dk . (k' - k)). `method="exact-ig"` averages the exact
estimate over `steps` runs whose embeddings lie on the straight line from the other run's to
the patched run's (point k = other + (k / steps)(patched - other), k = 1..steps, as EAP-IG
"inputs"): at each point the node is moved by the same difference (q' - q, k' - k, A' - A) and
the rows are recomputed with that point's q, k, A and R, so the nonlinearity after the node (the
metric's, later layers') is averaged along the path as integrated gradients do; steps=1 is
"exact". Rotary models use the rotated q and k
(`hook_rot_q`, `hook_rot_k`); the attention scale s is read from the model.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`):

    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"  # 8 tokens each
    >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
    >>> {kind: tuple(scores.shape) for kind, scores in att.scores.items()}  # [layer head]
    {'pattern': (2, 4), 'query': (2, 4), 'key': (2, 4)}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, RESID_PRE, Batch, HookedModel
from ra_lens.core import metric_loss
from ra_lens.result import read_safetensors, write_safetensors
from ra_lens.types import MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NodeKind = Literal["pattern", "query", "key"]
Method = Literal["exact", "exact-ig", "linear"]
Direction = Literal["denoise", "noise"]
NODES: tuple[str, ...] = ("pattern", "query", "key")
METHODS: tuple[str, ...] = ("exact", "exact-ig", "linear")
DIRECTIONS: tuple[str, ...] = ("denoise", "noise")


#: Largest |softmax(q k^T / s + causal mask) - A| accepted before the recomputed attention is
#: declared not to be the model's (soft-capping, ALiBi, sliding windows are not modelled).
#: HF's eager attention takes the softmax in float32 even for a float64 model; half-precision
#: patterns are rounded to ~1e-3.
_RECOMPUTE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}
_HALF_TOLERANCE = 2e-2


# --------------------------------------------------------------------------------------------
# pure tensor functions (float64, any leading axes, last two = query, key)


def log_other_mass(log_pattern: Float[Tensor, "... query key"]) -> Float[Tensor, "... query key"]:
    """log(1 - A_ts) for every entry, exact also where A_ts rounds to 1.

    Only a row's largest entry can exceed 1/2; there 1 - A is the sum of the other entries (taken
    as a logsumexp), elsewhere log1p(-A) is accurate.

    >>> log_pattern = torch.tensor([[40.0, 0.0, 0.0]], dtype=torch.float64).log_softmax(-1)
    >>> float(1 - log_pattern[0, 0].exp()), round(float(log_other_mass(log_pattern)[0, 0]), 4)
    (0.0, -39.3069)
    """
    top = log_pattern.argmax(dim=-1, keepdim=True)
    others = log_pattern.scatter(-1, top, float("-inf")).logsumexp(dim=-1, keepdim=True)
    general = torch.log1p(-log_pattern.exp())
    return general.scatter(-1, top, others)


def key_terms(
    log_pattern: Float[Tensor, "... query key"],
    grad: Float[Tensor, "... query key"],
    delta: Float[Tensor, "... query key"],
    method: Method,
) -> Float[Tensor, "... query key"]:
    """Estimate, per (row t, key s), of raising the one logit (t, s) by delta[t, s].

    exact: sum_s' (A'_ts' - A_ts') R_ts' = (p' - A_ts)(R_ts - Rbar_t^(-s)), p' = sigmoid(logit
    A_ts + delta); linear: its derivative at delta = 0 times delta, A_ts (R_ts - D_t) delta, with
    D_t = sum_s A_ts R_ts. Masked entries (log A = -inf) give 0.

    Against raising logit (2, 1) by 3 and taking the softmax again:

    >>> logits, grad = torch.randn(2, 4, 4, dtype=torch.float64)
    >>> terms = key_terms(logits.log_softmax(-1), grad, torch.full((4, 4), 3.0), "exact")
    >>> raised = logits.clone()
    >>> raised[2, 1] += 3.0
    >>> torch.isclose(terms[2, 1], ((raised.softmax(-1) - logits.softmax(-1)) * grad).sum())
    tensor(True)
    """
    pattern = log_pattern.exp()
    visible = log_pattern > float("-inf")
    weighted = pattern * grad
    row_sum = weighted.sum(dim=-1, keepdim=True)
    if method == "linear":
        return torch.where(visible, weighted - pattern * row_sum, 0.0) * delta
    log_other = log_other_mass(log_pattern)
    new_weight = torch.sigmoid(log_pattern - log_other + delta)
    # sum_{s' != s} A_ts' R_ts': at the row maximum summed directly (no cancellation).
    top = log_pattern.argmax(dim=-1, keepdim=True)
    top_excluded = weighted.scatter(-1, top, 0.0).sum(dim=-1, keepdim=True)
    other_weighted = (row_sum - weighted).scatter(-1, top, top_excluded)
    other_mean = torch.where(
        log_other > float("-inf"), other_weighted / log_other.exp(), torch.zeros_like(grad)
    )
    change = torch.where(visible, new_weight - pattern, 0.0)
    return change * (grad - other_mean)


def key_delta_rows(
    log_pattern: Float[Tensor, "... query key"], delta_column: Float[Tensor, "... query"], key: int
) -> Float[Tensor, "... query key"]:
    """A' - A when logit (t, key) of every row t changes by delta_column[t] (the key node's
    change of the pattern, materialised; the estimate uses the closed form in `key_terms`).

    >>> logits, delta = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    >>> raised = logits.clone()
    >>> raised[:, 1] += delta
    >>> changed = key_delta_rows(logits.log_softmax(-1), delta, key=1)
    >>> torch.allclose(changed, raised.softmax(-1) - logits.softmax(-1))
    True
    """
    log_other = log_other_mass(log_pattern)[..., key]
    logit = log_pattern[..., key] - log_other
    new_weight = torch.sigmoid(logit + delta_column)
    pattern = log_pattern.exp()
    visible = log_pattern[..., key] > float("-inf")
    change = torch.where(visible, new_weight - pattern[..., key], 0.0)
    # Every other entry keeps its share of the remaining mass: A_ts' (1 - p') / (1 - A_ts).
    others = -change[..., None] * (log_pattern - log_other[..., None]).exp()
    others[..., key] = change
    return others


@dataclass
class _Run:
    """What one forward (and backward) pass captured, per chosen layer."""

    patterns: dict[int, Tensor]
    queries: dict[int, Tensor]
    keys: dict[int, Tensor]
    grads: dict[int, Tensor]
    metric: Tensor
    embed: Tensor | None = None  # what entered the first block (exact-ig interpolates it)


# --------------------------------------------------------------------------------------------
# the result


@dataclass
class AttentionAttribution:
    """Query, key and pattern attribution of every head (see `attention_attribution`).

    Sign convention: an estimate is M(run with the node patched) - M(run), the patched run being
    the corrupted one for direction="denoise" (node moved corrupted -> clean, TransformerLens 4's
    convention: positive = moving towards clean raises the metric) and the clean one for
    direction="noise" (AtP*: node moved clean -> corrupted).

    Attributes:
        by_position: node kind -> estimates per node. "query" and "pattern":
            Float[Tensor, "batch layer head pos"] (pattern: the query row); "key":
            Float[Tensor, "batch layer kv_head pos"] (one key node per key/value head, so
            n_key_value_heads of them on GQA models).
        scores: node kind -> Float[Tensor, "layer head"] (key: "layer kv_head"): by_position
            summed over positions and averaged over the batch of pairs.
        key_by_head: Float[Tensor, "batch layer head pos"]: the key estimate split over the query
            heads that read each key/value head (summing a group gives by_position["key"]).
        edges: Float[Tensor, "batch layer head query key"]: R * (A_other - A), the pattern node's
            per-link terms: which query-key links carry the effect.
        patterns, other_patterns, pattern_grads: A of the patched run, A of the other run and
            R = dM/dA of the patched run, Float[Tensor, "batch layer head query key"].
        clean_metric, corrupted_metric: Float[Tensor, "batch"], the metric of each pair on the
            clean and on the corrupted prompt (whichever run was patched).
        layers, method, direction, n_heads, n_kv_heads, tokens (the patched run's),
        other_tokens, lengths, str_tokens (the patched run's).

    A pattern node's estimate is the sum of its edges; a query node's is R times the exact
    change of its row (`delta_pattern`):

    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]), layers=[1])
    >>> torch.allclose(att.edges.sum(-1), att.by_position["pattern"], atol=1e-6)
    True
    >>> delta = att.delta_pattern("query", layer=1, head=2, position=7)  # [head query key]
    >>> estimate = (delta[2, 7] * att.pattern_grads[0, 0, 2, 7].double()).sum()
    >>> torch.isclose(estimate.float(), att.by_position["query"][0, 0, 2, 7], atol=1e-6)
    tensor(True)
    """

    by_position: dict[str, Tensor]
    scores: dict[str, Tensor]
    key_by_head: Tensor | None
    edges: Tensor
    patterns: Tensor
    other_patterns: Tensor
    pattern_grads: Tensor
    clean_metric: Tensor
    corrupted_metric: Tensor
    layers: list[int]
    method: str
    direction: str
    n_heads: int
    n_kv_heads: int
    tokens: Tensor
    other_tokens: Tensor
    lengths: Tensor
    str_tokens: list[list[str]] | None = None
    # float64 logits kept for delta_pattern: base, base with every query swapped, key change.
    _logits: Tensor | None = field(default=None, repr=False)
    _query_logits: Tensor | None = field(default=None, repr=False)
    _key_logit_change: Tensor | None = field(default=None, repr=False)

    @property
    def nodes(self) -> list[str]:
        """The node kinds computed.

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> metric = logit_diff([294], [52])
        >>> attention_attribution(model, clean, corrupted, metric, nodes=["key", "query"]).nodes
        ['query', 'key']
        """
        return list(self.by_position)

    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not computed: layers are {self.layers}")
        return self.layers.index(layer)

    def _check_node(self, node: str) -> None:
        if node not in self.by_position:
            raise ValueError(f"node {node!r} was not computed: choose one of {self.nodes}")

    def top_heads(
        self, k: Validated[int] = 10, node: NodeKind = "query"
    ) -> list[tuple[int, int, float]]:
        """The k heads with the largest |score| of one node kind: [(layer, head, score)], as
        `ReversedAttention.top_heads` gives them.

        For node="key" the head is the key/value head.

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> (layer, head, score), *rest = att.top_heads(3, node="key")
        >>> scores = att.scores["key"]  # [layer kv_head]
        >>> score == scores[layer, head].item(), abs(score) == scores.abs().max().item()
        (True, True)
        """
        self._check_node(node)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive number of heads, got {k!r}")
        scores = self.scores[node]
        order = scores.flatten().abs().argsort(descending=True, stable=True)[:k]
        n = scores.shape[1]
        return [(self.layers[int(i) // n], int(i) % n, float(scores.flatten()[i])) for i in order]

    def top_edges(self, k: int = 10, batch: int = 0) -> list[tuple[int, int, int, int, float]]:
        """The k query-key links of one pair with the largest |R * (A_other - A)|:
        [(layer, head, query, key, value)].

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> (layer, head, query, key, value), *rest = att.top_edges(5)
        >>> value == att.edges[0, layer, head, query, key].item(), key <= query, len(rest)
        (True, True, 4)
        """
        edges = self.edges[batch]
        order = edges.flatten().abs().argsort(descending=True, stable=True)[:k]
        idx = torch.unravel_index(order, edges.shape)
        return [
            (self.layers[int(la)], int(h), int(q), int(s), float(edges[la, h, q, s]))
            for la, h, q, s in zip(*idx)
        ]

    def delta_pattern(
        self, node: NodeKind, layer: int, head: int, position: int, batch: int = 0
    ) -> Float[Tensor, "head query key"]:
        """The change of the layer's pattern (all query heads) that the method's estimate
        multiplies by R when one node is patched: for "query" (head, position = query row) and
        "key" (head = key/value head, position = key) the exact softmax (whatever `method`), for
        "pattern" the other run's row.

        Patching one key changes one column's logits; each changed row still sums to one:

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> delta = att.delta_pattern("key", layer=0, head=1, position=5)  # [head query key]
        >>> torch.allclose(delta.sum(-1), torch.zeros(4, 8, dtype=torch.float64), atol=1e-9)
        True
        >>> bool(delta[:, :5].eq(0).all())  # queries before the patched key do not see it
        True
        """
        i = self._layer_index(layer)
        self._check_node(node)
        log_pattern = self._logits[batch, i].log_softmax(dim=-1)  # type: ignore[index]
        out = torch.zeros_like(log_pattern)
        if node == "pattern":
            other = self.other_patterns[batch, i, head, position].double()
            out[head, position] = other - self.patterns[batch, i, head, position].double()
        elif node == "query":
            new = self._query_logits[batch, i, head, position].softmax(dim=-1)  # type: ignore[index]
            out[head, position] = new - log_pattern[head, position].exp()
        else:
            group = self.n_heads // self.n_kv_heads
            heads = slice(head * group, (head + 1) * group)
            delta = self._key_logit_change[batch, i, heads, :, position]  # type: ignore[index]
            out[heads] = key_delta_rows(log_pattern[heads], delta, position)
        return out

    def to_dict(self, k: int = 10, pair: int = 0) -> dict[str, Any]:
        """A JSON-ready summary: settings, each pair's clean and corrupted metric, every head's
        score per node kind ([layer][head] lists), the k top heads per kind and the k top
        query-key links of one pair (with its tokens).

        >>> import json
        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> report = json.loads(json.dumps(att.to_dict(k=3)))
        >>> [len(report["top"][kind]) for kind in att.nodes], len(report["top_edges"])
        ([3, 3, 3], 3)
        """
        tokens = self.str_tokens[pair] if self.str_tokens is not None else None
        edges = [
            {
                "layer": layer,
                "head": head,
                "query": query,
                "key": key,
                "query_token": tokens[query] if tokens else query,
                "key_token": tokens[key] if tokens else key,
                "value": value,
            }
            for layer, head, query, key, value in self.top_edges(k, batch=pair)
        ]
        return {
            "method": self.method,
            "direction": self.direction,
            "layers": list(self.layers),
            "nodes": self.nodes,
            "clean_metric": self.clean_metric.tolist(),
            "corrupted_metric": self.corrupted_metric.tolist(),
            "scores": {kind: self.scores[kind].tolist() for kind in self.nodes},
            "top": {
                kind: [
                    {"layer": layer, "head": head, "score": score}
                    for layer, head, score in self.top_heads(k, node=kind)
                ]
                for kind in self.nodes
            },
            "top_edges": edges,
            "str_tokens": tokens,
        }

    def table(self, k: int = 10, pair: int = 0) -> str:
        """The k top heads of each node kind and the k top links of one pair, as text.

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> print(att.table(1))  # doctest: +ELLIPSIS
        top pattern nodes (sum over positions)
        layer     head  score
        ...
        top edges R * (A_other - A) of pair 0: query <- key
        L...
        """
        report = self.to_dict(k, pair)
        lines: list[str] = []
        for kind in self.nodes:
            head_word = "kv head" if kind == "key" else "head"
            lines += [
                f"top {kind} nodes (sum over positions)",
                f"{'layer':>5}  {head_word:>7}  score",
            ]
            lines += [
                f"{row['layer']:>5}  {row['head']:>7}  {row['score']:+.4g}"
                for row in report["top"][kind]
            ]
            lines.append("")
        # As the pictures draw them: the query reads from the key.
        lines.append(f"top edges R * (A_other - A) of pair {pair}: query <- key")
        lines += [
            f"L{e['layer']}H{e['head']}  {e['query_token']!r} <- {e['key_token']!r}  "
            f"{e['value']:+.4g}"
            for e in report["top_edges"]
        ]
        return "\n".join(lines)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Layer x head heat maps of every node kind's scores: `viz.attribution_heatmaps`;
        `save` also writes the figure (png, pdf, svg)."""
        from ra_lens import viz

        return viz.attribution_heatmaps(self, save=save)

    def save(self, path: str | Path) -> None:
        """Write every tensor to a safetensors file, the settings as JSON in its header (written
        like `ReversedAttention.save`: atomically, through symlinks, keeping the file's mode).

        >>> import tempfile
        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     att.save(f"{folder}/att.safetensors")
        ...     back = AttentionAttribution.load(f"{folder}/att.safetensors")
        >>> torch.equal(back.edges, att.edges), back.top_heads(2) == att.top_heads(2)
        (True, True)
        """
        tensors = {f"by_position.{kind}": v for kind, v in self.by_position.items()}
        tensors |= {f"scores.{kind}": v for kind, v in self.scores.items()}
        for name in _ATT_TENSORS:
            value = getattr(self, name)
            if value is not None:
                tensors[name] = value
        meta = {name: getattr(self, name) for name in _ATT_META}
        write_safetensors(
            path,
            {name: value.contiguous() for name, value in tensors.items()},
            {_ATT_HEADER: json.dumps(meta)},
            "AttentionAttribution.save",
        )

    @classmethod
    def load(cls, path: str | Path) -> AttentionAttribution:
        """Read a file written by `save` (an example is there), checking that its tensors and
        settings agree; refuses other files and damaged ones with one ValueError naming the file.
        """
        meta, tensors = read_safetensors(path, _ATT_HEADER, "AttentionAttribution.save")
        try:
            if not isinstance(meta, dict) or set(meta) != set(_ATT_META):
                raise ValueError(
                    f"its metadata has keys {sorted(meta)}, expected {sorted(_ATT_META)}"
                )
            nodes = [n for n in NODES if f"by_position.{n}" in tensors]
            by_position = {n: tensors.pop(f"by_position.{n}") for n in nodes}
            scores = {n: tensors.pop(f"scores.{n}") for n in nodes}
            missing = [n for n in _ATT_TENSORS if n not in tensors and n != "key_by_head"]
            unknown = sorted(set(tensors) - set(_ATT_TENSORS))
            if not nodes or missing or unknown:
                raise ValueError(f"no node kinds, or tensors missing {missing} / unknown {unknown}")
            n_layers = len(capture.check_layer_list(meta["layers"]))
            for kind in nodes:
                heads = meta["n_kv_heads"] if kind == "key" else meta["n_heads"]
                if tuple(scores[kind].shape) != (n_layers, heads):
                    raise ValueError(
                        f"{kind} scores have shape {tuple(scores[kind].shape)}, expected "
                        f"{(n_layers, heads)} (layers {meta['layers']})"
                    )
            if meta["method"] not in METHODS or meta["direction"] not in DIRECTIONS:
                raise ValueError(
                    f"unknown method {meta['method']!r} or direction {meta['direction']!r}"
                )
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(
                f"{path} is not a readable ra-lens result file ({error}): it is damaged, "
                "truncated or was edited; compute the result again and save it"
            ) from None
        return cls(by_position=by_position, scores=scores, **meta, **tensors)

    def to_transformer_lens(self, pair: int | None = None) -> Any:
        """TransformerLens 4's `AttributionResult` of the query and key nodes.

        Keys: `Node(kind="q_input", layer, head, position)` and `Node(kind="k_input", layer,
        head, position)`; values averaged over the batch of pairs (as `attribution_patch` does),
        or those of one pair with `pair=i`. Patching a head's q_input (its residual input) at one
        position is the same intervention as patching its query there, so the scores mean what
        TL's mean. Pattern nodes have no TL kind and are left out.

        On GQA models a k_input node's `head` is the key/value head (0..n_kv_heads-1), whose key
        every query head of its group reads: its score is the effect of patching that shared key
        input. TransformerLens's own attribution refuses GQA models, so it has no such node.

        Raises:
            ValueError: direction="noise" (TL's scores are M(corrupted with the node from the
                clean run) - M(corrupted): the noise estimate is taken at the clean run instead,
                a different quantity, not a sign flip); averaging pairs of different token
                lengths (position p is not the same place in each: pass `pair=i`, or group the
                pairs by length).

        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> result = att.to_transformer_lens()
        >>> len(result.node_scores)  # query and key nodes: 2 kinds x 2 layers x 4 heads x 8 positions
        128
        """
        from transformer_lens.tools.analysis.attribution_patching import (
            AttributionResult,
            Node,
        )

        if self.direction != "denoise":
            raise ValueError(
                "to_transformer_lens exports direction='denoise' only: TransformerLens's scores "
                "are M(corrupted run with the node from the clean run) - M(corrupted run); a "
                "direction='noise' estimate is taken at the clean run, a different quantity (not "
                "its sign flipped): compute attention_attribution(..., direction='denoise')"
            )
        batch = self.lengths.shape[0]
        if pair is not None and not (isinstance(pair, int) and 0 <= pair < batch):
            raise ValueError(f"pair must be one of 0..{batch - 1}, got {pair!r}")
        chosen = range(batch) if pair is None else [pair]
        lengths = sorted({int(self.lengths[i]) for i in chosen})
        if len(lengths) > 1:
            raise ValueError(
                f"the pairs have {lengths} tokens: averaging position p over them mixes different "
                "places of each prompt; export one pair (to_transformer_lens(pair=i)) or compute "
                "pairs of one token length"
            )
        kinds = {"query": "q_input", "key": "k_input"}
        node_scores: dict[Any, float] = {}
        for kind, tl_kind in kinds.items():
            if kind not in self.by_position:
                continue
            mean = self.by_position[kind][list(chosen)].double().mean(0)[..., : lengths[0]]
            for i, layer in enumerate(self.layers):
                for head in range(mean.shape[1]):
                    for position in range(mean.shape[2]):
                        node = Node(kind=tl_kind, position=position, layer=layer, head=head)  # type: ignore[arg-type]
                        node_scores[node] = float(mean[i, head, position])
        return AttributionResult(node_scores=node_scores)


_ATT_HEADER = "ra_lens.attention_attribution"
_ATT_TENSORS = (
    "key_by_head",
    "edges",
    "patterns",
    "other_patterns",
    "pattern_grads",
    "clean_metric",
    "corrupted_metric",
    "tokens",
    "other_tokens",
    "lengths",
    "_logits",
    "_query_logits",
    "_key_logit_change",
)
_ATT_META = ("layers", "method", "direction", "n_heads", "n_kv_heads", "str_tokens")


# --------------------------------------------------------------------------------------------
# the computation


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
            is not softmax(q k^T / s + causal mask).
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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    n_steps = steps if method == "exact-ig" else 1
    shape = capture.model_shape(model)
    chosen = capture.check_layers(layers, shape.n_layers)
    clean_b, corrupted_b = capture.to_batch(model, clean), capture.to_batch(model, corrupted)
    _check_pairs(clean_b, corrupted_b)
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
            patched, source, layer, capture.attention_scale(model, layer), base.lengths, nodes,
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


def _check_pairs(clean: Batch, corrupted: Batch) -> None:
    if clean.tokens.shape[0] != corrupted.tokens.shape[0]:
        raise ValueError(
            f"{clean.tokens.shape[0]} clean but {corrupted.tokens.shape[0]} corrupted prompts: "
            "give one corrupted prompt per clean prompt"
        )
    unequal = (clean.lengths != corrupted.lengths).nonzero().flatten().tolist()
    if unequal or clean.tokens.shape != corrupted.tokens.shape:
        i = unequal[0] if unequal else 0
        raise ValueError(
            f"pair {i}: clean has {int(clean.lengths[i])} tokens, corrupted "
            f"{int(corrupted.lengths[i])}: patching is position by position, so each corrupted "
            "prompt must have its clean prompt's token length (swap in names/words that are one "
            "token each)"
        )


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
    keep_grad = {name: partial(_keep, grads, name) for name in patterns} if backward else {}
    entered: dict[str, Tensor] = {}

    def first_block(value: Tensor, hook: Any) -> Tensor:
        if embed is not None:
            value = embed.to(value.device, value.dtype)
        entered["embed"] = value.detach()
        return value

    # In this order: the input is replaced before the gradient leaf is taken (layers[0] == 0).
    hooks = [(RESID_PRE.format(0), first_block)]
    hooks.append((RESID_PRE.format(layers[0]), capture.gradient_leaf_hook(leaf)))
    with torch.enable_grad():
        with (
            model.hooks(fwd_hooks=hooks),
            capture.recorded(model, patterns + queries + keys) as acts,
            capture.raw_input_hooks(model, {}, keep_grad),
        ):
            logits = model(batch.tokens)
        # The hooks are off before the metric runs: a metric may run the model itself (e.g.
        # reference logits under no_grad), and that forward must not replace the gradient leaf.
        values, loss = metric_loss(metric, logits, batch)
        if backward:
            torch.autograd.grad(loss, [leaf["leaf"]], allow_unused=True)
    silent = [name for pair in zip(queries, keys) for name in pair if name not in acts]
    if silent:
        raise RuntimeError(
            f"hook {silent[0]!r} never fired during the forward pass: this adapter does not expose "
            "the (rotated) queries and keys its attention uses, so the softmax cannot be redone"
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
    scale: float,
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
    n_heads, n_kv = q.shape[2], k.shape[2]
    group = n_heads // n_kv

    def per_head(keys: Tensor) -> Tensor:
        # Query head h reads key/value head h // group.
        return einops.repeat(keys, "b pos g d -> b pos (g r) d", r=group)

    n_pos = q.shape[1]
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=q.device).tril()

    def logits_of(queries: Tensor, keys: Tensor) -> Tensor:
        scores = torch.einsum("bqhd,bkhd->bhqk", queries, per_head(keys)) / scale
        return scores.masked_fill(~causal, float("-inf"))

    logits = logits_of(q, k)
    log_pattern = logits.log_softmax(dim=-1)
    pattern = run.patterns[layer].double()
    real = torch.arange(n_pos, device=q.device)[None, :] < lengths.to(q.device)[:, None]
    rows = real[:, None, :, None]
    mismatch = float(((log_pattern.exp() - pattern).abs() * rows).max())
    if mismatch > _RECOMPUTE_TOLERANCE.get(run.patterns[layer].dtype, _HALF_TOLERANCE):
        raise ValueError(
            f"layer {layer}: softmax(q k^T / {scale:.4g} + causal mask) differs from hook_pattern "
            f"by {mismatch:.2g}: this attention (soft-capping, ALiBi, a sliding window, q/k "
            "edited by another hook?) is not modelled; attention_attribution supports plain "
            "causal softmax attention"
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
            query_change = torch.einsum("bqhd,bkhd->bhqk", q_other - q, per_head(k)) / scale
            out["query"] = (scores_grad * query_change.masked_fill(~causal, 0.0)).sum(-1)
        out["query"] = out["query"] * real[:, None, :]

    delta = torch.einsum("bqhd,bkhd->bhqk", q, per_head(k_other - k)) / scale
    delta = delta.masked_fill(~causal, 0.0)
    out["key_logit_change"] = delta
    if "key" in nodes:
        terms = key_terms(log_pattern, grad, delta, method)  # type: ignore[arg-type]
        by_head = terms.sum(-2) * real[:, None, :]
        out["key_by_head"] = by_head
        out["key"] = einops.reduce(by_head, "b (g r) pos -> b g pos", "sum", r=group)
    # Pattern-shaped tensors go to [batch, head, ...]; estimates are [batch, head, pos].
    return out
