"""attention_attribution against real activation patching, finite differences and TL 4's types."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import CLEAN_TOKENS as CLEAN
from helpers import CORRUPTED_TOKENS as CORRUPTED
from helpers import arch_or_hooked, count_fact_reads, has_bridge, kl_to, one_layer_model

import ra_lens
from ra_lens import capture
from ra_lens.attribution import key_terms, log_other_mass
from ra_lens.capture import Batch
from ra_lens.metrics import logit_diff, target_nll
from ra_lens.toy_models import tiny_model, tiny_tokenizer_dir

# Two prompts per side, equal lengths pair by pair, differing at a few positions.
METRIC = logit_diff([30, 31], [32, 33])


def metric_all(logits):
    """Linear in the logits of every position, so every query row matters."""
    return (logits[..., 30] - logits[..., 32]).sum(-1)


def one_layer(kind: str, q_gain: float = 1.0):
    """`helpers.one_layer_model`, with two key/value heads for "native_gqa"."""
    return one_layer_model(
        q_gain=q_gain, **({"n_key_value_heads": 2} if kind == "native_gqa" else {})
    )


def one_layer_kinds() -> list[str]:
    return ["native", "native_gqa"] if has_bridge() else ["hooked"]


def multi_layer_archs() -> list[str]:
    return ["gpt2", "llama"] if has_bridge() else ["hooked"]


def toy(arch: str):
    if arch == "hooked":
        return tiny_model("hooked", dtype=torch.float64)
    return tiny_model(arch, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# real activation patching: a plain hook loop


def qk_name(model, kind: str, layer: int) -> str:
    letter = "q" if kind == "query" else "k"
    rotated = f"blocks.{layer}.attn.hook_rot_{letter}"
    return rotated if rotated in model.hook_dict else f"blocks.{layer}.attn.hook_{letter}"


def activation(model, tokens, name):
    seen = {}
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, lambda x, hook: seen.update(x=x.clone()))]):
        model(tokens)
    return seen["x"]


def patch_run(model, base, other, kind, layer, head, position, metric=METRIC):
    """(metric, pattern of the layer) of `base` with one node patched from `other`."""
    if kind == "pattern":
        name = capture.PATTERN.format(layer)
        source = activation(model, other, name)

        def patch(x, hook):
            x = x.clone()
            x[:, head, position] = source[:, head, position]
            return x
    else:
        name = qk_name(model, kind, layer)
        source = activation(model, other, name)

        def patch(x, hook):
            x = x.clone()
            x[:, position, head] = source[:, position, head]
            return x

    seen = {}

    def keep(x, hook):
        seen["pattern"] = x.clone()

    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(name, patch), (capture.PATTERN.format(layer), keep)]),
    ):
        logits = model(base)
    return metric(logits), seen["pattern"]


def base_metric(model, tokens, metric=METRIC):
    with torch.no_grad():
        return metric(model(tokens))


# --------------------------------------------------------------------------------------------
# delta-A against patching


@pytest.mark.parametrize("arch", multi_layer_archs())
@pytest.mark.parametrize("kind", ["query", "key"])
def test_delta_pattern_equals_patched_pattern(arch, kind):
    model = toy(arch)
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    n_heads = att.n_heads if kind == "query" else att.n_kv_heads
    base_pattern = activation(model, CORRUPTED, capture.PATTERN.format(1))
    worst, largest = 0.0, 0.0
    for head in range(n_heads):
        for position in (2, 5, 6):
            _, patched = patch_run(model, CORRUPTED, CLEAN, kind, 1, head, position)
            for b in range(2):
                ours = att.delta_pattern(kind, 1, head, position, batch=b)
                true = patched[b] - base_pattern[b]
                worst = max(worst, float((ours - true).abs().max()))
                largest = max(largest, float(true.abs().max()))
    assert largest > 1e-3
    # HF's eager Llama attention takes its softmax in float32 even in a float64 model.
    assert worst < (1e-6 if arch == "llama" else 1e-12)


# --------------------------------------------------------------------------------------------
# exact = truth where the metric is linear in the pattern


@pytest.mark.parametrize("kind", one_layer_kinds())
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_exact_equals_patching_on_one_layer_attention_only(kind, direction):
    model = one_layer(kind, q_gain=300.0)  # large queries: saturated rows (mean row max 0.9)
    clean, corrupted = CLEAN, CORRUPTED
    exact = ra_lens.attention_attribution(model, clean, corrupted, metric_all, direction=direction)
    linear = ra_lens.attention_attribution(
        model, clean, corrupted, metric_all, direction=direction, method="linear"
    )
    base, other = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    before = base_metric(model, base, metric_all)
    patched_metric = exact.corrupted_metric if direction == "denoise" else exact.clean_metric
    assert torch.allclose(patched_metric.double(), before, atol=1e-5)
    truths, exacts, linears = [], [], []
    for node, n in (
        ("query", exact.n_heads),
        ("key", exact.n_kv_heads),
        ("pattern", exact.n_heads),
    ):
        for head in range(n):
            for position in range(clean.shape[1]):
                after, _ = patch_run(model, base, other, node, 0, head, position, metric_all)
                truth = after - before
                truths.append(truth)
                exacts.append(exact.by_position[node][:, 0, head, position].double())
                linears.append(linear.by_position[node][:, 0, head, position].double())
                if node == "pattern":
                    assert torch.allclose(linears[-1], exacts[-1])
    truth, est, lin = torch.stack(truths), torch.stack(exacts), torch.stack(linears)
    assert float(truth.abs().max()) > 1e-3
    # float32 storage of the estimates: relative 1e-6
    assert float((est - truth).abs().max()) < 1e-5 * float(truth.abs().max())
    qk = slice(0, (exact.n_heads + exact.n_kv_heads) * clean.shape[1])
    assert float((lin[qk] - truth[qk]).abs().max()) > 0.2 * float(truth[qk].abs().max())


def test_saturation_is_what_linear_misses():
    """On a one-hot row a key node changes everything and the linear estimate sees nothing."""
    logits = torch.tensor([[0.0, -40.0, -40.0]], dtype=torch.float64)
    log_pattern = logits.log_softmax(-1)
    grad = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    delta = torch.tensor([[0.0, 45.0, 0.0]], dtype=torch.float64)
    exact = key_terms(log_pattern, grad, delta, "exact")[0, 1]
    linear = key_terms(log_pattern, grad, delta, "linear")[0, 1]
    new = (logits + delta).softmax(-1)
    truth = ((new - log_pattern.exp()) * grad).sum()
    assert float(exact) == pytest.approx(float(truth), rel=1e-12)
    assert float(truth) > 0.99 and abs(float(linear)) < 1e-14
    # log(1 - A) of the saturated entry is exact, not log(0)
    assert float(log_other_mass(log_pattern)[0, 0]) == pytest.approx(-40 + math.log(2), rel=1e-12)


# --------------------------------------------------------------------------------------------
# linear = finite-difference derivative


@pytest.mark.parametrize("arch", ["gpt2", "native_gqa"] if has_bridge() else ["hooked"])
@pytest.mark.parametrize("kind", ["query", "key"])
def test_linear_equals_finite_difference(arch, kind):
    model = one_layer("native_gqa") if arch == "native_gqa" else toy(arch)
    layer = 0
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, metric_all, method="linear")
    name = qk_name(model, kind, layer)
    base, other = activation(model, CORRUPTED, name), activation(model, CLEAN, name)
    eps = 1e-5
    for head, position in ((0, 5), (1, 6), (1, 2)):

        def moved(sign, head=head, position=position):
            def patch(x, hook):
                x = x.clone()
                step = other[:, position, head] - base[:, position, head]
                x[:, position, head] = base[:, position, head] + sign * eps * step
                return x

            with torch.no_grad(), model.hooks(fwd_hooks=[(name, patch)]):
                return metric_all(model(CORRUPTED))

        fd = (moved(1) - moved(-1)) / (2 * eps)
        ours = att.by_position[kind][:, layer, head, position].double()
        assert float(fd.abs().max()) > 1e-6
        assert torch.allclose(ours, fd, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------------------------
# result API, TL 4 round trip


def test_scores_top_and_edges_are_consistent():
    model = toy(multi_layer_archs()[-1])
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    n_kv = att.n_kv_heads
    assert att.scores["query"].shape == (2, att.n_heads)
    assert att.scores["key"].shape == (2, n_kv)
    assert att.by_position["key"].shape == (2, 2, n_kv, CLEAN.shape[1])
    assert torch.allclose(att.scores["query"], att.by_position["query"].sum(-1).mean(0))
    group = att.n_heads // n_kv
    summed = att.key_by_head.reshape(2, 2, n_kv, group, -1).sum(3)
    assert torch.allclose(summed, att.by_position["key"], atol=1e-7)
    assert torch.allclose(att.edges.sum(-1), att.by_position["pattern"], atol=1e-7)
    top = att.top_heads(3, node="query")
    assert len(top) == 3 and abs(top[0][2]) >= abs(top[1][2]) >= abs(top[2][2])
    assert att.scores["query"][top[0][0], top[0][1]] == pytest.approx(top[0][2])
    layer, head, q, k, value = att.top_edges(1)[0]
    assert value == pytest.approx(float(att.edges[0].abs().max())) or value < 0
    assert k <= q
    # identical prefix (position 0, 1 of pair 0): nothing to patch there
    assert float(att.by_position["query"][0, :, :, :2].abs().max()) < 1e-12


@pytest.mark.tl4  # TransformerLens 4's attribution module (Node, AttributionResult, faithfulness)
def test_to_transformer_lens_round_trip_and_faithfulness():
    from transformer_lens.tools.analysis.attribution_patching import (
        EdgeAttributionConfig,
        Node,
        attribution_patch,
        faithfulness,
    )

    model = toy("gpt2")
    clean, corrupted = CLEAN[:1], CORRUPTED[:1]

    one = logit_diff([30], [32])

    def metric(logits):
        return one(logits).sum()

    att = ra_lens.attention_attribution(model, clean, corrupted, one)
    result = att.to_transformer_lens()
    assert len(result.node_scores) == 2 * (4 + 4) * clean.shape[1]  # layers x (q + k heads) x pos
    node = Node(kind="k_input", position=5, layer=1, head=2)
    assert result.node_scores[node] == pytest.approx(float(att.by_position["key"][0, 1, 2, 5]))
    top = result.top_nodes(5)
    assert [abs(s) for _, s in top] == sorted((abs(s) for _, s in top), reverse=True)
    kind = {"q_input": "query", "k_input": "key"}
    best = max(
        (
            (la, h, p, kd)
            for kd in ("query", "key")
            for la in (0, 1)
            for h in range(4)
            for p in range(9)
        ),
        key=lambda n: abs(float(att.by_position[n[3]][0, n[0], n[1], n[2]])),
    )
    assert top[0][0] == Node(kind={"query": "q_input", "key": "k_input"}[best[3]], position=best[2],
                             layer=best[0], head=best[1])  # fmt: skip
    assert kind[top[0][0].kind] == best[3]

    # a circuit chosen from it: every edge except those into q/k inputs outside the top nodes
    # (TL's own edge sweep enumerates the graph)
    edge_config = EdgeAttributionConfig(granularity="edge")
    edges = list(attribution_patch(model, clean, corrupted, metric, edge_config).edge_scores)
    kept_nodes = {n for n, _ in result.top_nodes(10)}
    circuit = [e for e in edges if e[1].kind not in ("q_input", "k_input") or e[1] in kept_nodes]
    full = faithfulness(model, clean, corrupted, metric, edges)
    assert full.recovered == pytest.approx(1.0, abs=1e-9)
    part = faithfulness(model, clean, corrupted, metric, circuit)
    assert math.isfinite(part.recovered) and part.circuit_size == len(circuit) < len(edges)


# --------------------------------------------------------------------------------------------
# bad input, state


def test_bad_input_raises_clearly():
    model = toy(multi_layer_archs()[0])
    with pytest.raises(ValueError, match="same token length|token length"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED[:, :-1], METRIC)
    with pytest.raises(ValueError, match="unknown nodes"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, nodes=("value",))
    with pytest.raises(ValueError, match="unknown method"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, method="ig")
    with pytest.raises(ValueError, match="unknown direction"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, direction="up")
    with pytest.raises(ValueError, match="clean but"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED[:1], METRIC)
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, nodes=("query",))
    with pytest.raises(ValueError, match="was not computed"):
        att.top_heads(3, node="key")


@pytest.mark.tl4  # the OPT adapter (attention delegated to HF) exists in TL 4's bridge only
def test_dead_pattern_hook_is_refused(monkeypatch):
    """An adapter that delegates attention where live_attention cannot help (simulated on OPT,
    which it does help) is refused, naming the cause."""
    from ra_lens import liveness

    model = tiny_model("opt", dtype=torch.float64)
    monkeypatch.setattr(liveness, "_seamable", lambda model: set())
    with pytest.raises(
        RuntimeError,
        match=r"hook_pattern of layers \[0, 1\] is not in the autograd graph .* "
        r"attention_attribution needs R = dM/dA there; use a model that computes attention",
    ):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)


def test_unequal_string_pairs_name_the_pair():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    model = toy(multi_layer_archs()[0])
    if getattr(model, "tokenizer", None) is None:
        model.set_tokenizer(AutoTokenizer.from_pretrained(tiny_tokenizer_dir()))
    with pytest.raises(ValueError, match="pair 1"):
        ra_lens.attention_attribution(
            model, ["The quick", "The quick brown fox"], ["The quick", "The dog"], METRIC
        )


@pytest.mark.tl4  # TL 4's native rotary attention lists hook_rot_q/hook_rot_k but never fires them
def test_unexposed_rotary_queries_are_refused():
    model = one_layer_model(positional_embedding_type="rotary")
    with pytest.raises(RuntimeError, match="never fired"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)


# --------------------------------------------------------------------------------------------
# the ranking and the task data


def test_exact_qk_ranking_is_query_plus_key_through_each_head():
    from ra_lens import ranking
    from ra_lens.metrics import target_prob

    model = toy("llama" if has_bridge() else "hooked")
    targets = torch.tensor([30, 31])
    scores = ranking.exact_qk_attribution(model, CLEAN, CORRUPTED, targets, batch_size=1)
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, target_prob(targets))
    expected = (att.by_position["query"].sum(-1) + att.key_by_head.sum(-1)).mean(0)
    assert scores.shape == (2, 4)
    assert torch.allclose(scores, expected, atol=1e-7)
    assert float(scores.abs().max()) > 0


def test_ioi_and_capital_pairs():
    from ra_lens.tasks import ioi

    pairs = ioi.ioi_pairs(40)
    assert len(pairs) == 40 and len(set(pairs)) == 40
    first = pairs[0]
    assert first.clean == "When Mary and John went to the store, John gave a drink to"
    assert first.corrupted == "When Alice and Bob went to the store, John gave a drink to"
    assert (first.answer, first.wrong) == (" Mary", " John")
    for p in pairs:
        io, s = p.answer.strip(), p.wrong.strip()
        assert io != s and p.clean.count(s) == 2 and p.clean.count(io) == 1
        assert io not in p.corrupted and p.corrupted.count(s) == 1
        # the second clause is untouched: only the first clause's names differ
        assert p.clean.split(",")[-1] == p.corrupted.split(",")[-1] or "." in p.clean
    capitals = ioi.capital_pairs()
    assert len(capitals) >= 30
    assert all(p.answer != p.wrong and p.clean != p.corrupted for p in capitals)


@pytest.mark.real_model
def test_real_model_pairs_and_exact_key_delta(smollm2):
    from ra_lens.tasks import ioi

    pairs = ioi.usable(smollm2, ioi.ioi_pairs(40))
    assert len(pairs) >= 30
    assert len(ioi.usable(smollm2, ioi.capital_pairs(smollm2))) >= 30
    clean, corrupted, metric = ioi.paired_batch(smollm2, pairs[:1])
    att = ra_lens.attention_attribution(smollm2, clean, corrupted, metric, layers=[20])
    assert float(att.clean_metric[0]) > float(att.corrupted_metric[0])  # clean favours " Mary"
    # the key of KV head 1 at position 2 (" Mary" vs " Alice") through the rotary hooks
    name = "blocks.20.attn.hook_rot_k"
    source = activation(smollm2, clean.tokens, name)

    def patch(x, hook):
        x = x.clone()
        x[:, 2, 1] = source[:, 2, 1]
        return x

    seen = {}
    with (
        torch.no_grad(),
        smollm2.hooks(
            fwd_hooks=[
                (name, patch),
                (capture.PATTERN.format(20), lambda x, hook: seen.update(a=x)),
            ]
        ),
    ):
        smollm2(corrupted.tokens)
    true = seen["a"][0].double() - att.patterns[0, 0].double()
    ours = att.delta_pattern("key", 20, 1, 2)
    assert float(true.abs().max()) > 1e-4
    assert float((ours - true).abs().max()) < 1e-5


@pytest.mark.tl4  # the CLI's tiny models are TransformerBridge toys
def test_cli_attribute_writes_tables_plots_and_json(tmp_path, capsys):
    import json

    from ra_lens.cli import main

    out = tmp_path / "out"
    code = main(
        [
            "attribute", "--model", "tiny-llama",
            "--clean", "When Mary and John went to the store, John gave a drink to",
            "--corrupted", "When John and Mary went to the store, John gave a drink to",
            "--target", "a", "--wrong", "b", "--top", "4",
            "--out", str(out), "--json", str(tmp_path / "a.json"),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "top key nodes" in printed and "top edges" in printed
    data = json.loads((tmp_path / "a.json").read_text())
    assert set(data["top"]) == {"pattern", "query", "key"} and len(data["top_edges"]) == 4
    assert len(data["scores"]["key"][0]) == 2  # the toy Llama has 2 key/value heads
    assert abs(data["top_edges"][0]["value"]) >= abs(data["top_edges"][-1]["value"])
    for name in ("attribution_heatmaps.png", "top_edges.png", "edges.html"):
        assert (out / name).stat().st_size > 1000
    assert (
        "<script" in (out / "edges.html").read_text()
        and "http" not in (out / "edges.html").read_text()[:2000]
    )
    assert main(["attribute", "--model", "tiny-llama", "--clean", "a b", "--corrupted", "a",
                 "--target", "a"]) == 2  # fmt: skip


@pytest.mark.tl4  # attention soft-capping is built with TL 4's native bridge
def test_attention_that_is_not_plain_softmax_is_refused():
    model = one_layer_model(attn_scores_soft_cap=0.05)
    with pytest.raises(ValueError, match="differs from hook_pattern"):
        ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)


@pytest.mark.tl4  # the experiment runs on TL 4 bridges (toy Llama here)
def test_experiment_measure_on_a_toy():
    from ra_lens.experiments import attention_attribution as experiment
    from ra_lens.ranking.statistics import pearson
    from ra_lens.tasks.ioi import PromptPair, paired_batch

    model = toy("llama")
    pairs = [
        PromptPair("When Mary and John went to the store, John gave a drink to",
                   "When John and Mary went to the store, John gave a drink to", "a", "b"),
        PromptPair("When John and Mary went to the store, Mary gave a drink to",
                   "When Mary and John went to the store, Mary gave a drink to", "b", "a"),
    ]  # fmt: skip
    result = experiment.measure(model, pairs, "toy", n_position_heads=2, progress=False)
    data = result.to_dict()
    assert set(data["stats"]) == {"query", "key", "pattern"}
    assert data["scores"]["truth"]["key"] and len(data["scores"]["truth"]["key"][0]) == 2
    # a tiny random model: everything is nearly linear, so the estimates match the truth
    for kind in ("query", "key"):
        assert data["stats"][kind]["pearson_exact"] > 0.99
        assert data["per_position"][kind]["max_abs_error_exact"] < 1e-5
    clean, corrupted, metric = paired_batch(model, pairs)
    ig = ra_lens.attention_attribution(model, clean, corrupted, metric, method="exact-ig", steps=5)
    assert data["ig_steps"] == 5
    for kind in ("query", "key", "pattern"):
        assert data["scores"]["exact_ig"][kind] == ig.scores[kind].tolist()
        assert data["stats"][kind]["pearson_exact_ig"] == pearson(
            ig.scores[kind], result.truth[kind]
        )
    assert "| toy | query |" in experiment.markdown([result])
    # The truth of an earlier run is taken as it is for the same pairs, refused for others.
    again = experiment.measure(model, pairs, "toy", n_position_heads=2, progress=False,
                               stored=json.loads(json.dumps(data)))  # fmt: skip
    assert again.truth_reused and not result.truth_reused
    assert again.to_dict()["stats"] == data["stats"]
    assert again.seconds["truth"] == result.seconds["truth"]
    with pytest.raises(ValueError, match="other pairs"):
        experiment.measure(model, pairs[::-1], "toy", progress=False, stored=data)


EXPERIMENT_FILE = "a results file (a file attention_attribution --json wrote)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "foo"], "unknown task 'foo': choose from ioi, country-capital"),
        (["--tasks", " , "], "unknown task (none): choose from ioi, country-capital"),
        (["--n-truth", "-1"], "--n-truth must be at least 1, got -1"),
        (["--max-rows", "0"], "--max-rows must be at least 1, got 0"),
        (["--ig-steps", "0"], "--ig-steps must be at least 1, got 0"),
        (["--json", "{tmp}"], "--json {tmp} is a folder: give the name of a file (in it or "
         "elsewhere)"),
        (["--json", "{tmp}/list.json"], f"--json {{tmp}}/list.json is not {EXPERIMENT_FILE}: it "
         "holds no JSON object"),
        (["--json", "{tmp}/broken.json"], "{tmp}/broken.json is not valid JSON (Expecting "
         f"property name enclosed in double quotes: line 1 column 2 (char 1)): pass {EXPERIMENT_FILE}"),
        (["--truth-from", "{tmp}/missing.json"], "{tmp}/missing.json: no such file"),
        (["--truth-from", "{tmp}/list.json"], f"--truth-from {{tmp}}/list.json is not "
         f"{EXPERIMENT_FILE}: it holds no JSON object"),
    ],
)  # fmt: skip
def test_experiment_command_line_errors_are_one_line_before_the_model_loads(
    tmp_path, capsys, monkeypatch, argv, message
):
    import ra_lens.models
    from ra_lens.experiments import attention_attribution as experiment

    loaded: list[str] = []
    monkeypatch.setattr(ra_lens.models, "load_model", lambda *a, **k: loaded.append("model"))
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "broken.json").write_text("{")
    out = ["--json", str(tmp_path / "out.json")]  # never docs/results/attribution.json
    assert experiment.main([*out, *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err == f"attention_attribution: error: {message.format(tmp=tmp_path)}\n"
    assert loaded == [] and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("arch", multi_layer_archs())
def test_node_patching_is_a_hand_written_patch_of_every_head(arch):
    from ra_lens.experiments.attention_attribution import node_patching

    model = toy(arch)
    clean, corrupted = ra_lens.to_batch(model, CLEAN), ra_lens.to_batch(model, CORRUPTED)
    truth = node_patching(model, clean, corrupted, METRIC, progress=False)
    n_kv = capture.model_shape(model).n_kv_heads
    assert truth["key"].shape == (2, n_kv) and truth["query"].shape == (2, 4)
    before = base_metric(model, CORRUPTED)
    for kind, values in truth.items():
        for layer in range(values.shape[0]):
            for head in range(values.shape[1]):
                after, _ = patch_run(model, CORRUPTED, CLEAN, kind, layer, head, slice(None))
                expected = float((after - before).double().mean())
                assert values[layer, head].item() == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert float(truth["query"].abs().max()) > 1e-7  # a tiny random model: small but real


# --------------------------------------------------------------------------------------------
# exact-ig: the exact estimate averaged along the embedding path


@pytest.mark.parametrize("arch", multi_layer_archs())
def test_exact_ig_with_one_step_is_exact_and_converges(arch):
    model = toy(arch)
    exact = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    one = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, method="exact-ig", steps=1)
    for kind in ("query", "key", "pattern"):
        assert torch.equal(one.by_position[kind], exact.by_position[kind])

    def ig(steps):
        att = ra_lens.attention_attribution(
            model, CLEAN, CORRUPTED, METRIC, method="exact-ig", steps=steps
        )
        return torch.cat([att.by_position[k].double().flatten() for k in ("query", "key")])

    coarse, fine, finer = ig(2), ig(8), ig(16)
    assert float((fine - finer).abs().max()) < 0.2 * float((coarse - finer).abs().max())


@pytest.mark.parametrize("arch", multi_layer_archs())
def test_exact_ig_reads_each_layers_facts_once(arch, monkeypatch):
    """One exact-ig call (4 steps) reads attention_facts and block_layout at most once per layer
    (before: attention_facts per layer and step), with the same numbers."""
    model = toy(arch)
    before = ra_lens.attention_attribution(
        model, CLEAN, CORRUPTED, METRIC, method="exact-ig", steps=4
    )
    calls = count_fact_reads(monkeypatch)
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, method="exact-ig", steps=4)
    n_layers = int(model.cfg.n_layers)
    assert calls["attention_facts"] <= n_layers and calls["block_layout"] <= n_layers, calls
    for kind in ("query", "key", "pattern"):
        assert torch.equal(att.by_position[kind], before.by_position[kind])
    assert float(att.by_position["query"].abs().max()) > 0


@pytest.mark.parametrize("kind", one_layer_kinds())
def test_exact_ig_query_node_is_the_hand_written_path_average(kind):
    """steps=2: the mean of the exact estimate on the corrupted run and of the same query shift
    (q_clean - q_corrupted) applied at the embedding midpoint, with that run's q, k, A and R."""
    model = one_layer(kind, q_gain=30.0)
    att = ra_lens.attention_attribution(
        model, CLEAN, CORRUPTED, metric_all, method="exact-ig", steps=2
    )
    exact = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, metric_all)
    q_name, k_name = qk_name(model, "query", 0), qk_name(model, "key", 0)
    embed = {tag: activation(model, tokens, capture.RESID_PRE.format(0))
             for tag, tokens in (("clean", CLEAN), ("corrupted", CORRUPTED))}  # fmt: skip
    q_clean, q_corrupted = activation(model, CLEAN, q_name), activation(model, CORRUPTED, q_name)
    seen = {}

    def keep(name):
        def hook(x, hook):
            seen[name] = x
            return x

        return hook

    middle = embed["clean"] + 0.5 * (embed["corrupted"] - embed["clean"])
    hooks = [(capture.RESID_PRE.format(0), lambda x, hook: middle.clone().requires_grad_(True))]
    hooks += [(name, keep(name)) for name in (q_name, k_name, capture.PATTERN.format(0))]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        value = metric_all(model(CORRUPTED)).sum()
        (R,) = torch.autograd.grad(value, seen[capture.PATTERN.format(0)])
    q, k, A = (seen[n].detach() for n in (q_name, k_name, capture.PATTERN.format(0)))
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    shifted = q + (q_clean - q_corrupted)
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    logits = torch.einsum("bqhd,bkhd->bhqk", shifted, k) / capture.attention_scale(model, 0)
    new = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    at_middle = ((new - A) * R).sum(-1)  # [batch head query]
    expected = 0.5 * (at_middle + exact.by_position["query"][:, 0].double())
    got = att.by_position["query"][:, 0].double()
    assert float(at_middle.abs().max()) > 1e-2
    assert torch.allclose(got, expected, atol=1e-6 * float(expected.abs().max()))
    assert not torch.allclose(got, exact.by_position["query"][:, 0].double(), atol=1e-3)


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


@pytest.mark.parametrize("method", ["exact", "linear"])
def test_attribution_with_a_metric_running_the_model(model, method):
    other = CLEAN.flip(0)
    expected = ra_lens.attention_attribution(
        model, CLEAN, CORRUPTED, kl_to(model, other, inside=False), method=method
    )
    got = ra_lens.attention_attribution(
        model, CLEAN, CORRUPTED, kl_to(model, other, inside=True), method=method
    )
    assert expected.edges.abs().max() > 1e-8
    torch.testing.assert_close(got.edges, expected.edges, rtol=0, atol=1e-12)
    for kind in expected.nodes:
        torch.testing.assert_close(got.by_position[kind], expected.by_position[kind])


@pytest.fixture(scope="module")
def mixed(model):
    """Two pairs of different real lengths (9 and 7 tokens, right-padded)."""
    lengths = torch.tensor([9, 7])
    clean, corrupted = Batch(CLEAN, lengths), Batch(CORRUPTED, lengths)
    return ra_lens.attention_attribution(model, clean, corrupted, target_nll([5]))


@pytest.mark.tl4  # TransformerLens 4's AttributionResult
def test_to_transformer_lens_refuses_noise(model):
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, direction="noise")
    with pytest.raises(ValueError, match="direction='denoise' only"):
        att.to_transformer_lens()


@pytest.mark.tl4
def test_to_transformer_lens_refuses_to_average_pairs_of_different_lengths(mixed):
    with pytest.raises(ValueError, match=r"the pairs have \[7, 9\] tokens"):
        mixed.to_transformer_lens()
    from transformer_lens.tools.analysis.attribution_patching import Node

    one = mixed.to_transformer_lens(pair=1)  # one pair: its own 7 positions
    assert len(one.node_scores) == 2 * 2 * 4 * 7
    node = Node(kind="q_input", position=6, layer=1, head=3)
    assert one.node_scores[node] == pytest.approx(float(mixed.by_position["query"][1, 1, 3, 6]))


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_clean_and_corrupted_metric_keep_their_meaning(model, direction):
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, direction=direction)
    with torch.no_grad():
        clean, corrupted = METRIC(model(CLEAN)), METRIC(model(CORRUPTED))
    torch.testing.assert_close(att.clean_metric, clean.float())
    torch.testing.assert_close(att.corrupted_metric, corrupted.float())


def test_attribution_top_heads_to_dict_and_save_load(model, tmp_path):
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC)
    (layer, head, score), *_ = att.top_heads(3, node="key")
    assert score == pytest.approx(float(att.scores["key"][att.layers.index(layer), head]))
    assert abs(score) == pytest.approx(float(att.scores["key"].abs().max()))
    report = att.to_dict(k=2, pair=1)
    assert report["top"]["query"][0]["score"] == att.top_heads(1)[0][2]
    assert report["top_edges"][0]["value"] == att.top_edges(1, batch=1)[0][4]
    assert report["clean_metric"] == att.clean_metric.tolist()
    att.save(tmp_path / "att.safetensors")
    back = ra_lens.AttentionAttribution.load(tmp_path / "att.safetensors")
    assert back.to_dict(k=5) == att.to_dict(k=5)
    torch.testing.assert_close(
        back.delta_pattern("key", 1, 2, 5), att.delta_pattern("key", 1, 2, 5), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="not written by AttentionAttribution.save"):
        ra_lens.AttentionAttribution.load(_saved_ra(model, tmp_path))


def _saved_ra(model, folder):
    ra_lens.reversed_attention(model, CLEAN, target_nll([5])).save(folder / "ra.safetensors")
    return folder / "ra.safetensors"


@pytest.mark.parametrize("k", [0, -3])
def test_top_heads_refuses_a_non_positive_k(model, k):
    att = ra_lens.attention_attribution(model, CLEAN, CORRUPTED, METRIC, nodes=["query"])
    with pytest.raises(ValueError, match=r"k must be an int >= 1 \(a number of heads\)"):
        att.top_heads(k)
    ra = ra_lens.reversed_attention(model, CLEAN, target_nll([5]), keep="norms")
    with pytest.raises(ValueError, match=r"k must be an int >= 1 \(a number of heads\)"):
        ra.top_heads(k)
