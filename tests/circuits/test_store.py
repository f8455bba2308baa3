"""`circuits._store` through `EdgeScores.load`: a file whose optional tensors are non-finite or
of the wrong shape is refused at load, naming the file and the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ra_lens.circuits import EdgeScores, Graph

GRAPH = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
SHAPE = tuple(GRAPH.real.shape)


def _scores() -> EdgeScores:
    values = torch.rand(SHAPE, dtype=torch.float64) * GRAPH.real
    return EdgeScores(GRAPH, values, "eap", "denoise", per_pair=values[None].expand(2, -1, -1))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "per_pair",
            torch.full((2, *SHAPE), math.nan),
            r"per_pair has 48 non-finite entries, e\.g\. nan",
        ),  # fmt: skip
        (
            "per_pair",
            torch.zeros(0, *SHAPE),
            r"per_pair has shape \(0, 4, 6\), expected",
        ),  # fmt: skip
        (
            "node_scores",
            torch.tensor([0.0, math.inf, 0.0, 0.0]),
            r"node_scores has 1 non-finite entries, e\.g\. inf at index \[1\]",
        ),  # fmt: skip
        ("node_scores", torch.zeros(3), r"node_scores has shape \(3,\), expected"),
    ],
)
def test_bad_optional_tensors_are_refused_at_load_and_construction(
    tmp_path: Path, field: str, value: torch.Tensor, message: str
) -> None:
    good = _scores()
    setattr(good, field, value)  # a file written by hand or by a damaged run
    path = tmp_path / "scores.safetensors"
    good.save(path)
    with pytest.raises(ValueError, match=rf"scores\.safetensors.*{message}"):
        EdgeScores.load(path)
    if "non-finite" not in message:
        return  # the test run's jaxtyping checks refuse a wrong shape before the class does
    with pytest.raises(ValueError, match=message):
        EdgeScores(GRAPH, good.scores, "eap", "denoise", **{field: value})
