"""MIB's circuit sizes and how MIB chooses a circuit at each size, for the curve, the page and
the export alike. Below the result classes: it names them for type hints only and asks the scores
to choose (`EdgeScores.top` / `.greedy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from ra_lens._typing import Validated
from ra_lens.circuits.graph import Units

if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.scores import EdgeScores

#: MIB's circuit sizes: 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50 and 100 % of the graph's edges.
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def mib_circuits(
    scores: EdgeScores,
    fractions: Sequence[float],
    *,
    absolute: bool,
    selection: Literal["top", "greedy"] = "top",
    units: Validated[Units] = "ungrouped",
) -> list[Circuit]:
    """The circuits MIB evaluates: for each fraction k, int(k * N) edges (N in `units`) of the
    ranking by score (absolute=False) or |score|, by `EdgeScores.top` or `.greedy`, pruned."""
    total = scores.graph.count(units)
    pick = scores.top if selection == "top" else scores.greedy
    return [pick(int(k * total), absolute=absolute, units=units) for k in fractions]
