"""Edge patching (`circuits.faithfulness`) and edge scores (`circuits.attribute`), float64 tiny
models, both TransformerLens worlds: GPT-2-like and Llama-like (grouped-query, rotary)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import LLAMA_LIKE, circuit_toy, has_bridge, hooked_toy, one_layer_model, snapshot

from ra_lens import capture, state
from ra_lens.capture import to_batch
from ra_lens.circuits import _edges
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.faithfulness import FaithfulnessEvaluator, faithfulness
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.nodes import NodeScores, attribute_nodes
from ra_lens.contract import model_facts
from ra_lens.metrics import logit_diff
from ra_lens.toy_models import tiny_model

# Pair 0 is shorter than pair 1: the batch is right-padded.
CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 50], [52, 60])


LLAMA_ATTENTION = dict(positional_embedding_type="rotary", n_key_value_heads=2)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    model = circuit_toy(request.param)
    with torch.no_grad():  # a bridge adds its own pre-hooks on its first forward pass
        model(model.to_tokens("Q: hot"))
    return model


@pytest.fixture(scope="module")
def batches(model):
    return to_batch(model, CLEAN), to_batch(model, CORRUPTED)


def _writer_outputs(model, tokens) -> torch.Tensor:
    """Every writer's output, read independently of _edges: [writer batch pos d_model]."""
    n_layers = model.cfg.n_layers
    names = [capture.RESID_PRE.format(0)]
    for layer in range(n_layers):
        names += [capture.Z.format(layer), f"blocks.{layer}.hook_mlp_out"]
    with torch.no_grad(), capture.recorded(model, names) as acts:
        model(tokens)
    outs = [acts[names[0]][None]]
    for layer in range(n_layers):
        z, W_O = acts[capture.Z.format(layer)], model.blocks[layer].attn.W_O.detach()
        outs.append(torch.einsum("bphe,hed->hbpd", z, W_O))
        mlp = f"blocks.{layer}.hook_mlp_out"
        if mlp in acts:
            outs.append(acts[mlp][None])
    return torch.cat(outs)


def _shift_reader(model, graph, reader: str, shift: torch.Tensor):
    """A hand-written hook: reader's input (only) moved by `shift` [batch pos d_model]."""
    r = graph.reader(reader)
    if r.kind == "logits":
        name = f"blocks.{graph.n_layers - 1}.hook_resid_post"
        return [(name, lambda x, hook: x + shift)]
    if r.kind == "mlp":
        return [(model_facts(model).mlp_in[r.layer], lambda x, hook: x + shift)]
    kept = {}
    attn = model.blocks[r.layer].attn
    weight = getattr(attn, f"_W_{r.kind.upper()}", None)
    weight = getattr(attn, f"W_{r.kind.upper()}") if weight is None else weight
    bias_name = f"b_{r.kind.upper()}"
    bias = getattr(attn, "_" + bias_name, None)
    bias = getattr(attn, bias_name, None) if bias is None else bias

    def keep(x, hook):
        kept["x"] = x

    def replace(x, hook):
        moved = model.blocks[r.layer].ln1(kept["x"] + shift) @ weight[r.head].detach()
        out = x.clone()
        out[:, :, r.head] = moved + (0 if bias is None else bias[r.head].detach())
        return out

    return [
        (capture.RESID_PRE.format(r.layer), keep),
        (f"blocks.{r.layer}.attn.hook_{r.kind}", replace),
    ]


@contextlib.contextmanager
def _mlp_in_on(model):
    """HookedTransformer's hook_mlp_in switched on for the block, and back (preserved_state)."""
    with capture.preserved_state(model):
        state.enable_mlp_in(model)
        yield


def _metric_with(model, tokens, hooks):
    with torch.no_grad(), _mlp_in_on(model), model.hooks(fwd_hooks=hooks):
        return METRIC(model(tokens.tokens), lengths=tokens.lengths)


# ---------------------------------------------------------------------------------- faithfulness


def test_full_and_empty_circuits_are_exact(model, batches):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    before = snapshot(model)
    full = faithfulness(model, Circuit(graph, graph.real.clone()), clean, corrupted, METRIC)
    empty = faithfulness(
        model, Circuit(graph, torch.zeros_like(graph.real)), clean, corrupted, METRIC
    )
    with torch.no_grad():
        clean_m = METRIC(model(clean.tokens), lengths=clean.lengths).mean()
    assert abs(full.circuit_metric - float(clean_m)) < 1e-10
    assert full.value == pytest.approx(1.0, abs=1e-10)
    assert empty.value == pytest.approx(0.0, abs=1e-10)
    assert abs(empty.circuit_metric - empty.corrupted_metric) < 1e-10
    assert full.n_edges == graph.n_edges and empty.n_edges == 0
    assert torch.allclose(full.per_pair, torch.ones(2, dtype=torch.float64), atol=1e-9)
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]
    assert getattr(model.cfg, "use_hook_mlp_in", False) is False


@pytest.mark.parametrize("edge", ["a0.h1->a1.h2<q>", "input->a1.h1<k>", "a0.h3->a1.h0<v>",
                                  "a0.h0->m1", "m0->logits"])  # fmt: skip
def test_patching_one_edge_equals_a_hand_written_hook(model, batches, edge):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    w, r = graph.edge_index(edge)
    edges = graph.real.clone()
    edges[w, r] = False
    result = faithfulness(model, Circuit(graph, edges), clean, corrupted, METRIC)
    shift = _writer_outputs(model, corrupted.tokens)[w] - _writer_outputs(model, clean.tokens)[w]
    expected = _metric_with(model, clean, _shift_reader(model, graph, graph.readers[r], shift))
    assert torch.allclose(result.circuit_per_pair, expected.double(), atol=1e-10)
    assert abs(result.circuit_metric - result.clean_metric) > 1e-8  # the edge matters


def test_ablating_heads_equals_patching_their_hook_z(model, batches):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    dropped = [(0, 1), (1, 2), (1, 3)]
    edges = graph.real.clone()
    for layer, head in dropped:
        edges[graph.writer_index[f"a{layer}.h{head}"]] = False
    result = faithfulness(model, Circuit(graph, edges), clean, corrupted, METRIC)
    with torch.no_grad(), capture.recorded(model, [capture.Z.format(la) for la in (0, 1)]) as z:
        model(corrupted.tokens)

    def patch(layer, heads):
        def hook(value, hook):
            value = value.clone()
            value[:, :, heads] = z[capture.Z.format(layer)][:, :, heads]
            return value

        return (capture.Z.format(layer), hook)

    expected = _metric_with(model, clean, [patch(0, [1]), patch(1, [2, 3])])
    assert torch.allclose(result.circuit_per_pair, expected.double(), atol=1e-10)


def test_mean_and_zero_ablation(model, batches):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    edges = graph.real.clone()
    edges[graph.writer_index["m0"]] = False  # m0's output ablated wherever it is read
    zero = faithfulness(model, Circuit(graph, edges), clean, corrupted, METRIC, ablation="zero")
    hook = ("blocks.0.hook_mlp_out", lambda x, hook: torch.zeros_like(x))
    expected = _metric_with(model, clean, [hook])
    assert torch.allclose(zero.circuit_per_pair, expected.double(), atol=1e-10)
    mean = faithfulness(model, Circuit(graph, edges), clean, corrupted, METRIC, ablation="mean")
    outs = _writer_outputs(model, corrupted.tokens)[graph.writer_index["m0"]]
    real = corrupted.real_mask()[:, :, None].double()
    average = (outs * real).sum(0) / real.sum(0)
    hook = ("blocks.0.hook_mlp_out", lambda x, hook: average[None].expand_as(x).clone())
    expected = _metric_with(model, clean, [hook])
    assert torch.allclose(mean.circuit_per_pair, expected.double(), atol=1e-10)


@pytest.mark.parametrize("ablation", ["patching", "mean", "zero"])
def test_evaluator_gives_faithfulness_of_each_circuit_in_turn(model, batches, ablation):
    # The evaluator takes the clean and corrupted runs once; every circuit after that must get
    # what a fresh faithfulness call gives, and the model must be left as it was.
    clean, corrupted = batches
    graph = Graph.from_model(model)
    before = snapshot(model)
    evaluate = FaithfulnessEvaluator(
        model, clean, corrupted, METRIC, ablation=ablation, batch_size=1
    )
    generator = torch.Generator().manual_seed(0)
    for keep in (0.1, 0.5, 0.9):
        edges = graph.real & (torch.rand(graph.real.shape, generator=generator) < keep)
        circuit = Circuit(graph, edges)
        got = evaluate(circuit)
        fresh = faithfulness(model, circuit, clean, corrupted, METRIC, ablation=ablation)
        assert torch.allclose(got.circuit_per_pair, fresh.circuit_per_pair, atol=1e-10)
        assert got.value == pytest.approx(fresh.value, abs=1e-9)
        assert got.n_edges == fresh.n_edges and got.ablation == ablation
    assert abs(got.value - evaluate(Circuit(graph, graph.real.clone())).value) > 1e-6
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]


def test_small_circuits_sum_the_kept_side(model, batches, monkeypatch):
    # A reader that keeps few edges gets (all writers' diffs) - (its kept ones'): the same
    # delta as summing the patched ones directly, which is the only path forced here.
    clean, corrupted = batches
    graph = Graph.from_model(model)
    generator = torch.Generator().manual_seed(1)
    circuits_ = [Circuit(graph, graph.real & (torch.rand(graph.real.shape, generator=generator) < keep))
                 for keep in (0.0, 0.3, 0.45)]  # fmt: skip
    evaluate = FaithfulnessEvaluator(model, clean, corrupted, METRIC, ablation="mean")
    fast = [evaluate(c).circuit_per_pair for c in circuits_]
    monkeypatch.setattr(
        _edges.EdgeRun, "_patched_sum", lambda run, cols, readers: run._weighted(cols)
    )
    for circuit, got in zip(circuits_, fast, strict=True):
        direct = evaluate(circuit).circuit_per_pair
        assert torch.allclose(got, direct, atol=1e-10)
    assert not torch.allclose(fast[1], fast[2], atol=1e-6)  # the circuits differ


def test_faithfulness_refuses_bad_input(model, batches):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    circuit = Circuit(graph, graph.real.clone())
    with pytest.raises(ValueError, match="unknown ablation"):
        faithfulness(model, circuit, clean, corrupted, METRIC, ablation="resample")
    other = Graph(graph.n_layers + 1, graph.n_heads, graph.n_kv_heads, graph.d_model)
    with pytest.raises(ValueError, match="Graph.from_model"):
        faithfulness(model, Circuit(other, other.real), clean, corrupted, METRIC)
    with pytest.raises(ValueError, match="batch_size"):
        faithfulness(
            model, circuit, clean, corrupted, lambda logits: logits[:, -1, 0], batch_size=1
        )


# ---------------------------------------------------------------------------------- attribute


@pytest.mark.parametrize("edge", ["a0.h1->a1.h2<q>", "input->a0.h1<k>", "a0.h3->a1.h0<v>",
                                  "a0.h0->m1", "m0->logits"])  # fmt: skip
def test_eap_is_the_directional_derivative(model, batches, edge):
    clean, corrupted = batches
    graph = Graph.from_model(model)
    scores = attribute(model, clean, corrupted, METRIC, method="eap").scores
    w, r = graph.edge_index(edge)
    diff = _writer_outputs(model, clean.tokens)[w] - _writer_outputs(model, corrupted.tokens)[w]
    # d/dt metric(corrupted run, reader's input + t * diff) at t = 0, by autograd on t alone.
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    hooks = _shift_reader(model, graph, graph.readers[r], t * diff)
    with _mlp_in_on(model), model.hooks(fwd_hooks=hooks):
        value = METRIC(model(corrupted.tokens), lengths=corrupted.lengths).mean()
    (derivative,) = torch.autograd.grad(value, t)
    assert scores[w, r].item() == pytest.approx(derivative.item(), rel=1e-6)
    assert abs(derivative.item()) > 1e-8


def test_scores_are_zero_off_the_graph_and_leave_the_model(model, batches):
    clean, corrupted = batches
    before = snapshot(model)
    for method in ("eap", "exact"):
        scores = attribute(model, clean, corrupted, METRIC, method=method)
        assert bool(scores.scores[~scores.graph.real].eq(0).all())
        assert scores.scores[scores.graph.real].abs().sum() > 0
        assert not scores.scores.requires_grad  # plain numbers, in both TL worlds
    after = snapshot(model)
    assert after[:2] == before[:2] and after[3] == before[3]
    assert all(g is None for g in after[2])


def test_eap_ig_one_step_is_eap_and_converges(model, batches):
    clean, corrupted = batches
    eap = attribute(model, clean, corrupted, METRIC, method="eap").scores
    one = attribute(model, clean, corrupted, METRIC, method="eap-ig", steps=1).scores
    assert torch.equal(one, eap)
    ig = {
        s: attribute(model, clean, corrupted, METRIC, method="eap-ig", steps=s).scores
        for s in (2, 8, 16)
    }
    assert (ig[8] - ig[16]).abs().max() < 0.25 * (eap - ig[2]).abs().max()
    exact_one = attribute(model, clean, corrupted, METRIC, method="exact-ig", steps=1).scores
    assert torch.equal(exact_one, attribute(model, clean, corrupted, METRIC, method="exact").scores)


def test_batches_and_padding_do_not_change_scores(model, batches):
    clean, corrupted = batches
    together = attribute(model, clean, corrupted, METRIC, method="exact", batch_size=2).scores
    apart = attribute(model, clean, corrupted, METRIC, method="exact", batch_size=1).scores
    assert torch.allclose(together, apart, atol=1e-12)
    alone = [
        attribute(model, c, k, logit_diff([t], [f]), method="exact").scores
        for c, k, t, f in zip(CLEAN, CORRUPTED, [294, 50], [52, 60])
    ]
    # Alone, each prompt has its own length: HuggingFace computes the rotary tables in float32
    # (a matmul whose rounding depends on the length), so equal up to float32 rounding only.
    tolerance = 1e-6 * float(together.abs().max())
    assert torch.allclose(together, (alone[0] + alone[1]) / 2, rtol=0, atol=tolerance)


def test_node_scores_sum_edges(model, batches):
    clean, corrupted = batches
    edges = attribute(model, clean, corrupted, METRIC, method="eap").scores
    nodes = attribute_nodes(model, clean, corrupted, METRIC, method="eap")
    assert isinstance(nodes, NodeScores)
    assert torch.allclose(nodes.writers, edges.sum(1)) and torch.allclose(
        nodes.readers, edges.sum(0)
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_exact_query_and_key_edges_are_the_true_effect(kind, direction):
    if kind == "llama" and has_bridge():
        pytest.skip(
            "TL 4: boot_native's rotary attention does not fire hook_rot_q, and the Llama "
            "bridge's RMSNorms make R . (A' - A) inexact; covered under TL 2"
        )
    # one layer, attention only, no norms: R . (A' - A) is the true effect of a pattern change
    model = one_layer_model(**(LLAMA_ATTENTION if kind == "llama" else {}))
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    graph = Graph.from_model(model)
    exact = attribute(model, clean, corrupted, METRIC, method="exact", direction=direction).scores
    eap = attribute(model, clean, corrupted, METRIC, method="eap", direction=direction).scores
    # The true effect: the base run with one edge patched (faithfulness of all-but-that-edge,
    # run on the base prompts with the other prompts as the source).
    base, other = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    readers = [i for i, name in enumerate(graph.readers) if name.endswith(("<q>", "<k>"))]
    worst_exact = worst_eap = 0.0
    for r in readers:
        for w in (0,):  # the embeddings: the only writer before layer 0
            edges = graph.real.clone()
            edges[w, r] = False
            result = faithfulness(model, Circuit(graph, edges), base, other, METRIC)
            true = result.circuit_metric - result.clean_metric
            worst_exact = max(worst_exact, abs(exact[w, r].item() - true))
            worst_eap = max(worst_eap, abs(eap[w, r].item() - true) / (abs(true) + 1e-12))
    assert worst_exact < 1e-10
    assert worst_eap > 1e-3  # the first-order estimate is not the true effect


def test_attribute_refuses_bad_input(model, batches):
    clean, corrupted = batches
    for kwargs, message in [
        (dict(method="atp"), "unknown method"),
        (dict(direction="up"), "unknown direction"),
        (dict(method="eap-ig", steps=0), "steps"),
    ]:
        with pytest.raises(ValueError, match=message):
            attribute(model, clean, corrupted, METRIC, **kwargs)
    with pytest.raises(ValueError, match="token length"):
        attribute(model, CLEAN[0], CLEAN[1], METRIC)


# ---------------------------------------------------------------------------------- bad input

NO_CONTRAST = (
    "so there is no behaviour for a circuit to keep: faithfulness, (m(circuit) - m(empty)) / "
    "(m(clean) - m(empty)), divides by 0 under patching, where the empty circuit is the "
    "corrupted run; give pairs on which the metric differs (identical prompts, answer == wrong, "
    "or corrupted prompts that are the clean ones in another order give none)"
)


def test_pairs_without_contrast_are_refused_and_leave_the_model(model, batches):
    """Faithfulness divides by m(clean) - m(empty), m(corrupted) under patching: identical
    prompts, answer == wrong and pairs that swap the same two prompts make it 0."""
    clean, corrupted = batches
    graph = Graph.from_model(model)
    before = snapshot(model)
    swapped = (CLEAN[:1] + CORRUPTED[:1], CORRUPTED[:1] + CLEAN[:1])  # both of one length
    cases = [
        (clean, clean, METRIC),
        (clean, corrupted, logit_diff([294, 50], [294, 50])),  # answer == wrong: exactly 0
        (*swapped, logit_diff([294, 294], [52, 52])),
    ]
    for clean_side, corrupted_side, metric in cases:
        with pytest.raises(ValueError) as error:
            FaithfulnessEvaluator(model, clean_side, corrupted_side, metric)
        assert str(error.value).startswith(
            "the clean and corrupted prompts give the same mean metric ("
        )
        assert str(error.value).endswith(NO_CONTRAST)
        with pytest.raises(ValueError, match="give the same mean metric"):
            faithfulness(model, Circuit.full(graph), clean_side, corrupted_side, metric)
    with pytest.raises(ValueError) as error:
        FaithfulnessEvaluator(model, clean, corrupted, logit_diff([294, 50], [294, 50]))
    assert str(error.value) == f"the clean and corrupted prompts give the same mean metric (0 and 0), {NO_CONTRAST}"  # fmt: skip
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]


def test_a_pair_without_contrast_has_a_nan_ratio_not_an_infinite_one(model, batches):
    """Pair 0 is the same prompt twice: under patching its empty circuit is its clean run, so its
    own ratio is undefined (nan), while the mean over pairs is defined; under mean or zero
    ablation its empty circuit differs from its clean run (MIB's baseline), and it is defined."""
    clean, corrupted = batches
    graph = Graph.from_model(model)
    same_first = [CLEAN[0], CORRUPTED[1]]
    for ablation in ("patching", "mean", "zero"):
        result = faithfulness(
            model, Circuit.empty(graph), CLEAN, same_first, METRIC, ablation=ablation
        )
        assert math.isnan(result.per_pair[0]) == (ablation == "patching"), ablation
        assert math.isfinite(result.per_pair[1]) and math.isfinite(result.value)


@pytest.mark.skipif(has_bridge(), reason="TransformerBridge has no ungrouped key/value heads")
def test_ungrouped_grouped_query_attention_is_refused_naming_the_flag():
    """EAP-IG's setting repeats each key/value head per query head in hook_k/hook_v."""
    model = hooked_toy(**LLAMA_LIKE, ungroup_grouped_query_attention=True)
    graph = Graph.from_model(model)
    before = snapshot(model)
    calls = [
        lambda: attribute(model, CLEAN, CORRUPTED, METRIC, method="eap"),
        lambda: attribute(model, CLEAN, CORRUPTED, METRIC, method="exact"),
        lambda: faithfulness(model, Circuit.full(graph), CLEAN, CORRUPTED, METRIC),
    ]
    for call in calls:
        with pytest.raises(NotImplementedError) as error:
            call()
        assert str(error.value) == (
            "cfg.ungroup_grouped_query_attention=True: hook_k/hook_v hold a copy of each "
            "key/value head per query head, while ra_lens.circuits patches and scores key/value "
            "inputs per key/value head; call model.set_ungroup_grouped_query_attention(False) "
            "(the model computes the same either way; circuit files still list key/value edges "
            "per query head, as EAP-IG reads them)"
        )
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]
    model.set_ungroup_grouped_query_attention(False)  # the fix the message names
    grouped = hooked_toy(**LLAMA_LIKE)  # the same weights (same seed)
    scores = attribute(model, CLEAN, CORRUPTED, METRIC, method="eap").scores
    assert torch.equal(scores, attribute(grouped, CLEAN, CORRUPTED, METRIC, method="eap").scores)


def test_the_model_argument_is_checked():
    not_tl = (
        "NoneType has no hook_dict/cfg/hooks(): ra_lens needs a TransformerLens model "
        "(HookedTransformer or TransformerBridge), e.g. ra_lens.load_model() or "
        "TransformerBridge.boot_transformers(name)"
    )
    meta = circuit_toy("gpt2").to("meta")
    for call in (
        lambda m: attribute(m, CLEAN, CORRUPTED, METRIC, method="eap"),
        lambda m: FaithfulnessEvaluator(m, CLEAN, CORRUPTED, METRIC),
    ):
        with pytest.raises(TypeError) as error:
            call(None)
        assert str(error.value) == not_tl
        with pytest.raises(ValueError) as error:
            call(meta)
        assert str(error.value).startswith(
            "the model's weights are on the meta device (the model was built without them): "
            "load them first, e.g. with ra_lens.load_model, or model.to_empty(device=...) then "
            "model.load_state_dict(...) (weights accelerate offloads with device_map are fine);"
        )


@pytest.mark.parametrize("method", ["eap", "exact"])
def test_a_metric_without_gradient_is_refused_and_leaves_the_model(model, batches, method):
    clean, corrupted = batches
    before = snapshot(model)

    def detached(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return METRIC(logits.detach(), lengths=lengths)

    with pytest.raises(ValueError) as error:
        attribute(model, clean, corrupted, detached, method=method)
    assert str(error.value) == (
        "the metric's values have no gradient path to the logits: edge scores differentiate the "
        "metric, so compute it from the logits without .detach(), .item(), argmax or "
        "torch.no_grad()"
    )
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]


@pytest.mark.skipif(has_bridge(), reason="HookedTransformer (TransformerLens 2.x) only")
def test_parallel_blocks_on_hooked_transformer_are_exact():
    """TL 2's parallel attention/MLP blocks (Pythia, GPT-J): the MLP reads resid_pre (its
    hook_mlp_in), not the heads of its own layer; full and empty circuits exact, and dropping a
    head's edges is patching its hook_z."""
    model = hooked_toy(parallel_attn_mlp=True)
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    graph = Graph.from_model(model)
    assert graph.parallel_attn_mlp and not bool(graph.real[graph.writer_index["a1.h0"], -2])
    full = faithfulness(model, Circuit(graph, graph.real.clone()), clean, corrupted, METRIC)
    empty = faithfulness(
        model, Circuit(graph, torch.zeros_like(graph.real)), clean, corrupted, METRIC
    )
    assert full.value == pytest.approx(1.0, abs=1e-9) and empty.value == pytest.approx(
        0.0, abs=1e-9
    )
    edges = graph.real.clone()
    edges[graph.writer_index["a0.h1"]] = False
    result = faithfulness(model, Circuit(graph, edges), clean, corrupted, METRIC)
    with torch.no_grad(), capture.recorded(model, [capture.Z.format(0)]) as z:
        model(corrupted.tokens)

    def patch(value, hook):
        value = value.clone()
        value[:, :, 1] = z[capture.Z.format(0)][:, :, 1]
        return value

    expected = _metric_with(model, clean, [(capture.Z.format(0), patch)])
    assert torch.allclose(result.circuit_per_pair, expected.double(), atol=1e-10)
    scores = attribute(model, clean, corrupted, METRIC, method="exact")
    assert bool(scores.scores.abs().gt(0).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_methods_run_in_half_precision_close_to_float32(dtype):
    """The recomputed softmax is checked at half precision's own tolerance (it used to refuse
    every half-precision model, blaming soft-capping or rotary), and its scores stay near the
    float32 model's."""
    kind = "llama"
    half = tiny_model(kind, dtype=dtype) if has_bridge() else hooked_toy(**LLAMA_LIKE).to(dtype)
    full = tiny_model(kind) if has_bridge() else hooked_toy(**LLAMA_LIKE).to(torch.float32)
    got = attribute(half, CLEAN, CORRUPTED, METRIC, method="exact").scores
    expected = attribute(full, CLEAN, CORRUPTED, METRIC, method="exact").scores
    scale = float(expected.abs().max())
    assert scale > 0 and float((got - expected).abs().max()) < 0.1 * scale
