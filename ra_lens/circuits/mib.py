"""MIB's circuit track in one place (arXiv 2504.13151; hannamw/MIB-circuit-track): its circuit
sizes, its sign and the circuits it evaluates (the submission folder it reads: `files.export_mib`).
Below the result classes: it names them for type hints only and asks the scores to choose.

- sizes: fractions k of the graph's edges; a circuit of size k keeps int(k * N) edges (rounded
  down, before pruning), N in MIB's unit, the edges of EAP-IG's ungrouped graph
  (`Graph.count()`). `MIB_FRACTIONS` are the curve's ten sizes (0.1 % .. 100 %),
  `MIB_SUBMISSION_FRACTIONS` the nine binary circuits of a submission (the same without 100 %).
- sign: MIB ranks scores signed for CPR, positive where the edge helps the metric: denoise
  scores as they are, noise scores negated (`mib_sign`, `EdgeScores.helps`).
- circuits: `ChosenCircuits` chooses each (size, ranking, unit) once by `EdgeScores.top` or
  `.greedy` and keeps it, so the curve, the page and the export of one run share them;
  `mib_circuits` is the one-off form.

    >>> from ra_lens.circuits import EdgeScores
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> s = EdgeScores(g, torch.rand(len(g.writers), len(g.readers)) * g.real, "eap", "denoise")
    >>> chosen = ChosenCircuits(s)
    >>> g.count(), [c.n_edges_ungrouped <= int(k * 13) for k, c in
    ...             zip([0.5, 1.0], chosen.at([0.5, 1.0], absolute=False))]
    (13, [True, True])
    >>> chosen.at([0.5], absolute=False)[0] is chosen.pick(6, absolute=False)  # kept, not redone
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

import torch  # noqa: F401  # the doctests

from ra_lens._typing import Validated
from ra_lens.circuits.graph import UNITS, Graph, Units  # noqa: F401  # Graph: the doctests

# The result classes import this module (`mib_sign`); it names them for type hints only.
if TYPE_CHECKING:
    from ra_lens.circuits.circuit import Circuit
    from ra_lens.circuits.scores import EdgeScores

#: MIB's circuit sizes: 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50 and 100 % of the graph's edges.
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: The circuit sizes of a MIB submission of binary circuits: 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50 %.
MIB_SUBMISSION_FRACTIONS: tuple[float, ...] = MIB_FRACTIONS[:-1]

Selection = Literal["top", "greedy"]


def mib_sign(direction: str) -> float:
    """+1 for denoise scores, -1 for noise scores: the factor that puts a score in MIB's sign
    (positive where the edge helps the metric, `EdgeScores.helps`).

    >>> mib_sign("denoise"), mib_sign("noise")
    (1.0, -1.0)
    """
    if direction not in ("denoise", "noise"):
        raise ValueError(f"direction={direction!r}: expected 'denoise' or 'noise'")
    return 1.0 if direction == "denoise" else -1.0


def check_fractions(sizes: Sequence[float]) -> list[float]:
    """`sizes` as floats, each a fraction of the graph's edges in (0, 1], increasing without
    repeats; anything else is refused with an error naming the fix.

    >>> check_fractions([0.01, 0.1, 1])
    [0.01, 0.1, 1.0]
    """
    try:
        fractions = [float(k) for k in sizes]
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"sizes must be fractions of the edges, e.g. [0.01, 0.1, 1]: {err}"
        ) from err
    bad = [k for k in fractions if not 0 < k <= 1]
    if not fractions or bad:
        raise ValueError(
            f"sizes={list(sizes)!r}: {bad[0] if bad else 'none'} is not a fraction of the "
            "graph's edges in (0, 1]; pass fractions of the graph's edges, e.g. [0.01, 0.1, 1] "
            "(not percentages, not edge counts)"
        )
    if any(b <= a for a, b in zip(fractions, fractions[1:])):
        raise ValueError(f"sizes={fractions}: list them in increasing order, without repeats")
    return fractions


@dataclass
class ChosenCircuits:
    """The circuits one `EdgeScores` gives by one `selection`, each chosen once and kept: asked
    again for the same edge count, ranking and unit, the kept circuit comes back."""

    scores: EdgeScores
    selection: Selection = "top"
    #: choose each query head's copy of a key/value edge on its own (per-copy circuits,
    #: `EdgeScores.top(own_copies=True)`), in ungrouped units
    own_copies: bool = False
    _kept: dict[tuple[int, bool, str], Circuit] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.selection not in ("top", "greedy"):
            raise ValueError(f"selection={self.selection!r}: expected 'top' or 'greedy'")

    def pick(
        self, n: int, *, absolute: bool = True, units: Validated[Units] = "ungrouped"
    ) -> Circuit:
        """`scores.top(n, ...)` or `.greedy(n, ...)`, chosen on the first call only."""
        key = (n, absolute, units)
        if key not in self._kept:
            choose = self.scores.top if self.selection == "top" else self.scores.greedy
            own = self.own_copies and units == "ungrouped"
            self._kept[key] = choose(n, absolute=absolute, units=units, own_copies=own)
        return self._kept[key]

    def at(
        self, fractions: Sequence[float], *, absolute: bool, units: Validated[Units] = "ungrouped"
    ) -> list[Circuit]:
        """MIB's circuits: for each fraction k, int(k * N) edges (N in `units`) of the ranking by
        score (absolute=False) or |score|, pruned."""
        if units not in UNITS:
            raise ValueError(f"units={units!r}: expected one of {UNITS}")
        total = self.scores.graph.count(units)
        return [self.pick(int(k * total), absolute=absolute, units=units) for k in fractions]


def chosen_for(
    scores: EdgeScores, chosen: ChosenCircuits | None, selection: str, own_copies: bool = False
) -> ChosenCircuits:
    """`chosen` when it holds circuits of these `scores` by `selection` (and `own_copies`), a
    new (empty) one when None; circuits of other scores or another selection are refused."""
    if chosen is None:
        return ChosenCircuits(scores, cast("Selection", selection), own_copies)  # checked there
    if (
        chosen.scores is not scores
        or chosen.selection != selection
        or chosen.own_copies != own_copies
    ):
        raise ValueError(
            f"chosen holds {chosen.selection} circuits (own_copies={chosen.own_copies}) of "
            f"{chosen.scores!r}, asked for {selection} circuits (own_copies={own_copies}) of "
            f"{scores!r}: pass the ChosenCircuits of these scores"
        )
    return chosen


def mib_circuits(
    scores: EdgeScores,
    fractions: Sequence[float],
    *,
    absolute: bool,
    selection: Selection = "top",
    units: Validated[Units] = "ungrouped",
) -> list[Circuit]:
    """The circuits MIB evaluates: for each fraction k, int(k * N) edges (N in `units`) of the
    ranking by score (absolute=False) or |score|, by `EdgeScores.top` or `.greedy`, pruned
    (`ChosenCircuits.at`, to keep them for another caller)."""
    return ChosenCircuits(scores, selection).at(fractions, absolute=absolute, units=units)
