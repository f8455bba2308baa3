"""The head-ranking experiment's registry of rankings (experiments/ranking_registry.py)."""

from __future__ import annotations

import pytest

from ra_lens import ranking as rk
from ra_lens.experiments.ranking_registry import RANKINGS, RankingSpec, check_rankings, register


def test_the_registry_lists_functions_and_refuses_duplicates():
    assert all(spec.function.__name__ != "<lambda>" for spec in RANKINGS.values())
    assert all(spec.name == name for name, spec in RANKINGS.items())
    registry = dict(RANKINGS)
    with pytest.raises(ValueError, match="'ra' is already registered"):
        register(registry, RankingSpec("ra", rk.ra_ranking, "again"))
    assert registry == RANKINGS  # the refused spec left the registry as it was


def test_check_rankings_orders_as_the_registry_and_always_keeps_ra():
    assert check_rankings(["layer", "forward", "layer"]) == ["ra", "forward", "layer"]
    with pytest.raises(ValueError, match="unknown ranking 'nope': choose from ra, ra_loss_row"):
        check_rankings(["forward", "nope"])
