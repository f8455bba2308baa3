"""The architecture matrix: every capability on tiny random float64 models of the architectures
researchers study, against ground truth read inside HuggingFace's own attention code
(`helpers.hf_attention_grads`), never against TransformerLens's hooks (which share the adapters'
assumptions). A capability is exact on an architecture or refuses naming the true cause."""

from __future__ import annotations

import contextlib
from functools import cache
from typing import Any

import pytest
import torch
from helpers import REPO_ROOT, has_bridge, hf_attention_grads, hf_qk_factor

import ra_lens
from ra_lens.metrics import target_nll
from ra_lens.toy_models import (
    HOOKED_MATRIX_ARCHITECTURES,
    MATRIX_ARCHITECTURES,
    hf_model,
    hooked_matrix_model,
    tiny_model,
)

PROMPT = "The quick brown fox jumps over"
TARGET = 5
#: MoE's grouped matmul has no float64 kernel: Mixtral runs in float32.
DTYPES = {"mixtral": torch.float32}


@cache
def pair(arch: str) -> tuple[Any, Any]:
    """(the TransformerLens model, its plain HuggingFace twin), both float64 (float32 where
    noted), eval mode: a TransformerBridge under TL 4; under TL 2.18 a HookedTransformer built by
    TL 2's own conversion, for the architectures it can build offline (others skip)."""
    dtype = DTYPES.get(arch, torch.float64)
    if has_bridge():
        model = tiny_model(arch, dtype=dtype, spread=True)
    elif arch in HOOKED_MATRIX_ARCHITECTURES:
        model = hooked_matrix_model(arch, dtype=dtype)
    else:
        pytest.skip(
            f"TransformerLens 2.18 builds no HookedTransformer of {arch} from a local model"
        )
    return model, hf_model(arch, spread=True).to(dtype)


@cache
def hf_truth(arch: str) -> dict[str, list[Any]]:
    """`hf_attention_grads` of `pair(arch)`'s HuggingFace twin on PROMPT for target_nll([TARGET]),
    every convention, read once per architecture (the four RA variants compare against it)."""
    bridge, hf = pair(arch)
    return hf_attention_grads(hf, bridge.to_tokens(PROMPT), target_nll([TARGET]))


def tolerance(arch: str) -> float:
    return 1e-5 if DTYPES.get(arch) == torch.float32 else 1e-9


@pytest.mark.parametrize("memory", ["full", "layerwise"])
@pytest.mark.parametrize("convention", ["qk", "scores"])
@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_ra_is_the_gradient_inside_huggingfaces_attention(
    arch: str, convention: str, memory: str
) -> None:
    """RA ("qk") = dM/d(QK^T) at HF's QK matmul, "scores" = dM/d(softmax input): scale-free
    GPT-Neo, Gemma-2's soft-cap (through the tanh) and final logit cap, ALiBi, windows, qk-norms,
    MoE, partial rotary and parallel blocks; in one backward pass and layer by layer."""
    bridge, hf = pair(arch)
    tokens = bridge.to_tokens(PROMPT)
    metric = target_nll([TARGET])
    truth = hf_truth(arch)[convention]
    ra = ra_lens.reversed_attention(bridge, tokens, metric, convention=convention, memory=memory)
    assert ra.maps is not None and len(truth) == bridge.cfg.n_layers
    for layer, grad in enumerate(truth):
        factor = hf_qk_factor(hf, layer) if convention == "qk" else 1.0
        expected = grad[0].double() * factor
        if convention == "scores":  # masked entries: HF adds a finite minimum, A is 0 there
            expected = expected * (ra.patterns[0, layer] > 0)
        got = ra.maps[0, layer].double()
        assert got.shape == expected.shape
        scale = float(expected.abs().max())
        assert scale > 0
        # maps are float32: compare at float32 precision relative to the largest entry
        assert float((got - expected).abs().max()) <= max(1e-6, tolerance(arch)) * scale * 10


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_exact_query_node_is_the_models_own_changed_row(arch: str) -> None:
    """attention_attribution's exact query node = sum_s R_ts (A'_ts - A_ts), where A' is the
    pattern the model itself computes with head h's query at position t taken from the other run:
    the soft-cap (Gemma-2) and sliding windows (Mistral, Gemma-2) recomputed as the model does."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED

    from ra_lens import capture

    bridge, _ = pair(arch)
    clean, corrupted = TOY_CLEAN[2], TOY_CORRUPTED[2]  # one token apart, 3 before the end
    metric = ra_lens.metrics.logit_diff([5], [7])
    att = ra_lens.attention_attribution(bridge, clean, corrupted, metric, nodes=["query"])
    # layer 0's row at the changed token: its query moves, and the last position (the metric's)
    # still sees it through a 4-token window
    differ = (bridge.to_tokens(clean) != bridge.to_tokens(corrupted))[0].nonzero()
    layer, head, t = 0, 1, int(differ[0])
    # The rotated query where the adapter fires hook_rot_q; else hook_q (the rotation is linear
    # per position, so patching one head's q at t patches its rotated q at t the same way).
    q_name = capture.query_hook_name(bridge, layer)
    with capture.recorded(bridge, [q_name, capture.Q.format(layer)]) as source:
        bridge(bridge.to_tokens(clean))
    if q_name not in source:
        q_name = capture.Q.format(layer)

    def patch(q: torch.Tensor, hook: Any) -> torch.Tensor:
        q = q.clone()
        q[:, t, head] = source[q_name][:, t, head].to(q)
        return q

    pattern = capture.PATTERN.format(layer)
    with capture.recorded(bridge, [pattern]) as changed, bridge.hooks([(q_name, patch)]):
        bridge(bridge.to_tokens(corrupted))
    new_row = changed[pattern][0, head, t].double()
    old_row = att.patterns[0, layer, head, t].double()
    grad_row = att.pattern_grads[0, layer, head, t].double()
    expected = float((grad_row * (new_row - old_row)).sum())
    got = float(att.by_position["query"][0, layer, head, t])
    assert abs(expected) > 1e-8
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-9)


#: The exact edge methods' refusals on models whose eap circuits work.
EXACT_REFUSALS = {
    "qwen3": "q/k norms",
    "gemma3": "q/k norms",
    "olmo2": "q/k norms",
}


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_circuits_are_exact_at_both_ends_or_refuse_naming_the_cause(arch: str) -> None:
    """eap edge scores and faithfulness on every architecture (parallel and post-norm blocks
    included): full circuit 1, empty circuit 0 (float64); exact edge scores, or a refusal whose
    message names the architectural cause."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED

    from ra_lens import circuits

    bridge, _ = pair(arch)
    metric = ra_lens.metrics.logit_diff([5, 6, 7], [7, 5, 6])
    scores = circuits.attribute(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, method="eap")
    assert bool(scores.scores.abs().gt(0).any())
    graph = scores.graph
    full = circuits.Circuit(graph, graph.real.clone())
    empty = circuits.Circuit(graph, torch.zeros_like(graph.real))
    # faithfulness() is this evaluator called once: one evaluator measures both ends
    evaluate = circuits.FaithfulnessEvaluator(bridge, TOY_CLEAN, TOY_CORRUPTED, metric)
    for circuit, value in ((full, 1.0), (empty, 0.0)):
        assert evaluate(circuit).value == pytest.approx(value, abs=1e-6)
    if arch in EXACT_REFUSALS:
        with pytest.raises((NotImplementedError, RuntimeError), match=EXACT_REFUSALS[arch]):
            circuits.attribute(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, method="exact")


#: edit_dynamics's refusals: the same cause (a change replayed through the projection only).
DYNAMICS_REFUSALS = EXACT_REFUSALS


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_edit_dynamics_is_exact_to_second_order_or_refuses(arch: str) -> None:
    """RA's gradient of W_q, b_q, W_k, b_k is autograd's, and predicted (first order) + the
    second-order term is the change a real SGD step makes (soft-cap and windows included)."""
    bridge, _ = pair(arch)
    metric = target_nll([TARGET])
    if not has_bridge():
        with pytest.raises(NotImplementedError, match="HookedTransformer"):
            ra_lens.edit_dynamics(bridge, PROMPT, metric, 1e-3)
        return
    if arch in DYNAMICS_REFUSALS:
        with pytest.raises(NotImplementedError, match=DYNAMICS_REFUSALS[arch]):
            ra_lens.edit_dynamics(bridge, PROMPT, metric, 1e-3)
        return
    dyn = ra_lens.edit_dynamics(bridge, PROMPT, metric, 1e-3)
    assert float(dyn.grad_error.max()) < tolerance(arch) * 1e3
    total = (dyn.predicted + dyn.second_order).double()
    error = float((total - dyn.actual.double()).abs().max() / dyn.actual.double().abs().max())
    assert error < tolerance(arch) * 1e3
    assert float(dyn.pattern_cosine.min()) > 0.999


#: Adapters that hand attention to HuggingFace and fire hook_pattern after the fact: patch
#: hooks in the caller's own forward are refused (with `model=`) and work under live_attention.
DELEGATED = ("gpt_neo", "gptj", "opt")


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_attention_patching_is_huggingfaces_own_patched_attention(arch: str) -> None:
    """Logits under attention_patch_hooks(ra, eta) = HF's logits with eta * RA added to the
    softmax output inside its own attention code."""
    from helpers import hf_logits_with_pattern_added

    bridge, hf = pair(arch)
    tokens = bridge.to_tokens(PROMPT)
    ra = ra_lens.reversed_attention(bridge, tokens, target_nll([TARGET]))
    live = contextlib.nullcontext()
    if arch in DELEGATED and has_bridge():  # HookedTransformer computes attention itself
        with pytest.raises(RuntimeError, match="ra_lens.live_attention"):
            ra_lens.attention_patch_hooks(ra, -4.0, model=bridge)
        live = ra_lens.live_attention(bridge)
    with torch.no_grad(), live:
        hooks = ra_lens.attention_patch_hooks(ra, -4.0, model=bridge)
        with bridge.hooks(fwd_hooks=hooks):
            patched = bridge(tokens).double()
    assert ra.maps is not None
    added = [-4.0 * ra.maps[:, layer].double() for layer in range(bridge.cfg.n_layers)]
    expected = hf_logits_with_pattern_added(hf, tokens, added).double()
    unpatched = hf(tokens).logits.detach().double()
    assert float((expected - unpatched).abs().max()) > 1e-4  # the edit matters
    scale = float(expected.abs().max())
    assert float((patched - expected).abs().max()) < 1e-5 * scale


#: Post-norm blocks: a reader sees N(a - S), the norm of the heads' sum with its patched heads'
#: changes S taken out (circuits/_edges.py).
POST_NORM = ("gemma2", "gemma3", "olmo2")


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_patching_every_edge_of_a_head_is_patching_the_head(arch: str) -> None:
    """Every out-edge of head h patched = h's output (hook_z) patched, measured on the model's
    own forward pass: exact, post-norm blocks (the reader sees the real norm) included."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED

    from ra_lens import capture, circuits

    bridge, _ = pair(arch)
    metric = ra_lens.metrics.logit_diff([5, 6, 7], [7, 5, 6])
    graph = circuits.Graph.from_model(bridge)
    clean = capture.to_batch(bridge, TOY_CLEAN)
    evaluate = circuits.FaithfulnessEvaluator(bridge, TOY_CLEAN, TOY_CORRUPTED, metric)
    layer, head = graph.n_layers - 1, 1
    keep = graph.real.clone()
    keep[graph.writers.index(f"a{layer}.h{head}")] = False
    by_edges = evaluate(circuits.Circuit(graph, keep)).circuit_metric
    z = capture.Z.format(layer)
    with capture.recorded(bridge, [z]) as source, torch.no_grad():
        bridge(capture.to_batch(bridge, TOY_CORRUPTED).tokens)

    def patch(value: torch.Tensor, hook: Any) -> torch.Tensor:
        value = value.clone()
        value[:, :, head] = source[z][:, :, head]
        return value

    with torch.no_grad(), bridge.hooks(fwd_hooks=[(z, patch)]):
        by_head = float(metric(bridge(clean.tokens), lengths=clean.lengths).mean())
    with torch.no_grad():
        plain = float(metric(bridge(clean.tokens), lengths=clean.lengths).mean())
    effect = by_head - plain
    assert abs(effect) > 1e-6
    error = abs((by_edges - plain) - effect) / abs(effect)
    assert error < tolerance(arch) * 1e3


@pytest.mark.parametrize("arch", POST_NORM)
def test_eap_score_of_a_post_norm_head_is_its_exact_residual_effect_times_the_gradient(
    arch: str,
) -> None:
    """eap (denoise) edge head -> logits = (N(a + d_h) - N(a)) . dM/d(final residual) on the
    corrupted run, d_h = o_h(clean) - o_h(corrupted), N the model's own post-attention norm."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED

    from ra_lens import capture, circuits

    bridge, _ = pair(arch)
    clean, corrupted = TOY_CLEAN[2], TOY_CORRUPTED[2]
    metric = ra_lens.metrics.logit_diff([5], [7])
    scores = circuits.attribute(bridge, clean, corrupted, metric, method="eap")
    layer, head = bridge.cfg.n_layers - 1, 2
    z, a_in = capture.Z.format(layer), f"blocks.{layer}.ln1_post.hook_in"
    final = f"blocks.{layer}.hook_resid_post"
    W_O = bridge.blocks[layer].attn.W_O.detach()
    with capture.recorded(bridge, [z]) as clean_run, torch.no_grad():
        bridge(bridge.to_tokens(clean))
    store: dict[str, torch.Tensor] = {}

    def leaf(value: torch.Tensor, hook: Any) -> torch.Tensor:
        store["resid"] = value.detach().requires_grad_(True)
        return store["resid"]

    with capture.recorded(bridge, [z, a_in]) as corrupted_run, bridge.hooks([(final, leaf)]):
        logits = bridge(bridge.to_tokens(corrupted))
    (grad,) = torch.autograd.grad(metric(logits).sum(), [store["resid"]])
    d = (clean_run[z][0, :, head] - corrupted_run[z][0, :, head]) @ W_O[head]
    norm = bridge.blocks[layer].ln1_post.original_component
    a = corrupted_run[a_in][0]
    with torch.no_grad():
        effect = norm(a + d) - norm(a)
    expected = float((effect * grad[0]).sum())
    graph = scores.graph
    got = float(scores.scores[graph.writers.index(f"a{layer}.h{head}"), len(graph.readers) - 1])
    assert abs(expected) > 1e-8
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_docs_hold_the_architecture_table() -> None:
    """The architectures page's table is written from this file's expectations
    (docs/architecture_table.py)."""
    import runpy

    root = REPO_ROOT
    table = runpy.run_path(str(root / "docs" / "architecture_table.py"))["table"]()
    assert table in (root / "docs" / "concepts" / "architectures.md").read_text()


@pytest.mark.parametrize("arch", [a for a in MATRIX_ARCHITECTURES if a not in EXACT_REFUSALS])
def test_exact_edge_into_a_query_is_the_models_own_changed_pattern(arch: str) -> None:
    """The exact score of edge input -> a0.h1<q> = sum R (A' - A) over head 1's rows, where A'
    is the pattern the model itself computes when only that query's input moves by the input's
    change (its q recomputed from ln1(resid + change) and put in at hook_q): the model's own
    rotation, scale, soft-cap, ALiBi, window and delegated attention included."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED

    from ra_lens import capture, circuits
    from ra_lens.weights import layer_weights

    bridge, _ = pair(arch)
    clean, corrupted = TOY_CLEAN[2], TOY_CORRUPTED[2]
    metric = ra_lens.metrics.logit_diff([5], [7])
    scores = circuits.attribute(bridge, clean, corrupted, metric, method="exact")
    layer, head = 0, 1  # the changed token's own query row: R reaches it through layer 1
    tokens = {name: bridge.to_tokens(text) for name, text in (("c", clean), ("k", corrupted))}
    first = capture.RESID_PRE.format(0)
    with capture.recorded(bridge, [first]) as clean_run, torch.no_grad():
        bridge(tokens["c"])
    resid, pattern = capture.RESID_PRE.format(layer), capture.PATTERN.format(layer)
    with capture.recorded(bridge, [first, resid, pattern]) as base, torch.no_grad():
        bridge(tokens["k"])
    change = clean_run[first] - base[first]
    w = layer_weights(bridge, layer)

    def move_query(q: torch.Tensor, hook: Any) -> torch.Tensor:
        q = q.clone()
        moved = w.ln1(base[resid] + change) @ w.W_Q[head] + w.b_Q[head]
        q[:, :, head] = moved.to(q)
        return q

    with (
        ra_lens.live_attention(bridge),
        torch.no_grad(),
        capture.recorded(bridge, [pattern]) as moved,
        bridge.hooks([(capture.Q.format(layer), move_query)]),
    ):
        bridge(tokens["k"])
    ra = ra_lens.reversed_attention(
        bridge, tokens["k"], metric, layers=[layer], convention="pattern"
    )
    assert ra.maps is not None
    grad = ra.maps[0, 0, head].double()
    delta = (moved[pattern] - base[pattern])[0, head].double()
    expected = float((grad * delta).sum())
    graph = scores.graph
    got = float(
        scores.scores[graph.writer_index["input"], graph.reader_index[f"a{layer}.h{head}<q>"]]
    )
    assert abs(expected) > 1e-9
    assert got == pytest.approx(expected, rel=1e-3 if arch in DTYPES else 1e-5, abs=1e-10)


@pytest.mark.tl4
def test_gpt2_scaled_by_inverse_layer_index_is_exact() -> None:
    """GPT-2 with scale_attn_by_inverse_layer_idx (Stanford's GPT-2s): transformers 5 folds
    1 / (layer + 1) into the module's `scaling`, which ra-lens reads as it is (it used to
    multiply the layer index in a second time)."""
    import tempfile

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ra_lens.models import hub_offline
    from ra_lens.toy_models import hf_config, tiny_tokenizer_dir

    config = hf_config("gpt2", 300, 32, 2, 4, 64)
    config.scale_attn_by_inverse_layer_idx = True
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    folder = tempfile.mkdtemp(prefix="ra_lens_tiny_gpt2_inverse_")
    hf.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    with hub_offline():
        bridge = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tokenizer)
    bridge.eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    reference = reference.to(torch.float64).eval()
    tokens = bridge.to_tokens(PROMPT)
    metric = target_nll([TARGET])
    truth = hf_attention_grads(reference, tokens, metric)["qk"]
    ra = ra_lens.reversed_attention(bridge, tokens, metric)
    assert ra.maps is not None and ra.scales[1] == pytest.approx(2 * 8**0.5)
    for layer, grad in enumerate(truth):
        expected = grad[0].double()
        got = ra.maps[0, layer].double()
        assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


#: One architecture per new mechanism: delegated attention (the seam), post-norm blocks with a
#: soft-cap, parallel blocks with a recomputed rotation.
MECHANISMS = ("opt", "gemma2", "gpt_neox")


@pytest.mark.tl4
@pytest.mark.parametrize("arch", MECHANISMS)
def test_train_mode_gives_eval_answers_and_leaves_the_model_as_found(arch: str) -> None:
    """With attention dropout 0.3 in train mode: RA, exact attribution, exact edge scores and
    faithfulness give eval mode's answers, and the model keeps its modes, requires_grad, .grad,
    hooks and HuggingFace modules' own forward (the seam is taken off again)."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED, module_modes, snapshot

    from ra_lens import circuits

    model = tiny_model(arch, dtype=torch.float64, spread=True, dropout=0.3)
    metric = ra_lens.metrics.logit_diff([5, 6, 7], [7, 5, 6])
    graph = circuits.Graph.from_model(model)
    half = circuits.Circuit(
        graph, graph.real & (torch.arange(graph.real.numel()) % 2 == 0).view_as(graph.real)
    )

    def answers() -> list[torch.Tensor]:
        return [
            ra_lens.reversed_attention(model, PROMPT, target_nll([TARGET])).maps,
            ra_lens.attention_attribution(model, TOY_CLEAN, TOY_CORRUPTED, metric).scores["query"],
            circuits.attribute(model, TOY_CLEAN, TOY_CORRUPTED, metric, method="exact").scores,
            circuits.faithfulness(model, half, TOY_CLEAN, TOY_CORRUPTED, metric).circuit_per_pair,
        ]

    expected = answers()  # eval mode (tiny_model returns it so)
    for module in ra_lens.capture.model_modules(model):  # the HF modules too: dropout is live
        module.train()
    modes, before = module_modes(model), snapshot(model)
    with torch.no_grad():
        assert not torch.equal(model(model.to_tokens(PROMPT)), model(model.to_tokens(PROMPT)))
    for got, want in zip(answers(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    after = snapshot(model)
    assert module_modes(model) == modes and after[0] == before[0] and after[1] == before[1]
    assert after[3] == before[3] and all(g is None for g in after[2])
    assert not any("forward" in vars(block.attn.original_component) for block in model.blocks)


@pytest.mark.tl4
def test_live_attention_puts_back_a_forward_the_module_already_had() -> None:
    """A HuggingFace module with its own instance `forward` (as accelerate's dispatch gives it)
    gets that very forward back after the seam."""
    bridge, _ = pair("opt")
    inner = bridge.blocks[0].attn.original_component
    own = inner.forward  # a bound method, stored on the instance as accelerate does
    inner.forward = own
    try:
        with ra_lens.live_attention(bridge):
            assert inner.forward is not own and inner.accepts_pattern_fn
        assert vars(inner)["forward"] is own and "accepts_pattern_fn" not in vars(inner)
    finally:
        del inner.forward


@pytest.mark.tl4
def test_forward_only_calls_work_inside_inference_mode_on_a_fresh_model() -> None:
    """eval_mode-only work (accuracy) needs no autograd: under torch.inference_mode() a model
    no probe has seen is used as found instead of refused."""
    model = tiny_model("opt", dtype=torch.float64)
    prompts = ra_lens.tasks.build_prompts([("hot", "cold"), ("up", "down")], shots=1)
    with torch.inference_mode():
        accuracy = ra_lens.tasks.evaluate(model, prompts)
    assert accuracy.n == len(prompts) and 0.0 <= accuracy.top1 <= accuracy.top3 <= 1.0


def _warm(arch: str) -> Any:
    """pair(arch)'s model after one forward pass (a bridge adds its own norm hooks then)."""
    model, _ = pair(arch)
    with torch.no_grad():
        model(model.to_tokens(PROMPT))
    return model


def _metric_per_pair(model: Any, texts: list[str], metric: Any) -> torch.Tensor:
    batch = ra_lens.capture.to_batch(model, texts)
    with torch.no_grad():
        return metric(model(batch.tokens), lengths=batch.lengths).double()


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_learned_mask_is_edge_patching_at_its_ends_and_on_zero_one_masks(arch: str) -> None:
    """masked_values: all ones is the clean run bit for bit (no reader changes), all zeros the
    corrupted run, a 0/1 mask `faithfulness`'s edge patching of that circuit; learn_mask (2
    steps) scores every edge finitely and leaves the model as found (hooks, modes, grads)."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED, snapshot

    from ra_lens import circuits
    from ra_lens.circuits.masks import masked_values

    bridge = _warm(arch)
    metric = ra_lens.metrics.logit_diff([5, 6, 7], [7, 5, 6])
    graph = circuits.Graph.from_model(bridge)
    before = snapshot(bridge)
    ones = torch.ones(graph.real.shape, dtype=torch.float64)
    clean = _metric_per_pair(bridge, TOY_CLEAN, metric)
    corrupted = _metric_per_pair(bridge, TOY_CORRUPTED, metric)
    assert float((clean - corrupted).abs().max()) > 1e-4  # the two runs differ
    kept = masked_values(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, ones).detach().double()
    assert torch.equal(kept, clean)
    patched = masked_values(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, 0 * ones).detach()
    atol = tolerance(arch) * 10 * float(clean.abs().max())
    torch.testing.assert_close(patched.double(), corrupted, rtol=0, atol=atol)
    edges = torch.rand(graph.real.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    edges &= graph.real
    values = masked_values(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, edges.double()).detach()
    truth = circuits.faithfulness(
        bridge, circuits.Circuit(graph, edges), TOY_CLEAN, TOY_CORRUPTED, metric
    )
    torch.testing.assert_close(values.double(), truth.circuit_per_pair, rtol=0, atol=atol)
    assert float((values.double() - clean).abs().max()) > 1e-4  # the circuit patches something
    learned = circuits.learn_mask(
        bridge, TOY_CLEAN, TOY_CORRUPTED, metric, steps=2, ig_steps=2, sparsity=0.0
    )
    assert learned.scores.scores.shape == graph.real.shape
    assert bool(torch.isfinite(learned.scores.scores).all())
    assert bool(learned.scores.scores[graph.real].ne(0).any())
    # the first step's faithfulness is that of the warm start's mask, sigmoid(helps / rms)
    helps = learned.warm_start.helps
    start = torch.sigmoid(helps / helps[graph.real].pow(2).mean().sqrt()).float().double()
    at_start = masked_values(bridge, TOY_CLEAN, TOY_CORRUPTED, metric, start * graph.real)
    f = (at_start.detach().double().mean() - corrupted.mean()) / (clean.mean() - corrupted.mean())
    assert learned.faithfulness[0] == pytest.approx(float(f), rel=1e-4, abs=1e-6)
    after = snapshot(bridge)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(g is None for g in after[2])


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_discover_scores_every_edge_and_leaves_the_model_as_found(arch: str) -> None:
    """circuits.discover is learn_mask (exact above), cross_calibrate (edge patching, exact
    in the circuits test) and arithmetic on the scores: on every architecture it scores every
    edge finitely, some negative edges calibrated, and leaves hooks, modes and grads as found."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED, snapshot

    from ra_lens import circuits

    bridge = _warm(arch)
    # each half holds the short pair: on Mistral's sliding window the long pairs' difference
    # never reaches the last position, and a half without it is refused (nothing to keep)
    order = [2, 0, 2, 1]
    metric = ra_lens.metrics.logit_diff([[5, 6, 7][i] for i in order], [[7, 5, 6][i] for i in order])  # fmt: skip
    before = snapshot(bridge)
    scores = circuits.discover(
        bridge, [TOY_CLEAN[i] for i in order], [TOY_CORRUPTED[i] for i in order], metric,
        steps=1, ig_steps=1,
    )  # fmt: skip
    real = scores.graph.real
    assert scores.scores.shape == real.shape and bool(torch.isfinite(scores.scores).all())
    assert bool(scores.scores[real].ne(0).any()) and bool(scores.scores[~real].eq(0).all())
    assert scores.method.startswith("discover(2 masks x 1 steps, negatives x ")
    after = snapshot(bridge)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(g is None for g in after[2])


@pytest.mark.parametrize("arch", MATRIX_ARCHITECTURES)
def test_eap_ig_act_is_eap_where_no_node_is_crossed(arch: str) -> None:
    """eap-ig-act with steps=1 holds each node at its own clean value, so every pass is the
    clean run with one node's gradient cut: the logits' in-edges (no node lies after them) are
    eap's exactly, and the last MLP's in-edges eap's times (n_nodes - 1) / n_nodes (only its own
    pass cuts them), parallel blocks included. On TL 2 every edge (steps=2) equals EAP-IG's
    algorithm written out on TL 2's own hooks."""
    from helpers import TOY_CLEAN, TOY_CORRUPTED, snapshot

    from ra_lens import circuits

    bridge = _warm(arch)
    metric = ra_lens.metrics.logit_diff([5, 6, 7], [7, 5, 6])
    before = snapshot(bridge)
    act = circuits.attribute(
        bridge, TOY_CLEAN, TOY_CORRUPTED, metric, method="eap-ig-act", steps=1, direction="noise"
    )
    eap = circuits.attribute(
        bridge, TOY_CLEAN, TOY_CORRUPTED, metric, method="eap", direction="noise"
    )
    assert snapshot(bridge) == before
    graph = act.graph
    assert bool(torch.isfinite(act.scores).all())
    n_nodes = 1 + 2 * graph.n_layers
    last_mlp = graph.reader_index[f"m{graph.n_layers - 1}"]
    for reader, factor in ((len(graph.readers) - 1, 1.0), (last_mlp, (n_nodes - 1) / n_nodes)):
        expected = eap.scores[:, reader] * factor
        scale = float(expected.abs().max())
        assert scale > 1e-6
        got = act.scores[:, reader]
        assert float((got - expected).abs().max()) <= tolerance(arch) * 100 * scale
    # the other in-edges are not eap's: some pass cuts a path that eap counts
    assert float((act.scores - eap.scores).abs().max()) > 1e-3 * float(eap.scores.abs().max())
    if not has_bridge():  # every edge against the algorithm written out on TL 2's hooks
        from helpers import assert_ungrouped_scores, eap_ig_act_reference

        clean, corrupted = (ra_lens.capture.to_batch(bridge, t) for t in (TOY_CLEAN, TOY_CORRUPTED))
        act = circuits.attribute(bridge, clean, corrupted, metric, method="eap-ig-act", steps=2)
        other = hooked_matrix_model(arch, dtype=DTYPES.get(arch, torch.float64))  # flags set
        theirs = eap_ig_act_reference(other, corrupted.tokens, clean.tokens, corrupted.lengths, 2, metric)  # fmt: skip
        assert_ungrouped_scores(act, theirs, rel=tolerance(arch) * 10)
