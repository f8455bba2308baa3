"""Circuit discovery: a component graph, edge scores with an exact softmax, circuits and their
faithfulness, in files EAP-IG and MIB read, and one offline interactive page per circuit."""

from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.curve import FaithfulnessCurve, faithfulness_curve
from ra_lens.circuits.discover import discover
from ra_lens.circuits.ensemble import ensemble
from ra_lens.circuits.faithfulness import Faithfulness, FaithfulnessEvaluator, faithfulness
from ra_lens.circuits.files import export_mib
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.jaccard import CircuitStability, bootstrap_jaccard, refit_jaccard
from ra_lens.circuits.masks import LearnedMask, learn_mask
from ra_lens.circuits.mib import (
    MIB_FRACTIONS,
    MIB_SUBMISSION_FRACTIONS,
    ChosenCircuits,
    mib_circuits,
)
from ra_lens.circuits.negatives import NegativeScale, calibrate_negatives, scale_negatives
from ra_lens.circuits.nodes import NodeScores, attribute_nodes
from ra_lens.circuits.refine import Refinement, refine
from ra_lens.circuits.scores import EdgeScores
from ra_lens.circuits.smallest import SmallestCircuit, smallest_circuit
from ra_lens.circuits.stability import pair_scores, stable
from ra_lens.viz.circuit_page import CircuitPage

__all__ = [
    "ChosenCircuits",
    "MIB_FRACTIONS",
    "MIB_SUBMISSION_FRACTIONS",
    "Circuit",
    "CircuitPage",
    "CircuitStability",
    "EdgeScores",
    "Faithfulness",
    "FaithfulnessCurve",
    "FaithfulnessEvaluator",
    "Graph",
    "LearnedMask",
    "NegativeScale",
    "NodeScores",
    "Refinement",
    "SmallestCircuit",
    "attribute",
    "attribute_nodes",
    "bootstrap_jaccard",
    "calibrate_negatives",
    "discover",
    "ensemble",
    "export_mib",
    "faithfulness",
    "faithfulness_curve",
    "learn_mask",
    "mib_circuits",
    "pair_scores",
    "refit_jaccard",
    "refine",
    "scale_negatives",
    "smallest_circuit",
    "stable",
]
