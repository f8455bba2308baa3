"""The one pair/batch layer (`ra_lens.pairs`, `Batch.rows`, `Metric[rows]`): rows, chunks and
per-row metrics give exactly what the whole batch gives, and bad pairs are refused by name."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens import capture, circuits, pairs
from ra_lens.metrics import CompletionNLL, logit_diff
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), seed=3)


PROMPTS = ["I like Italy", "Q: hot", "Q: big", "I like Paris"]


def test_chunks_cover_every_row_once():
    for n in range(1, 9):
        for size in range(1, 10):
            got = [i for rows in pairs.chunks(n, size) for i in range(n)[rows]]
            assert got == list(range(n))
            assert all(r.stop - r.start <= size for r in pairs.chunks(n, size))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        pairs.chunks(3, 0)


def test_batch_rows_full_width_and_trimmed(model):
    batch = capture.to_batch(model, PROMPTS)
    rows = slice(1, 3)
    full = batch.rows(rows)
    assert torch.equal(full.tokens, batch.tokens[1:3]) and torch.equal(
        full.lengths, batch.lengths[1:3]
    )
    trimmed = batch.rows(rows, trim=True)
    width = int(batch.lengths[1:3].max())
    assert trimmed.tokens.shape == (2, width) and width < batch.tokens.shape[1]
    assert torch.equal(trimmed.tokens, batch.tokens[1:3, :width])
    with pytest.raises(TypeError, match="slice"):
        batch.rows([0, 1])  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="none selected"):
        batch.rows(slice(4, 6))


def test_metric_rows_on_chunks_equal_the_whole_batch(model):
    """The metric of each chunk on that chunk's logits = the whole batch's values, row by row,
    for a per-prompt-target metric and one holding token tensors of the whole batch."""
    batch = capture.to_batch(model, PROMPTS)
    n = len(PROMPTS)
    with torch.no_grad():
        logits = model(batch.tokens)
    metrics = [
        logit_diff([5, 7, 9, 11], [6, 8, 10, 12]),
        CompletionNLL(batch.tokens, [3, 2, 2, 3]),
    ]
    for metric in metrics:
        whole = pairs.metric_values(metric, logits, batch)
        for size in (1, 3):
            parts = []
            for rows in pairs.chunks(n, size):
                part = batch.rows(rows)
                with torch.no_grad():
                    part_logits = model(part.tokens)
                parts.append(
                    pairs.metric_values(pairs.metric_rows(metric, rows, n), part_logits, part)
                )
            torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_metric_rows_refuses_a_plain_callable_split(model):
    def plain(logits):
        return logits[:, -1, 0]

    assert pairs.metric_rows(plain, slice(0, 4), 4) is plain  # all rows: used as it is
    with pytest.raises(ValueError, match="batch_size >= 4"):
        pairs.metric_rows(plain, slice(0, 2), 4)


def test_pair_scores_with_a_plain_callable_names_what_it_takes(model):
    """pair_scores cuts the metric pair by pair and has no batch_size; the message used to end
    "pass batch_size >= 2". It names the metrics pair_scores takes, and they work."""
    clean, corrupted = ["I like Italy", "I like Paris"], ["I like Paris", "I like Italy"]
    with pytest.raises(ValueError) as error:
        circuits.pair_scores(model, clean, corrupted, lambda logits: logits[:, -1, 5])
    assert str(error.value) == (
        "the metric is a plain callable, which ra-lens cannot cut to pairs 0..0 of 2: pass a "
        "metric from ra_lens.metrics (e.g. ra_lens.metrics.logit_diff(correct, wrong) with one "
        "token per pair, or ra_lens.tasks.ioi.paired_batch's); circuits.pair_scores, which "
        "scores each pair alone, takes only such a metric, while circuits.attribute and the "
        "faithfulness calls also take a plain callable with batch_size >= 2 (all pairs in one "
        "batch)"
    )
    scores = circuits.pair_scores(model, clean, corrupted, logit_diff([5, 6], [7, 8]))
    assert scores.per_pair is not None and scores.per_pair.shape[0] == 2
    assert float(scores.per_pair.abs().sum()) > 0


def test_metric_values_refuses_a_scalar_and_non_finite(model):
    batch = capture.to_batch(model, ["Q: hot", "Q: big"])
    logits = torch.zeros(2, batch.tokens.shape[1], 10)
    with pytest.raises(ValueError, match="one value per prompt"):
        pairs.metric_values(logit_diff([1, 2], [3, 4]).mean(), logits, batch)
    with pytest.raises(ValueError, match="non-finite"):
        pairs.metric_values(lambda lg, lengths: lg[:, 0, 0] / 0.0, logits, batch)


def test_paired_refuses_by_pair_and_count(model):
    clean, corrupted = pairs.paired(model, ["I like Italy", "Q: hot"], ["I like Paris", "Q: hot"])
    assert torch.equal(clean.lengths, corrupted.lengths)
    with pytest.raises(ValueError, match="pair 1: clean has 7 tokens, corrupted 6"):
        pairs.paired(model, ["I like Italy", "Q: hot"], ["I like Paris", "Q: big"])
    with pytest.raises(ValueError, match="2 clean but 1 corrupted"):
        pairs.paired(model, ["Q: hot", "Q: big"], ["Q: hot"])


def test_every_family_uses_the_one_layer():
    """Rankings, attribution, circuits and the experiments import the same functions, and no
    other module defines its own copy."""
    compute, attribute, faithfulness, study, engine = (
        importlib.import_module(f"ra_lens.{name}")
        for name in (
            "attribution.compute",
            "circuits.attribute",
            "circuits.faithfulness",
            "experiments.attention_attribution",
            "ranking.engine",
        )
    )
    for module in (compute, attribute, faithfulness, engine):
        assert module.pairs is pairs
    assert study.metric_rows is pairs.metric_rows
    for module in (compute, engine):
        assert not hasattr(module, "check_pairs") and not hasattr(module, "chunks")
