"""`AttentionAttribution`: the result of `attention_attribution`, with its views (top heads and
edges, the exact change of a pattern), report (`to_dict`, `table`, `plot`), files (`save`, `load`)
and TransformerLens 4 export (`to_transformer_lens`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ra_lens import capture
from ra_lens.attribution.softmax import DIRECTIONS, METHODS, NODES, key_delta_rows
from ra_lens.checks import check_count
from ra_lens.result import read_safetensors, write_safetensors

if TYPE_CHECKING:
    from jaxtyping import Float
    from matplotlib.figure import Figure

    # TransformerLens 4 (the method imports it when called)
    from transformer_lens.tools.analysis.attribution_patching import AttributionResult

    from ra_lens._typing import Validated
    from ra_lens.attribution.softmax import NodeKind


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
        layers, method, direction, n_heads, n_kv_heads: the settings.
        tokens, other_tokens, lengths, str_tokens: the runs (tokens, str_tokens: the patched one).

    A pattern node's estimate is the sum of its edges; a query node's is R times the exact
    change of its row (`delta_pattern`):

    >>> from ra_lens.attribution import attention_attribution
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

        >>> from ra_lens.attribution import attention_attribution
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

        >>> from ra_lens.attribution import attention_attribution
        >>> from ra_lens.metrics import logit_diff
        >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
        >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
        >>> (layer, head, score), *rest = att.top_heads(3, node="key")
        >>> scores = att.scores["key"]  # [layer kv_head]
        >>> score == scores[layer, head].item(), abs(score) == scores.abs().max().item()
        (True, True)
        """
        self._check_node(node)
        check_count(k, "k", why="a number of heads")
        scores = self.scores[node]
        order = scores.flatten().abs().argsort(descending=True, stable=True)[:k]
        n = scores.shape[1]
        return [(self.layers[int(i) // n], int(i) % n, float(scores.flatten()[i])) for i in order]

    def top_edges(self, k: int = 10, batch: int = 0) -> list[tuple[int, int, int, int, float]]:
        """The k query-key links of one pair with the largest |R * (A_other - A)|:
        [(layer, head, query, key, value)].

        >>> from ra_lens.attribution import attention_attribution
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

        >>> from ra_lens.attribution import attention_attribution
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

        >>> from ra_lens.attribution import attention_attribution
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
                    # self.nodes holds NodeKind values (the keys of by_position)
                    for layer, head, score in self.top_heads(k, node=cast("NodeKind", kind))
                ]
                for kind in self.nodes
            },
            "top_edges": edges,
            "str_tokens": tokens,
        }

    def table(self, k: int = 10, pair: int = 0) -> str:
        """The k top heads of each node kind and the k top links of one pair, as text.

        >>> from ra_lens.attribution import attention_attribution
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

        >>> from ra_lens.attribution import attention_attribution
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
        # the remaining tensors are the tensor fields by name (checked above)
        fields = cast("dict[str, Any]", tensors)
        return cls(by_position=by_position, scores=scores, **meta, **fields)

    def to_transformer_lens(self, pair: int | None = None) -> AttributionResult:
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

        >>> from ra_lens.attribution import attention_attribution
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
