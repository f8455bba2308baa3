"""Circuit discovery: a component graph, edge scores with an exact softmax, circuits and their
faithfulness, in files EAP-IG and MIB read."""

from ra_lens.circuits.circuit import Circuit, EdgeScores
from ra_lens.circuits.graph import Graph

__all__ = ["Circuit", "EdgeScores", "Graph"]
