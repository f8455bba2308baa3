"""ReversedAttention: what `reversed_attention` returns, with the reductions researchers use.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jaxtyping import Float, Int
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes
from torch import Tensor

from ra_lens.files import write_file

_TENSORS = (
    "maps",
    "patterns",
    "norms",
    "pattern_norms",
    "tokens",
    "lengths",
    "metric_values",
    "rows",
    "row_positions",
)


@dataclass
class ReversedAttention:
    """Reversed Attention of a batch of prompts, for the chosen layers and every head.

    Attributes:
        maps: Float[Tensor, "batch layer head query key"] in `convention`; None with keep="norms".
        patterns: Float[Tensor, "batch layer head query key"], forward attention; None with
            keep="norms".
        norms: Float[Tensor, "batch layer head"], Frobenius norm of each map (always kept).
        pattern_norms: Float[Tensor, "batch layer head"], Frobenius norm of each forward pattern.
        tokens: Int[Tensor, "batch pos"], right-padded; lengths: Int[Tensor, "batch"].
        metric_values: Float[Tensor, "batch"], the metric of each prompt (or one scalar).
        layers: the layer index of each position on the layer axis.
        convention: "qk" (dL/d(QK^T), the paper's RA), "scores" or "pattern".
        scales: the attention scale s of each layer in `layers`.
        routes: how each layer's gradient was read: "pattern" (hook_pattern) or "z" (hook_z, hook_v).
        rows: Float[Tensor, "batch layer head key"], each prompt's RA row at its loss position
            (keep="rows"); row_positions: Int[Tensor, "batch"], the query position of each row.

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, ["I like Italy", "Q: hot"], metrics.target_nll([5, 7]))
    >>> ra
    ReversedAttention(batch=2, layers=2, heads=4, pos=8, convention='qk', keep='maps')
    >>> torch.equal(ra.norms, ra.maps.flatten(-2).norm(dim=-1))
    True
    """

    norms: Float[Tensor, "batch layer head"]
    pattern_norms: Float[Tensor, "batch layer head"]
    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, "batch"]
    metric_values: Float[Tensor, "..."]
    layers: list[int]
    convention: str
    scales: list[float]
    routes: list[str]
    maps: Float[Tensor, "batch layer head query key"] | None = None
    patterns: Float[Tensor, "batch layer head query key"] | None = None
    rows: Float[Tensor, "batch layer head key"] | None = None
    row_positions: Int[Tensor, "batch"] | None = None
    str_tokens: list[list[str]] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        batch, n_layers, n_heads = self.norms.shape
        kept = "maps" if self.maps is not None else "rows" if self.rows is not None else "norms"
        return (
            f"ReversedAttention(batch={batch}, layers={n_layers}, heads={n_heads}, "
            f"pos={self.tokens.shape[1]}, convention={self.convention!r}, keep={kept!r})"
        )

    def head_norms(self) -> Float[Tensor, "layer head"]:
        """Frobenius norm of each head's map, mean over the batch.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, ["I like Italy", "Q: hot"], metrics.target_nll([5, 7]))
        >>> ra.head_norms().shape  # [layer head]
        torch.Size([2, 4])
        >>> torch.allclose(ra.head_norms(), ra.maps.flatten(-2).norm(dim=-1).mean(0))
        True
        """
        return self.norms.mean(0)

    def forward_norms(self) -> Float[Tensor, "layer head"]:
        """Frobenius norm of each head's forward pattern, mean over the batch.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> torch.allclose(ra.forward_norms(), ra.patterns[0].flatten(-2).norm(dim=-1))
        True
        """
        return self.pattern_norms.mean(0)

    def top_heads(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The k heads with the largest mean norm, as (layer, head, norm), largest first.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> (layer, head, norm), *rest = ra.top_heads(3)
        >>> norm == ra.head_norms().max().item() == ra.head_norms()[layer, head].item(), len(rest)
        (True, 2)
        """
        norms = self.head_norms()
        values, flat = norms.flatten().topk(min(k, norms.numel()))
        n_heads = norms.shape[1]
        return [
            (self.layers[i // n_heads], i % n_heads, v)
            for i, v in zip(flat.tolist(), values.tolist())
        ]

    def mean_maps(self) -> Float[Tensor, "layer head query key"]:
        """Maps averaged over the batch (prompts of equal length, as the paper averages them).

        >>> from ra_lens import metrics, reversed_attention
        >>> prompts = ["The capital of France is", "The capital of Italy is"]  # 8 tokens each
        >>> ra = reversed_attention(model, prompts, metrics.target_nll([5]))
        >>> ra.mean_maps().shape  # [layer head query key]
        torch.Size([2, 4, 8, 8])
        """
        return self._need("maps").mean(0)

    def mean_patterns(self) -> Float[Tensor, "layer head query key"]:
        """Forward patterns averaged over the batch (the paper's patching baseline).

        >>> from ra_lens import metrics, reversed_attention
        >>> prompts = ["The capital of France is", "The capital of Italy is"]  # 8 tokens each
        >>> ra = reversed_attention(model, prompts, metrics.target_nll([5]))
        >>> torch.allclose(ra.mean_patterns().sum(-1), torch.ones(2, 4, 8))  # rows sum to one
        True
        """
        return self._need("patterns").mean(0)

    def head(self, layer: int, head: int, prompt: int = 0) -> Float[Tensor, "query key"]:
        """One head's map for one prompt, cut to the prompt's real length.

        >>> from ra_lens import metrics, reversed_attention
        >>> prompts = ["I like Italy and France", "Q: hot"]  # 11 and 7 tokens
        >>> ra = reversed_attention(model, prompts, metrics.target_nll([5]))
        >>> ra.head(1, 0, prompt=1).shape, int(ra.lengths[1])
        (torch.Size([7, 7]), 7)
        """
        n = int(self.lengths[prompt])
        return self._need("maps")[prompt, self.layers.index(layer), head, :n, :n]

    def top_keys(
        self, layer: int, head: int, k: int = 10, prompt: int = 0
    ) -> list[tuple[int, str | None, float]]:
        """The k keys with the largest |RA| in one head's loss row: which tokens the metric's
        gradient most wants this head to read more or less (keep="rows").

        Returns (position, token string or None, signed RA value), largest |RA| first. With a
        loss to minimise (NLL), gradient descent moves the logits along -RA: a negative value
        asks for more attention to that key, a positive one for less.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]), keep="rows")
        >>> keys = ra.top_keys(1, 0, k=2)  # [(position, token, RA value)]
        >>> [value for _, _, value in keys] == [float(ra.rows[0, 1, 0, p]) for p, _, _ in keys]
        True
        >>> all(token == ra.str_tokens[0][p] for p, token, _ in keys)
        True
        """
        row = self._need("rows", keep="rows")[prompt, self.layers.index(layer), head]
        row = row[: int(self.lengths[prompt])]
        _, positions = row.abs().topk(min(k, row.shape[0]))
        tokens = self.str_tokens[prompt] if self.str_tokens is not None else None
        return [
            (p, tokens[p] if tokens is not None else None, float(row[p]))
            for p in positions.tolist()
        ]

    def _need(self, name: str, keep: str = "maps") -> Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"{name} were not kept: call reversed_attention(..., keep={keep!r})")
        return value

    @classmethod
    def concat(cls, parts: list[ReversedAttention]) -> ReversedAttention:
        """Join results of equal-length batches (same layers and convention) along the batch.

        >>> from ra_lens import metrics, reversed_attention
        >>> tokens, metric = torch.randint(3, 300, (2, 6)), metrics.target_nll([5])
        >>> parts = [reversed_attention(model, row, metric) for row in tokens.split(1)]
        >>> joined = ReversedAttention.concat(parts)
        >>> torch.allclose(joined.maps, reversed_attention(model, tokens, metric).maps, atol=1e-6)
        True
        """
        parts = list(parts)
        if not parts:
            raise ValueError("nothing to join: pass at least one ReversedAttention")
        if any(p.metric_values.ndim != 1 for p in parts):
            raise ValueError(
                "results of a scalar metric cannot be joined by prompt: compute them with a "
                "metric that returns one value per prompt (all of ra_lens.metrics do)"
            )
        first = parts[0]
        if len({p.tokens.shape[1] for p in parts}) > 1:
            raise ValueError("results must share one token length to be joined")
        if any(p.layers != first.layers or p.convention != first.convention for p in parts):
            raise ValueError("results must cover the same layers in the same convention")

        def cat(name: str) -> Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        return cls(
            **{name: cat(name) for name in _TENSORS},
            layers=first.layers,
            convention=first.convention,
            scales=first.scales,
            routes=first.routes,
            str_tokens=None
            if any(p.str_tokens is None for p in parts)
            else sum((p.str_tokens or [] for p in parts), []),
        )

    def save(self, path: str | Path) -> None:
        """Write tensors to a safetensors file, with the rest as JSON metadata in its header.

        >>> import tempfile
        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     ra.save(f"{folder}/ra.safetensors")
        ...     back = ReversedAttention.load(f"{folder}/ra.safetensors")
        >>> torch.equal(back.maps, ra.maps), back.layers, back.str_tokens == ra.str_tokens
        (True, [0, 1], True)
        """
        tensors = {
            n: getattr(self, n).contiguous() for n in _TENSORS if getattr(self, n) is not None
        }
        meta = {
            "layers": self.layers,
            "convention": self.convention,
            "scales": self.scales,
            "routes": self.routes,
            "str_tokens": self.str_tokens,
        }
        write_file(path, save_bytes(tensors, metadata={"ra_lens": json.dumps(meta)}))

    @classmethod
    def load(cls, path: str | Path) -> ReversedAttention:
        """Read a file written by `save` (an example is there); refuses other files.

        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_file({"x": torch.zeros(1)}, f"{folder}/other.safetensors")
        ...     ReversedAttention.load(f"{folder}/other.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../other.safetensors was not written by ReversedAttention.save
        """
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
        if "ra_lens" not in header:
            raise ValueError(f"{path} was not written by ReversedAttention.save")
        tensors = load_file(str(path))
        return cls(**json.loads(header["ra_lens"]), **tensors)


def stack_layers(per_layer: list[Tensor]) -> Tensor:
    """[batch, head, ...] per layer -> [batch, layer, head, ...]."""
    return torch.stack(per_layer, dim=1)
