"""ReversedAttention: what `reversed_attention` returns, with the reductions researchers use.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from jaxtyping import Float, Int
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.checks import check_count
from ra_lens.files import write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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


class _StackedOnRead:
    """The field behind `ReversedAttention.patterns`: a [batch layer head query key] tensor, or
    the per-layer [batch head query key] tensors it is stacked from when first read.

    `reversed_attention` hands over the forward pass's own patterns this way: stacking them in
    the call wrote a second result as large as the maps (1.1 GB at 1,024 tokens on SmolLM2),
    which a caller who never reads `patterns` paid for nothing. A dataclass field whose default
    is a descriptor passes `__init__`'s value to `__set__` (the dataclasses docs,
    "Descriptor-typed fields"); the class-level read gives the field's default, None.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_{name}"

    def __get__(self, obj: object | None, owner: type | None = None) -> Tensor | None:
        if obj is None:
            return None
        value: Tensor | list[Tensor] | None = obj.__dict__[self._key]
        if isinstance(value, list):
            # Stacked once; the per-layer references go, so memory is one copy after the read.
            value = obj.__dict__[self._key] = stack_layers(value)
        return value

    def __set__(self, obj: object, value: Tensor | list[Tensor] | None) -> None:
        obj.__dict__[self._key] = value


if TYPE_CHECKING:
    # mypy reads the descriptor: `ra.patterns` is a Tensor or None, `patterns=` also takes a list.
    _Patterns = _StackedOnRead
else:
    # The run-time checker (jaxtyping + beartype, tests) reads what __init__ accepts.
    _Patterns = (
        Float[Tensor, "batch layer head query key"]
        | list[Float[Tensor, "batch head query key"]]
        | None
    )


@dataclass
class ReversedAttention:
    """Reversed Attention of a batch of prompts, for the chosen layers and every head.

    Attributes:
        maps: Float[Tensor, "batch layer head query key"] in `convention`; None with keep="norms".
        patterns: Float[Tensor, "batch layer head query key"], forward attention; None with
            keep="norms". `reversed_attention` keeps the forward pass's own per-layer tensors and
            stacks them on the first read of `patterns` (one copy, paid only by a reader); the
            constructor also takes that list of [batch head query key] tensors.
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
    patterns: _Patterns = _StackedOnRead()
    rows: Float[Tensor, "batch layer head key"] | None = None
    row_positions: Int[Tensor, "batch"] | None = None
    str_tokens: list[list[str]] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        batch, n_layers, n_heads = self.norms.shape
        return (
            f"ReversedAttention(batch={batch}, layers={n_layers}, heads={n_heads}, "
            f"pos={self.tokens.shape[1]}, convention={self.convention!r}, keep={self.keep!r})"
        )

    @property
    def keep(self) -> str:
        """What was kept: "maps" (maps and patterns), "rows" or "norms" (see reversed_attention)."""
        return "maps" if self.maps is not None else "rows" if self.rows is not None else "norms"

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

    def top_heads(self, k: Validated[int] = 10) -> list[tuple[int, int, float]]:
        """The k heads with the largest mean norm, as (layer, head, norm), largest first.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> (layer, head, norm), *rest = ra.top_heads(3)
        >>> norm == ra.head_norms().max().item() == ra.head_norms()[layer, head].item(), len(rest)
        (True, 2)
        """
        check_count(k, "k", why="a number of heads")
        norms = self.head_norms()
        values, flat = norms.flatten().topk(min(k, norms.numel()))
        n_heads = norms.shape[1]
        return [
            (self.layers[i // n_heads], i % n_heads, v)
            for i, v in zip(flat.tolist(), values.tolist())
        ]

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        """A JSON-ready summary: settings, the metric, every head's mean RA and forward norm
        ([layer][head] lists) and the k top heads.

        `metric` is the sum over prompts (the loss that was differentiated); `metric_values` has
        each prompt's value (one value for a scalar metric).

        >>> import json
        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> report = ra.to_dict(k=2)
        >>> [head["layer"] for head in report["top_heads"]] == [la for la, _, _ in ra.top_heads(2)]
        True
        >>> sorted(json.loads(json.dumps(report)))  # doctest: +NORMALIZE_WHITESPACE
        ['convention', 'forward_norms', 'keep', 'layers', 'lengths', 'metric', 'metric_values',
         'ra_norms', 'routes', 'scales', 'str_tokens', 'top_heads']
        """
        forward = self.forward_norms()
        top = [
            {
                "layer": layer,
                "head": head,
                "ra_norm": norm,
                "forward_norm": float(forward[self.layers.index(layer), head]),
            }
            for layer, head, norm in self.top_heads(k)
        ]
        return {
            "convention": self.convention,
            "keep": self.keep,
            "layers": list(self.layers),
            "scales": list(self.scales),
            "routes": list(self.routes),
            "lengths": self.lengths.tolist(),
            "metric": float(self.metric_values.double().sum()),
            "metric_values": self.metric_values.reshape(-1).tolist(),
            "ra_norms": self.head_norms().tolist(),
            "forward_norms": forward.tolist(),
            "top_heads": top,
            "str_tokens": self.str_tokens,
        }

    def table(self, k: int = 10) -> str:
        """The k top heads as a text table: rank, layer, head, RA norm, forward norm.

        >>> from ra_lens import metrics, reversed_attention
        >>> ra = reversed_attention(model, "I like Italy", metrics.target_nll([5]))
        >>> print(ra.table(2))  # doctest: +ELLIPSIS
        rank  layer  head     RA norm  forward norm
           1      ...
           2      ...
        """
        lines = [f"{'rank':>4}  {'layer':>5}  {'head':>4}  {'RA norm':>10}  {'forward norm':>12}"]
        for i, row in enumerate(self.to_dict(k)["top_heads"], 1):
            lines.append(
                f"{i:>4}  {row['layer']:>5}  {row['head']:>4}  {row['ra_norm']:>10.5f}  "
                f"{row['forward_norm']:>12.4f}"
            )
        return "\n".join(lines)

    def plot(self, save: str | Path | None = None) -> Figure:
        """Layer x head heat maps of the RA norms (and the forward norms where kept):
        `viz.head_norm_heatmaps`; `save` also writes the figure (png, pdf, svg)."""
        from ra_lens import viz

        return viz.head_norm_heatmaps(self, save=save)

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
        value: Tensor | None = getattr(self, name)
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
        keeps = [p.keep for p in parts]
        if len(set(keeps)) > 1:
            raise ValueError(
                f"results were computed with different keep= ({keeps}): joining them would drop "
                "the maps or rows some parts lack; compute every part with the same keep"
            )
        model = (first.norms.shape[2], first.scales, first.routes)
        for p in parts:
            if (p.norms.shape[2], p.scales, p.routes) != model:
                raise ValueError(
                    f"results come from different models ({model[0]} heads, attention scales "
                    f"{model[1]}, routes {model[2]} versus {p.norms.shape[2]} heads, {p.scales}, "
                    f"{p.routes}): join results of one model"
                )

        def cat(name: str) -> Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        # Any: a joined tensor or None per optional field; norms (always kept) is never None
        joined: dict[str, Any] = {name: cat(name) for name in _TENSORS}
        return cls(
            **joined,
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
        write_safetensors(path, tensors, {_HEADER: json.dumps(meta)}, "ReversedAttention.save")

    @classmethod
    def load(cls, path: str | Path) -> ReversedAttention:
        """Read a file written by `save` (an example is there), checking that its tensors and
        metadata agree; refuses other files and damaged ones with one ValueError naming the file.

        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_file({"x": torch.zeros(1)}, f"{folder}/other.safetensors")
        ...     ReversedAttention.load(f"{folder}/other.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../other.safetensors was not written by ReversedAttention.save
        """
        meta, tensors = read_safetensors(path, _HEADER, "ReversedAttention.save")
        fields = {"layers", "convention", "scales", "routes", "str_tokens"}
        if not isinstance(meta, dict) or set(meta) != fields:
            keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise damaged(path, f"its metadata has keys {keys}, expected {sorted(fields)}")
        unknown = sorted(set(tensors) - set(_TENSORS))
        if unknown or "norms" not in tensors:
            raise damaged(path, f"unexpected tensors {unknown} or no 'norms'")
        try:
            _check_parts(meta, tensors)
        except (TypeError, ValueError) as error:
            raise damaged(path, str(error)) from None
        # the tensors are the tensor fields by name (checked above)
        return cls(**meta, **cast("dict[str, Any]", tensors))


def _check_parts(meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Raise ValueError unless a file's metadata and tensors describe one ReversedAttention."""
    from ra_lens.capture import check_layer_list
    from ra_lens.math import CONVENTIONS

    norms = tensors["norms"]
    if norms.ndim != 3:
        raise ValueError(f"norms have shape {tuple(norms.shape)}, not [batch layer head]")
    batch, n_layers, n_heads = norms.shape
    layers, scales, routes = meta["layers"], meta["scales"], meta["routes"]
    if (
        len(check_layer_list(layers)) != n_layers
        or len(scales) != n_layers
        or len(routes) != n_layers
    ):
        raise ValueError(
            f"layers {layers}, scales {scales} and routes {routes} do not give one entry per "
            f"layer of the tensors ({n_layers})"
        )
    if meta["convention"] not in CONVENTIONS or not set(routes) <= {"pattern", "z"}:
        raise ValueError(f"unknown convention {meta['convention']!r} or routes {routes}")
    tokens = tensors.get("tokens")
    if tokens is None or tokens.ndim != 2 or tokens.shape[0] != batch:
        shape = None if tokens is None else tuple(tokens.shape)
        raise ValueError(f"tokens {shape} for a batch of {batch}")
    pos = tokens.shape[1]
    expected = {
        "pattern_norms": (batch, n_layers, n_heads),
        "lengths": (batch,),
        "maps": (batch, n_layers, n_heads, pos, pos),
        "patterns": (batch, n_layers, n_heads, pos, pos),
        "rows": (batch, n_layers, n_heads, pos),
        "row_positions": (batch,),
    }
    for name, shape in expected.items():
        value = tensors.get(name)
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} have shape {tuple(value.shape)}, expected {shape}")
    for name in ("pattern_norms", "lengths", "metric_values"):
        if name not in tensors:
            raise ValueError(f"the tensor {name!r} is missing")
    if ("maps" in tensors) != ("patterns" in tensors):
        raise ValueError("maps come without patterns (or patterns without maps)")
    if ("rows" in tensors) != ("row_positions" in tensors):
        raise ValueError("rows come without row_positions (or the reverse)")
    if tensors["metric_values"].numel() not in (1, batch):
        raise ValueError(f"{tensors['metric_values'].numel()} metric values for {batch} prompts")
    str_tokens = meta["str_tokens"]
    if str_tokens is not None and len(str_tokens) != batch:
        raise ValueError(f"{len(str_tokens)} token lists for {batch} prompts")


_HEADER = "ra_lens"


def write_safetensors(
    path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str], writer: str
) -> None:
    """Write a safetensors file with `files.write_file` (atomic, through symlinks, mode kept).
    `writer` names the caller in errors."""
    try:
        write_file(path, save_bytes(tensors, metadata=metadata))
    except ValueError as error:
        raise ValueError(f"{error} ({writer} writes one file, e.g. ra.safetensors)") from None


def read_safetensors(path: str | Path, header: str, writer: str) -> tuple[Any, dict[str, Tensor]]:
    """(the JSON metadata under `header`, the tensors) of a file that `writer` wrote.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file: not written by `writer`, or damaged (truncated, empty, a
            folder, metadata that is not JSON).
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            found = handle.metadata() or {}
        if header not in found:
            raise ValueError(f"{path} was not written by {writer}")
        return json.loads(found[header]), load_file(str(path))
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(path, f"{type(error).__name__}: {error}") from None


def damaged(path: str | Path, reason: str) -> ValueError:
    return ValueError(
        f"{path} is not a readable ra-lens result file ({reason}): it is damaged, truncated or "
        "was edited; compute the result again and save it"
    )


def stack_layers(per_layer: list[Tensor]) -> Tensor:
    """[batch, head, ...] per layer -> [batch, layer, head, ...]."""
    return torch.stack(per_layer, dim=1)
