"""Per-copy key/value patching (`_edges.EdgeRun(copy_mask=...)`, `Circuit.ungrouped_edges`): on
a grouped-query model each query head reads its own key and value, patched by its own copy's
edges, as EAP-IG's evaluator patches its ungrouped model. The truth is the ungrouped model itself:
the same weights with every key/value head repeated for the query heads of its group (a model
without grouped-query attention), patched edge by edge with the circuit's ungrouped edges."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers import has_bridge, hook_count, hooked_toy

from ra_lens import capture, state
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.faithfulness import FaithfulnessEvaluator
from ra_lens.circuits.graph import Graph
from ra_lens.metrics import logit_diff

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 50], [52, 60])
#: Grouped-query architectures of the matrix: plain (Llama), q/k norms (Qwen3), post-norms,
#: soft-caps and sliding windows (Gemma-2), one key/value head for 4 query heads (Gemma-3), a
#: fused qkv projection (Phi-3), and multi-query attention fused into a parallel block (Falcon).
BRIDGE_ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "falcon")
LLAMA_LIKE = dict(
    positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS",
    act_fn="silu", gated_mlp=True,
)  # fmt: skip


def _hooked_twins(arch: str = "llama_like") -> tuple[object, object]:
    """TL 2: the grouped model (the Llama-like toy, or TL 2's conversion of a matrix
    architecture) and its ungrouped twin (no grouped-query attention, W_K/W_V as TL 2's
    `ungroup_grouped_query_attention` repeats them)."""
    if arch == "llama_like":
        model = hooked_toy(**LLAMA_LIKE)
        twin = hooked_toy(**{k: v for k, v in LLAMA_LIKE.items() if k != "n_key_value_heads"})
    else:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        from ra_lens.toy_models import hooked_matrix_model

        model = hooked_matrix_model(arch, dtype=torch.float64)
        config = {**model.cfg.to_dict(), "n_key_value_heads": None}
        twin = HookedTransformer(
            HookedTransformerConfig.from_dict(config), tokenizer=model.tokenizer
        )
        twin = twin.to(torch.float64).eval()
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    state = {}
    for name, value in model.state_dict().items():
        if "._W_" in name or "._b_" in name:  # grouped k/v weights: one copy per query head
            name = name.replace("._W_", ".W_").replace("._b_", ".b_")
            value = value.repeat_interleave(group, 0)
        state[name] = value
    twin.load_state_dict(state, strict=True)
    return model, twin


def _bridge_twins(arch: str) -> tuple[object, object]:
    """TL 4: bridges of the tiny HuggingFace model and of its ungrouped copy (k_proj/v_proj
    rows repeated per query head, num_key_value_heads = num_attention_heads)."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ra_lens.models import hub_offline
    from ra_lens.toy_models import hf_model, tiny_tokenizer_dir

    grouped = hf_model(arch, spread=True)
    config = grouped.config.__class__.from_dict(grouped.config.to_dict())
    n_kv, n_heads = grouped.config.num_key_value_heads, grouped.config.num_attention_heads
    config.num_key_value_heads = n_heads
    if arch == "falcon":  # multi-query off: one key/value head per query head
        config.multi_query = False
    config._attn_implementation = "eager"
    ungrouped = AutoModelForCausalLM.from_config(config).eval()
    state = {name: _ungroup(arch, name, value, n_kv, n_heads) for name, value in grouped.state_dict().items()}  # fmt: skip
    ungrouped.load_state_dict(state, strict=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    models = []
    for hf in (grouped, ungrouped):
        folder = tempfile.mkdtemp(prefix="ra_lens_twin_")
        hf.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        with hub_offline():
            bridge = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tokenizer)
        models.append(bridge.to(torch.float64).eval())
    return models[0], models[1]


def _ungroup(arch: str, name: str, value: torch.Tensor, n_kv: int, n_heads: int) -> torch.Tensor:
    """A grouped model's weight as its ungrouped twin holds it: key/value rows (of k_proj/v_proj,
    or of a fused projection) repeated for every query head of their group."""
    group = n_heads // n_kv

    def repeat(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(n_kv, -1, *rows.shape[1:]).repeat_interleave(group, 0).flatten(0, 1)

    fused = "qkv_proj" in name or "query_key_value" in name
    if not fused:
        split = name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))
        return repeat(value) if split else value
    d_q = value.shape[0] * n_heads // (n_heads + 2 * n_kv)
    q, k, v = value.split([d_q, (value.shape[0] - d_q) // 2, (value.shape[0] - d_q) // 2])
    if arch == "falcon":  # no multi-query: per head [q_h, k_h, v_h] (FalconAttention._split_heads)
        heads = [t.view(n_heads, -1, *t.shape[1:]) for t in (q, repeat(k), repeat(v))]
        return torch.stack(heads, 1).flatten(0, 2)
    return torch.cat([q, repeat(k), repeat(v)])


def _random_copies(graph: Graph, p: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    draw = torch.rand(len(graph.writers), len(graph.ungrouped_readers), generator=generator) < p
    return draw & graph.real[:, graph.ungrouped_target]


#: TL 2: the fused qkv projection is split into W_Q/W_K/W_V by TL 2's own conversion (Phi-3).
HOOKED_ARCHS = ("llama_like", "phi3")


@pytest.mark.parametrize("arch", BRIDGE_ARCHS if has_bridge() else HOOKED_ARCHS)
def test_per_copy_patching_equals_the_ungrouped_model(arch):
    model, twin = _bridge_twins(arch) if has_bridge() else _hooked_twins(arch)
    graph, ungrouped = Graph.from_model(model), Graph.from_model(twin)
    assert graph.group > 1 and ungrouped.group == 1
    # the twin's readers are the grouped model's ungrouped readers, in the same order
    assert [name for name, _ in graph.ungrouped_readers] == ungrouped.readers
    evaluate = FaithfulnessEvaluator(model, CLEAN, CORRUPTED, METRIC)
    truth = FaithfulnessEvaluator(twin, CLEAN, CORRUPTED, METRIC)
    assert torch.allclose(evaluate.clean_per_pair, truth.clean_per_pair, rtol=0, atol=1e-12)
    before = hook_count(model)
    for seed, p in enumerate((0.2, 0.5, 0.8)):
        copies = _random_copies(graph, p, seed)
        circuit = Circuit.from_copies(graph, copies)
        assert circuit.per_copy
        got = evaluate(circuit).circuit_per_pair
        want = truth(Circuit(ungrouped, copies)).circuit_per_pair
        assert float((got - want).abs().max()) < 1e-12 * max(1.0, float(want.abs().max()))
        # and it is not the grouped circuit of the same edges (any copy in)
        grouped = evaluate(Circuit(graph, circuit.edges)).circuit_per_pair
        assert float((got - grouped).abs().max()) > 1e-4
    assert hook_count(model) == before  # no hook left behind


@pytest.mark.skipif(has_bridge(), reason="TL 2's own ungrouped HookedTransformer")
def test_the_hooked_twin_is_tl2s_ungrouped_model():
    model, twin = _hooked_twins()
    tokens = model.to_tokens(CLEAN[1])
    model.set_ungroup_grouped_query_attention(True)
    with torch.no_grad():
        assert torch.allclose(model(tokens), twin(tokens), rtol=0, atol=1e-12)


def test_copies_that_agree_are_the_grouped_circuit():
    model = _bridge_twins("llama")[0] if has_bridge() else _hooked_twins()[0]
    graph = Graph.from_model(model)
    draw = torch.rand(graph.real.shape, generator=torch.Generator().manual_seed(3))
    edges = (draw < 0.5) & graph.real
    grouped = Circuit(graph, edges)
    agreeing = Circuit.from_copies(graph, edges[:, graph.ungrouped_target])
    assert not agreeing.per_copy and agreeing == grouped
    # patched copy by copy in slots, copies that agree give today's grouped patching
    evaluate = FaithfulnessEvaluator(model, CLEAN, CORRUPTED, METRIC)
    mask = graph.real & ~edges
    by_copy = evaluate._circuit_values(mask, copy_mask=mask[:, graph.ungrouped_target])
    assert float((by_copy - evaluate(grouped).circuit_per_pair).abs().max()) < 1e-12


# ------------------------------------------------------------ what edge patching reads of a model


@pytest.mark.skipif(has_bridge(), reason="HookedTransformer's cfg.use_hook_mlp_in (TL 2)")
def test_the_mlp_input_switch_is_given_back_by_preserved_state():
    model = hooked_toy()
    assert not model.cfg.use_hook_mlp_in
    with pytest.raises(ValueError, match="inside"), capture.preserved_state(model):
        state.enable_mlp_in(model)
        assert model.cfg.use_hook_mlp_in
        raise ValueError("an error inside the call")
    assert not model.cfg.use_hook_mlp_in  # as found
    with pytest.raises(RuntimeError, match="inside capture.preserved_state"):
        state.enable_mlp_in(model)
    assert not model.cfg.use_hook_mlp_in
    # a failing faithfulness call (a metric without one value per prompt) leaves it as found
    bad = lambda logits, lengths=None: logits.sum()  # noqa: E731
    with pytest.raises(ValueError):
        FaithfulnessEvaluator(model, CLEAN, CORRUPTED, bad)
    assert not model.cfg.use_hook_mlp_in


def test_the_mlp_reader_hook_is_read_once_per_call(monkeypatch):
    from ra_lens import contract, weights

    model = _bridge_twins("llama")[0] if has_bridge() else _hooked_twins()[0]
    facts = contract.model_facts(model)
    expected = "blocks.{}.ln2.hook_in" if has_bridge() else "blocks.{}.hook_mlp_in"
    assert facts.mlp_in == tuple(expected.format(la) for la in range(model.cfg.n_layers))
    evaluate = FaithfulnessEvaluator(model, CLEAN, CORRUPTED, METRIC)
    reads = []
    real = contract.model_facts
    monkeypatch.setattr(contract, "model_facts", lambda m: reads.append(1) or real(m))
    monkeypatch.setattr(weights, "model_facts", contract.model_facts)
    evaluate(Circuit.empty(evaluate.graph))  # every MLP input patched: no model re-read
    assert reads == []
