"""Per-query-head key/value edge scores (`EdgeScores.ungrouped_scores`): each query head's copy
of a grouped key/value edge scored as EAP-IG scores it on its ungrouped model, checked against
autograd on TransformerLens 2's ungrouped HookedTransformer (`ungroup_grouped_query_attention`),
against brute force for the exact softmax, and across the two TransformerLens worlds."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import has_bridge, hooked_toy, run_in_other_env

from ra_lens import capture
from ra_lens.capture import to_batch
from ra_lens.circuits import _edges
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.files import export_mib, read_json
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.scores import EdgeScores
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import tiny_model
from ra_lens.weights import layer_weights

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 50], [52, 60])
METHODS = ("eap", "eap-ig", "exact", "exact-ig", "eap-ig-act")
#: Matrix architectures with grouped-query attention (n_kv_heads < n_heads).
GQA_BRIDGE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
GQA_HOOKED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3")
LLAMA_LIKE = dict(
    positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS",
    act_fn="silu", gated_mlp=True,
)  # fmt: skip


def _model(arch: str):
    # Mixtral in float32: the bridge's grouped matmul of experts has no float64 kernel, and
    # TL 2 leaves its router in float32
    dtype = torch.float32 if arch == "mixtral" else torch.float64
    if has_bridge():
        return tiny_model(arch, dtype=dtype, spread=True)
    from ra_lens.toy_models import hooked_matrix_model

    return hooked_matrix_model(arch, dtype=dtype)


def _summed(graph: Graph, ungrouped: torch.Tensor) -> torch.Tensor:
    """The copies of each key/value edge added up: [writer, reader]."""
    out = torch.zeros(len(graph.writers), len(graph.readers), dtype=ungrouped.dtype)
    return out.index_add_(1, graph.ungrouped_target, ungrouped)


def _kv_columns(graph: Graph) -> list[int]:
    return [u for u, (name, _) in enumerate(graph.ungrouped_readers) if name[-3:] in ("<k>", "<v>")]


def _check_copies(scores: EdgeScores, tolerance: float = 1e-6) -> None:
    g = scores.graph
    copies = scores.ungrouped_scores
    assert copies is not None and copies.shape == (len(g.writers), len(g.ungrouped_readers))
    scale = float(scores.scores.abs().max())
    gap = (_summed(g, copies) - scores.scores).abs().max()
    assert float(gap) < tolerance * scale
    # the copies are not equal shares: the query heads of a group read the key differently
    shares = (scores.scores / g.copies[None, :])[:, g.ungrouped_target]
    kv = _kv_columns(g)
    assert float((copies[:, kv] - shares[:, kv]).abs().max()) > 1e-3 * scale
    # every query head's copy has its own score (none left to the last head of its group)
    for h in range(g.n_heads):
        own = [u for u in kv if f".h{h}<" in g.ungrouped_readers[u][0]]
        assert float(copies[:, own].abs().max()) > 1e-3 * scale
    # the other readers keep their grouped scores
    rest = [u for u in range(len(g.ungrouped_readers)) if u not in set(kv)]
    assert torch.equal(copies[:, rest], scores.scores[:, g.ungrouped_target[rest]])


@pytest.mark.parametrize("method", METHODS)
def test_copies_add_up_to_the_grouped_score(method):
    model = tiny_model("llama", dtype=torch.float64, spread=True) if has_bridge() else None
    model = model if model is not None else hooked_toy(**LLAMA_LIKE)
    # 2 integration steps, not 5: the copies add up at every step, so more steps add nothing
    for direction in ("denoise", "noise"):
        scores = attribute(
            model, CLEAN, CORRUPTED, METRIC, method=method, direction=direction, steps=2
        )
        _check_copies(scores)


@pytest.mark.parametrize("arch", GQA_BRIDGE if has_bridge() else GQA_HOOKED)
def test_copies_add_up_on_every_grouped_query_architecture(arch):
    model = _model(arch)
    assert model.cfg.n_key_value_heads < model.cfg.n_heads
    for method in ("eap", "exact"):
        try:
            scores = attribute(model, CLEAN, CORRUPTED, METRIC, method=method)
        except NotImplementedError:  # q/k norms: the exact softmax is refused, eap is not
            assert method == "exact"
            continue
        _check_copies(scores, 1e-6 if model.cfg.dtype == torch.float64 else 1e-4)


def test_multi_head_attention_has_no_copies():
    model = tiny_model("gpt2", dtype=torch.float64) if has_bridge() else hooked_toy()
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap")
    assert scores.ungrouped_scores is None
    g = scores.graph
    assert torch.equal(scores.ungrouped_helps, scores.helps[:, g.ungrouped_target])


# ------------------------------------------------------- ground truth: EAP-IG's ungrouped model


def _writer_diff(model, graph, writer: str, clean, corrupted) -> torch.Tensor:
    """clean - corrupted output of one writer, read from the model's hooks."""
    w = graph.writer(writer)

    def output(tokens):
        if w.kind == "input":
            name = capture.RESID_PRE.format(0)
        else:
            name = (
                capture.Z.format(w.layer) if w.kind == "head" else f"blocks.{w.layer}.hook_mlp_out"
            )
        with torch.no_grad(), capture.recorded(model, [name]) as acts:
            model(tokens.tokens)
        if w.kind == "head":
            W_O = model.blocks[w.layer].attn.W_O.detach()
            return acts[name][:, :, w.head] @ W_O[w.head]
        return acts[name]

    return output(clean) - output(corrupted)


def _ungrouped_derivative(model, reader: str, shift: torch.Tensor, tokens) -> torch.Tensor:
    """d/dt metric(tokens) when only query head h's copy of the key (value) input of an
    ungrouped HookedTransformer moves by t * shift, by autograd on t."""
    layer = int(reader[1 : reader.index(".")])
    head = int(reader[reader.index(".h") + 2 : reader.index("<")])
    kind = reader[-2]
    attn = model.blocks[layer].attn
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    weight = getattr(attn, f"_W_{kind.upper()}")[head // group].detach()
    bias = getattr(attn, f"_b_{kind.upper()}")[head // group].detach()
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    def replace(x, hook):
        assert x.shape[2] == model.cfg.n_heads  # one copy per query head: EAP-IG's setting
        out = x.clone()
        out[:, :, head] = model.blocks[layer].ln1(kept["x"] + t * shift) @ weight + bias
        return out

    hooks = [(capture.RESID_PRE.format(layer), keep), (f"blocks.{layer}.attn.hook_{kind}", replace)]
    with model.hooks(fwd_hooks=hooks):
        value = METRIC(model(tokens.tokens), lengths=tokens.lengths).mean()
    (derivative,) = torch.autograd.grad(value, t)
    return derivative


EDGES = [
    "input->a0.h0<k>", "input->a0.h1<k>", "input->a0.h3<v>", "a0.h2->a1.h0<k>",
    "a0.h1->a1.h1<k>", "m0->a1.h2<v>", "a0.h3->a1.h3<v>", "m0->a1.h3<k>",
]  # fmt: skip


def _ungrouped_twin(grouped_builder):
    twin = grouped_builder()
    twin.set_ungroup_grouped_query_attention(True)
    return twin


@pytest.mark.skipif(has_bridge(), reason="ungrouped key/value heads: HookedTransformer (TL 2)")
@pytest.mark.parametrize("build", ["llama_like", "llama_matrix"])
def test_eap_copy_scores_are_eap_ig_scores_on_the_ungrouped_model(build):
    from ra_lens.toy_models import hooked_matrix_model

    builder = (
        (lambda: hooked_toy(**LLAMA_LIKE))
        if build == "llama_like"
        else (lambda: hooked_matrix_model("llama"))
    )
    model, twin = builder(), _ungrouped_twin(builder)
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    scores = attribute(model, clean, corrupted, METRIC, method="eap")
    g = scores.graph
    u_index = {name: u for u, (name, _) in enumerate(g.ungrouped_readers)}
    assert scores.ungrouped_scores is not None
    for edge in EDGES:
        writer, reader = edge.split("->")
        diff = _writer_diff(model, g, writer, clean, corrupted)
        truth = _ungrouped_derivative(twin, reader, diff, corrupted)
        got = scores.ungrouped_scores[g.writer_index[writer], u_index[reader]]
        assert got.item() == pytest.approx(truth.item(), rel=1e-9, abs=1e-14)
        assert abs(truth.item()) > 1e-7


@pytest.mark.skipif(has_bridge(), reason="ungrouped key/value heads: HookedTransformer (TL 2)")
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_exact_key_copies_are_the_true_effect_of_patching_one_copy(direction):
    """One attention-only layer without norms: the metric is linear in the pattern, so the
    exact score of input->a0.h{h}<k> is the true effect of patching query head h's copy of the
    key in the ungrouped model (the base run with that copy's key from the other run)."""
    settings = dict(
        n_layers=1, attn_only=True, normalization_type=None, positional_embedding_type="rotary",
        n_key_value_heads=2,
    )  # fmt: skip
    model, twin = hooked_toy(**settings), _ungrouped_twin(lambda: hooked_toy(**settings))
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    base, other = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    scores = attribute(model, clean, corrupted, METRIC, method="exact", direction=direction)
    g = scores.graph
    key = "blocks.0.attn.hook_k"
    with torch.no_grad(), capture.recorded(twin, [key]) as acts:
        twin(other.tokens)
    with torch.no_grad():
        before = METRIC(twin(base.tokens), lengths=base.lengths).mean()
    worst = 0.0
    for h in range(g.n_heads):

        def patch(x, hook, h=h):
            out = x.clone()
            out[:, :, h] = acts[key][:, :, h]
            return out

        with torch.no_grad(), twin.hooks(fwd_hooks=[(key, patch)]):
            after = METRIC(twin(base.tokens), lengths=base.lengths).mean()
        u = [name for name, _ in g.ungrouped_readers].index(f"a0.h{h}<k>")
        got = scores.ungrouped_scores[g.writer_index["input"], u].item()
        true = (after - before).item()
        assert abs(true) > 1e-6
        worst = max(worst, abs(got - true))
    assert worst < 1e-10


# TL 2's ra-lens scores of the same HuggingFace weights, computed in the other environment.
OTHER_ENV_SCORES = """
import sys, torch
from ra_lens.circuits.attribute import attribute
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import hooked_matrix_model
clean, corrupted = {clean!r}, {corrupted!r}
out = {{}}
for arch in sys.argv[2].split(","):
    model = hooked_matrix_model(arch)
    for method in ("eap", "exact"):
        s = attribute(model, clean, corrupted, logit_diff([294, 50], [52, 60]), method=method)
        out[arch, method] = s.ungrouped_scores
torch.save(out, sys.argv[1])
"""
#: Grouped-query architectures TL 2 builds from the same HuggingFace weights.
TL2_ARCHS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def tl2_scores(other_env_python, tmp_path_factory):
    """{(arch, method): TL 2's ungrouped scores} of every TL2_ARCHS, in one start of TL 2."""
    script = OTHER_ENV_SCORES.format(clean=CLEAN, corrupted=CORRUPTED)
    return run_in_other_env(
        other_env_python, script, ",".join(TL2_ARCHS),
        name="tl2_kv_scores.pt", tmp_path_factory=tmp_path_factory,
    )  # fmt: skip


@pytest.mark.skipif(not has_bridge(), reason="compares TL 4 with TL 2 (run from TL 4)")
@pytest.mark.parametrize("arch", TL2_ARCHS)
def test_bridge_copies_equal_hooked_transformer_copies(arch, tl2_scores):
    model = tiny_model(arch, dtype=torch.float64, spread=True)
    for method in ("eap", "exact"):
        ours = attribute(model, CLEAN, CORRUPTED, METRIC, method=method).ungrouped_scores
        kv = _kv_columns(Graph.from_model(model))
        # HuggingFace's eager attention takes its softmax in float32 even in a float64 model
        scale = float(ours.abs().max())
        assert float((ours[:, kv] - tl2_scores[arch, method][:, kv]).abs().max()) < 1e-6 * scale


# ------------------------------------------------------------------- ranking, files, round trip


def _hand_made() -> EdgeScores:
    """One layer, 2 query heads on 1 key/value head; the copies of input->a0.h0<k> differ."""
    g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    s = torch.zeros(len(g.writers), len(g.readers), dtype=torch.float64)
    u = torch.zeros(len(g.writers), len(g.ungrouped_readers), dtype=torch.float64)
    names = [name for name, _ in g.ungrouped_readers]
    values = {
        ("input", "a0.h0<k>"): 5.0, ("input", "a0.h1<k>"): 0.5, ("input", "a0.h0<q>"): 2.0,
        ("a0.h0", "logits"): 2.5, ("input", "logits"): 0.1, ("input", "a0.h0<v>"): -1.0,
        ("input", "a0.h1<v>"): 3.0,
    }  # fmt: skip
    for (w, r), v in values.items():
        u[g.writer_index[w], names.index(r)] = v
    s = _summed(g, u)
    return EdgeScores(g, s, "eap", "denoise", ungrouped_scores=u)


def test_ungrouped_top_ranks_each_copy_by_its_own_score():
    scores = _hand_made()
    # copies: k 5.0 / 0.5 (equal shares would be 2.75 each), v -1.0 / 3.0 (shares 1.0)
    # |score| order: k.h0 5, v.h1 3, h0->logits 2.5, q 2, v.h0 1, k.h1 0.5, ...
    # own copies: each copy on its own, as EAP-IG's apply_topn; head 1 writes nowhere, so its
    # copy of v (3.0) is pruned, as EAP-IG prunes
    four = scores.top(4, units="ungrouped", own_copies=True)
    assert four.per_copy and four.n_edges_ungrouped == 3
    assert four.to_dict()["ungrouped_edges"] == [
        "input->a0.h0<q>", "input->a0.h0<k>", "a0.h0->logits",
    ]  # fmt: skip
    assert scores.top(5, units="ungrouped", own_copies=True).to_dict()["ungrouped_edges"] == [
        "input->a0.h0<q>", "input->a0.h0<k>", "input->a0.h0<v>", "a0.h0->logits",
    ]  # fmt: skip
    # signed: v.h0 (-1.0) ranks last, so v is left out of every circuit but the full one
    assert (
        "input->a0.h0<v>"
        not in scores.top(7, absolute=False, units="ungrouped", own_copies=True).edge_names
    )
    # by default, and without copies, equal shares: k (2.75 each) is kept with 4 edges
    plain = EdgeScores(scores.graph, scores.scores, "eap", "denoise")
    assert "input->a0.h0<k>" in plain.top(4, units="ungrouped").edge_names
    assert scores.top(4, units="ungrouped") == plain.top(4, units="ungrouped")
    assert not plain.top(4, units="ungrouped").per_copy
    # greedy grows EAP-IG's ungrouped graph: h0->logits, then head 0's own q, k, v copies
    grown = scores.greedy(5, units="ungrouped", own_copies=True)
    assert grown.to_dict()["ungrouped_edges"] == [
        "input->a0.h0<q>", "input->a0.h0<k>", "input->a0.h0<v>", "input->logits",
        "a0.h0->logits",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="pass units='ungrouped'"):
        scores.top(4, units="grouped", own_copies=True)


def test_noise_copies_take_mibs_sign():
    scores = _hand_made()
    noise = EdgeScores(
        scores.graph, -scores.scores, "eap", "noise", ungrouped_scores=-scores.ungrouped_scores
    )
    assert torch.equal(noise.ungrouped_helps, scores.ungrouped_helps)
    for n in (3, 5, 7, 9):
        for own in (False, True):
            assert noise.top(n, absolute=False, units="ungrouped", own_copies=own) == scores.top(
                n, absolute=False, units="ungrouped", own_copies=own
            )


def test_export_and_json_round_trip_carry_each_copy(tmp_path):
    scores = _hand_made()
    g = scores.graph
    noise = EdgeScores(g, -scores.scores, "eap", "noise", ungrouped_scores=-scores.ungrouped_scores)
    paths = export_mib(noise, tmp_path / "mib", circuits=True)
    edges = json.loads(paths[0].read_text())["edges"]
    assert edges["input->a0.h0<k>"]["score"] == 5.0  # MIB's sign: the helps of each copy
    assert edges["input->a0.h1<k>"]["score"] == 0.5
    assert edges["input->a0.h1<v>"]["score"] == 3.0
    back = read_json(paths[0], g)
    assert torch.equal(back.ungrouped_scores, scores.ungrouped_scores)
    assert torch.equal(back.scores, scores.scores)
    circuit = scores.top(6, units="ungrouped", own_copies=True)
    circuit.to_json(tmp_path / "c.json")
    again = Circuit.from_json(tmp_path / "c.json", g)
    assert again == circuit and torch.equal(again.ungrouped_scores, circuit.ungrouped_scores)
    # a circuit without copies still writes equal shares
    Circuit(g, circuit.edges, scores=scores.scores).to_json(tmp_path / "plain.json")
    plain = json.loads((tmp_path / "plain.json").read_text())["edges"]
    assert plain["input->a0.h0<k>"]["score"] == plain["input->a0.h1<k>"]["score"] == 2.75


def test_bad_copies_are_refused_naming_the_problem():
    scores = _hand_made()
    g, u = scores.graph, scores.ungrouped_scores
    with pytest.raises(ValueError, match="do not add up to scores: the copies of input->a0.h0<k>"):
        EdgeScores(g, scores.scores, "eap", "denoise", ungrouped_scores=u * 2)
    bad = u.clone()
    bad[0, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite entries, e.g. nan at input->a0.h0<k>"):
        EdgeScores(g, scores.scores, "eap", "denoise", ungrouped_scores=bad)
    with pytest.raises(ValueError, match=r"ungrouped_scores has shape \(4, 3\)"):
        EdgeScores(g, scores.scores, "eap", "denoise", ungrouped_scores=u[:, :3])
    with pytest.raises(ValueError, match="need the grouped scores"):
        Circuit(g, torch.zeros_like(g.real), ungrouped_scores=u)


def test_edge_run_keeps_key_and_value_inputs_only_with_leaves():
    model = tiny_model("llama") if has_bridge() else hooked_toy(**LLAMA_LIKE)
    graph = Graph.from_model(model)
    weights = [layer_weights(model, la) for la in range(graph.n_layers)]
    run = _edges.EdgeRun(graph, weights)
    with torch.no_grad(), model.hooks(fwd_hooks=run.hooks(model)):
        model(model.to_tokens("Q: hot"))
    assert run.kv_inputs == {}
