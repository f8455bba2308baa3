"""`circuits.ensemble`: normalised, weighted means of edge scores in MIB's sign, every tensor
field combined alike; numbers checked against hand computations."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from ra_lens.circuits import EdgeScores, ensemble
from ra_lens.circuits.graph import Graph

GRAPH = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)


def _scores(seed: int, direction: str = "denoise", **extra) -> EdgeScores:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(GRAPH.real.shape, generator=generator, dtype=torch.float64)
    return EdgeScores(GRAPH, values * GRAPH.real, f"m{seed}", direction, **extra)


def _rms(x: Tensor) -> float:
    return float(x[GRAPH.real].pow(2).mean().sqrt())


def test_identical_scores_give_those_scores_normalised():
    a = _scores(0)
    combined = ensemble([a, a, a])
    torch.testing.assert_close(combined.scores, a.scores / _rms(a.scores), rtol=1e-14, atol=0)
    assert float(combined.scores[GRAPH.real].pow(2).mean()) == pytest.approx(1.0, abs=1e-14)
    assert combined.direction == "denoise"
    assert combined.method == "ensemble(m0:denoise*0.333 + m0:denoise*0.333 + m0:denoise*0.333, rms)"  # fmt: skip


def test_weights_and_normalisations_by_hand():
    s = torch.zeros(GRAPH.real.shape, dtype=torch.float64)
    t = torch.zeros(GRAPH.real.shape, dtype=torch.float64)
    e1, e2 = GRAPH.edge_index("input->a0.h0<q>"), GRAPH.edge_index("a0.h1->logits")
    s[e1], s[e2] = 3.0, -4.0  # rms over the real edges: sqrt(25 / n_edges)
    t[e1], t[e2] = 1.0, 1.0  # rms sqrt(2 / n_edges)
    a = EdgeScores(GRAPH, s, "a", "denoise")
    b = EdgeScores(GRAPH, t, "b", "denoise")
    n = GRAPH.n_edges
    combined = ensemble([a, b], weights=[3.0, 1.0])
    rms_a, rms_b = (25 / n) ** 0.5, (2 / n) ** 0.5
    assert float(combined.scores[e1]) == pytest.approx(0.75 * 3 / rms_a + 0.25 / rms_b, rel=1e-14)
    assert float(combined.scores[e2]) == pytest.approx(-0.75 * 4 / rms_a + 0.25 / rms_b, rel=1e-14)
    assert int((combined.scores != 0).sum()) == 2
    by_max = ensemble([a, b], weights=[1.0, 1.0], normalise="max")
    assert float(by_max.scores[e1]) == pytest.approx(0.5 * 3 / 4 + 0.5 * 1, rel=1e-14)
    assert float(by_max.scores[e2]) == pytest.approx(-0.5 + 0.5, abs=1e-15)
    raw = ensemble([a, b], weights=[1.0, 3.0], normalise="none")
    assert float(raw.scores[e1]) == 0.25 * 3 + 0.75 * 1
    assert float(raw.scores[e2]) == 0.25 * -4 + 0.75 * 1


def test_noise_scores_enter_in_mibs_sign():
    a = _scores(1)
    as_noise = EdgeScores(GRAPH, -a.scores, "m1", "noise")
    torch.testing.assert_close(ensemble([as_noise]).scores, ensemble([a]).scores, rtol=0, atol=0)
    # a denoise and the same numbers as noise cancel: opposite signs in MIB's units
    opposite = EdgeScores(GRAPH, a.scores.clone(), "m1", "noise")
    assert float(ensemble([a, opposite]).scores.abs().max()) == 0.0


def test_signed_rank():
    s = torch.zeros(GRAPH.real.shape, dtype=torch.float64)
    names = ["input->a0.h0<q>", "a0.h1->logits", "input->m0"]
    for name, value in zip(names, [0.5, -2.0, 1.0]):
        s[GRAPH.edge_index(name)] = value
    noise = EdgeScores(GRAPH, -s, "x", "noise", per_pair=-s[None])
    ranked = ensemble([noise], normalise="rank")
    n = GRAPH.n_edges
    assert [float(ranked.scores[GRAPH.edge_index(x)]) for x in names] == [
        (n - 2) / n, -1.0, (n - 1) / n,
    ]  # fmt: skip
    assert ranked.per_pair is None  # a rank of the mean is no mean of anything per pair


def test_every_tensor_field_is_combined_alike():
    g = torch.Generator().manual_seed(3)
    pp_a = torch.randn(4, *GRAPH.real.shape, generator=g, dtype=torch.float64) * GRAPH.real
    pp_b = torch.randn(4, *GRAPH.real.shape, generator=g, dtype=torch.float64) * GRAPH.real
    nodes_a = torch.arange(len(GRAPH.writers), dtype=torch.float64)
    a = EdgeScores(GRAPH, pp_a.mean(0), "a", "denoise", per_pair=pp_a, node_scores=nodes_a, seconds=2.0)  # fmt: skip
    b = EdgeScores(GRAPH, pp_b.mean(0), "b", "noise", per_pair=pp_b, node_scores=nodes_a * 2, seconds=3.5)  # fmt: skip
    combined = ensemble([a, b], weights=[1.0, 2.0])
    ca, cb = 1 / 3 / _rms(a.scores), -2 / 3 / _rms(b.scores)
    torch.testing.assert_close(combined.scores, ca * a.scores + cb * b.scores, rtol=1e-14, atol=1e-16)  # fmt: skip
    torch.testing.assert_close(combined.per_pair, ca * pp_a + cb * pp_b, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(combined.per_pair.mean(0), combined.scores, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(combined.node_scores, (ca + 2 * cb) * nodes_a, rtol=1e-14, atol=0)
    assert combined.seconds == 5.5
    # a field one input lacks, or per_pair over different pairs, is not combined
    c = EdgeScores(GRAPH, pp_b.mean(0), "c", "denoise", per_pair=pp_b[:3])
    mixed = ensemble([a, c])
    assert mixed.per_pair is None and mixed.node_scores is None and mixed.seconds is None


@dataclass
class _WithCopies(EdgeScores):
    """A stand-in for a tensor field added to EdgeScores later (e.g. per-query-head copies)."""

    copies: Tensor | None = None


def test_a_new_tensor_field_is_combined_the_same_way():
    a, b = _scores(4), _scores(5, "noise")
    extra_a = torch.randn(3, 5, dtype=torch.float64)
    extra_b = torch.randn(3, 5, dtype=torch.float64)
    wa = _WithCopies(GRAPH, a.scores, "a", "denoise", copies=extra_a)
    wb = _WithCopies(GRAPH, b.scores, "b", "noise", copies=extra_b)
    combined = ensemble([wa, wb])
    assert isinstance(combined, _WithCopies)
    expected = 0.5 * extra_a / _rms(a.scores) - 0.5 * extra_b / _rms(b.scores)
    torch.testing.assert_close(combined.copies, expected, rtol=1e-14, atol=1e-16)


def test_bad_input_is_refused():
    a = _scores(0)
    other = Graph(n_layers=2, n_heads=2, n_kv_heads=1, d_model=8)
    b = EdgeScores(other, torch.zeros(len(other.writers), len(other.readers)), "b", "denoise")
    with pytest.raises(ValueError, match="at least one"):
        ensemble([])
    with pytest.raises(TypeError, match="pass EdgeScores"):
        ensemble([a, a.scores])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="one model's graph"):
        ensemble([a, b])
    with pytest.raises(ValueError, match="one weight per input"):
        ensemble([a, a], weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        ensemble([a, a], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="sum to 0"):
        ensemble([a, a], weights=[0.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        ensemble([a], weights=[float("nan")])
    with pytest.raises(ValueError, match="normalise"):
        ensemble([a], normalise="z")  # type: ignore[arg-type]
    zero = EdgeScores(GRAPH, torch.zeros(GRAPH.real.shape), "z", "denoise")
    with pytest.raises(ValueError, match="no scale"):
        ensemble([a, zero])


# ------------------------------------------------------------------ Hybrid-Ens (real scores)


def _gqa_toy():
    from helpers import has_bridge, hooked_toy

    from ra_lens.toy_models import tiny_model

    if has_bridge():
        return tiny_model("llama", dtype=torch.float64)
    return hooked_toy(
        positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS"
    )


HYBRID_CLEAN = ["The capital of France is", "When Mary and John went to the store"]
HYBRID_CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]


def test_hybrid_is_the_raw_mean_of_eap_ig_inputs_and_activations_in_mibs_sign():
    """Hybrid-Ens = -(EAP + EAP-IG-inputs + EAP-IG-activations) / 3 in EAP-IG's own raw scores:
    eap (noise) and eap-ig-act (noise) are EAP-IG's EAP and EAP-IG-activations, eap-ig (denoise)
    is minus EAP-IG-inputs, and MIB's sign negates noise scores; copies combined the same way."""
    from ra_lens.circuits import attribute
    from ra_lens.circuits.ensemble import hybrid
    from ra_lens.metrics import logit_diff

    model = _gqa_toy()
    metric = logit_diff([294, 50], [52, 60])
    args = (model, HYBRID_CLEAN, HYBRID_CORRUPTED, metric)
    got = hybrid(*args, steps=2)
    eap = attribute(*args, method="eap", direction="noise")
    inputs = attribute(*args, method="eap-ig", direction="denoise", steps=2)
    acts = attribute(*args, method="eap-ig-act", direction="noise", steps=2)
    for name in ("scores", "ungrouped_scores"):
        want = (-getattr(eap, name) + getattr(inputs, name) - getattr(acts, name)) / 3
        torch.testing.assert_close(getattr(got, name), want, rtol=1e-12, atol=1e-15)
    assert got.direction == "denoise" and got.method.endswith(", none)")
    assert "eap-ig-act:noise*0.333" in got.method
    with pytest.raises(ValueError, match="steps"):  # refused before any pass
        hybrid(*args, steps=0)
