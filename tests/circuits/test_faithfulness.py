"""`circuits.Faithfulness`: a one-line repr and a per-pair table."""

from __future__ import annotations

import torch

from ra_lens.circuits.faithfulness import Faithfulness


def test_repr_is_one_line_and_table_has_a_row_per_pair() -> None:
    t = torch.tensor
    result = Faithfulness(
        value=0.5, per_pair=t([0.25, 0.75]), circuit_metric=1.0, clean_metric=2.0,
        corrupted_metric=0.0, n_edges=12, circuit_per_pair=t([0.5, 1.5]),
        clean_per_pair=t([2.0, 2.0]), corrupted_per_pair=t([0.0, 0.0]), empty_metric=0.0,
        empty_per_pair=t([0.0, 0.0]),
    )  # fmt: skip
    assert repr(result) == "Faithfulness(value=0.5000, 12 edges, 2 pairs, ablation='patching')"
    lines = result.table().splitlines()
    assert lines[0] == repr(result)
    assert lines[4] == "| 0 | 0.5 | 2 | 0 | 0 | 0.2500 |"
    assert lines[5] == "| 1 | 1.5 | 2 | 0 | 0 | 0.7500 |"
    assert lines[6] == "| mean | 1 | 2 | 0 | 0 | 0.5000 |"
