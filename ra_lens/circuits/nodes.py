"""Node scores: each writer's score is the sum of its outgoing edges' (the first-order effect of
patching its output into every reader), each reader's the sum of its incoming edges' (patching
its whole input). `attribute_nodes` is `attribute` summed per node; `attribute` itself returns
edge scores only (one function, one return type)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jaxtyping import Float
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.circuits.attribute import Method, attribute
from ra_lens.circuits.graph import Graph
from ra_lens.record import Recorded
from ra_lens.types import MetricFn, Tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class NodeScores(Recorded):
    """One score per writer and per reader (the module docstring says what they mean).

    Attributes:
        graph: the model's graph.
        writers: Float[Tensor, "writer"], in graph.writers order (input, heads, MLPs).
        readers: Float[Tensor, "reader"], in graph.readers order (queries, keys/values per
            key/value head, MLPs, logits).
        method, direction: as passed to `attribute_nodes`.
    """

    graph: Graph
    writers: Float[Tensor, "writer"]
    readers: Float[Tensor, "reader"]
    method: str
    direction: str

    def __post_init__(self) -> None:
        w, r = len(self.graph.writers), len(self.graph.readers)
        if tuple(self.writers.shape) != (w,) or tuple(self.readers.shape) != (r,):
            raise ValueError(
                f"writers {tuple(self.writers.shape)} and readers {tuple(self.readers.shape)} "
                f"for a graph of {w} writers and {r} readers: pass one score per node"
            )

    def top(
        self, k: int = 10, *, of: Literal["writers", "readers"] = "writers"
    ) -> list[tuple[str, float]]:
        """The k nodes (writers or readers) with the largest |score|, as (name, score)."""
        check_count(k, "k")
        values, names = (
            (self.writers, self.graph.writers)
            if of == "writers"
            else (self.readers, self.graph.readers)
        )
        order = values.abs().argsort(descending=True, stable=True)[:k]
        return [(names[i], float(values[i])) for i in order.tolist()]

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        """JSON-ready: the settings, the graph and the k writers and readers of largest |score|."""
        return {
            "method": self.method,
            "direction": self.direction,
            "graph": dataclasses.asdict(self.graph),
            "top_writers": [{"node": n, "score": s} for n, s in self.top(k)],
            "top_readers": [{"node": n, "score": s} for n, s in self.top(k, of="readers")],
        }

    def table(self, k: int = 10) -> str:
        """A Markdown table of the k writers with the largest |score|."""
        rows = [
            f"{self.method} node scores ({self.direction}), {self.graph}",
            "",
            "| rank | writer | score |",
            "|---:|---|---:|",
        ]
        rows += [f"| {i} | {n} | {s:.4g} |" for i, (n, s) in enumerate(self.top(k), 1)]
        return "\n".join(rows)

    def plot(self, save: str | Path | None = None, *, k: int = 20) -> Figure:
        """The k writers with the largest |score| as bars; `save` also writes the figure."""
        from ra_lens.viz import named_bars

        top = self.top(min(k, len(self.graph.writers)))
        return named_bars(
            [n for n, _ in top], [s for _, s in top], title=f"{self.method} node scores",
            xlabel=f"score ({self.direction})", save=save,
        )  # fmt: skip


def attribute_nodes(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    method: Validated[Method] = "eap-ig",
    direction: Validated[Literal["denoise", "noise"]] = "denoise",
    steps: int = 5,
    batch_size: int = 8,
    progress: bool = False,
) -> NodeScores:
    """`attribute`'s edge scores summed per node (arguments, refusals and model state as there).

    Returns:
        NodeScores: writers Float[Tensor, "writer"] (row sums of the [writer reader] scores),
        readers Float[Tensor, "reader"] (column sums).

    >>> from ra_lens.metrics import logit_diff
    >>> metric = logit_diff([294], [52])
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> nodes = attribute_nodes(model, clean, corrupted, metric, method="eap")
    >>> edges = attribute(model, clean, corrupted, metric, method="eap")
    >>> bool((nodes.writers == edges.scores.sum(1)).all()), nodes.writers.shape
    (True, torch.Size([11]))
    """
    edges = attribute(
        model, clean, corrupted, metric, method=method, direction=direction, steps=steps,
        batch_size=batch_size, progress=progress,
    )  # fmt: skip
    scores = edges.scores
    return NodeScores(edges.graph, scores.sum(1), scores.sum(0), method, direction)
