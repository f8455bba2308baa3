"""One whole-number check (`ra_lens.checks.check_count`): every function taking a count refuses
a bad one (below its minimum, True) with the same message naming the parameter."""

from __future__ import annotations

import pytest
import torch

from ra_lens.checks import check_count
from ra_lens.circuits import EdgeScores, Graph, refine, stable
from ra_lens.pairs import chunks
from ra_lens.ranking.statistics import top_recall


def _scores() -> EdgeScores:
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=2, d_model=8)
    values = torch.ones(len(g.writers), len(g.readers), dtype=torch.float64) * g.real
    return EdgeScores(g, values, "eap", "denoise", per_pair=values[None].repeat(2, 1, 1))


#: (call with the count, the parameter's name, its minimum)
CALLERS = [
    (lambda n: chunks(4, n), "batch_size", 1),
    (lambda n: top_recall(torch.ones(3), torch.ones(3), k=n), "k", 1),
    (lambda n: stable(_scores(), n_boot=n), "n_boot", 1),
    (lambda n: refine(_scores(), lambda c: 0.5, candidates=n), "candidates", 0),
    (lambda n: refine(_scores(), lambda c: 0.5, fractions=[0.5, 1.0], budget=n), "budget", 2),
]


@pytest.mark.parametrize("call, name, minimum", CALLERS, ids=[c[1] for c in CALLERS])
# (a float is an int parameter's type error, refused by the test run's type checker first)
@pytest.mark.parametrize("bad", ["below", "far below", True])
def test_every_count_is_refused_with_one_message(call, name, minimum, bad):
    value = {"below": minimum - 1, "far below": minimum - 7}.get(bad, bad)
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= {minimum}\b.*got {value!r}$"):
        call(value)


def test_check_count_passes_a_count_through():
    assert check_count(3, "k") == 3 and check_count(0, "shots", minimum=0) == 0
