"""Edge scores and circuits over a component graph (see `graph.py`): choosing, combining, files.

SKELETON written by the lead so that the scoring and the faithfulness code can import these two
classes from the start; the circuit-data helper owns this file and fills in the methods.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Bool, Float
from torch import Tensor

from ra_lens.circuits.graph import Graph


@dataclass
class EdgeScores:
    """One score per edge: `scores[w, r]` estimates what patching edge writer w -> reader r from
    the clean run into the corrupted one (denoise) or the reverse (noise) does to the metric.
    Entries where `graph.real` is False are 0."""

    graph: Graph
    scores: Float[Tensor, "writer reader"]
    method: str
    direction: str


@dataclass
class Circuit:
    """A set of edges of a graph: `edges[w, r]` True where edge w -> r is in the circuit."""

    graph: Graph
    edges: Bool[Tensor, "writer reader"]
