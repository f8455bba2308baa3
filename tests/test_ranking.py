"""Head rankings against brute-force references, ablation curves, comparisons, the experiment."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_CORRUPTED as CORRUPTED
from helpers import TOY_TARGETS as TARGETS
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked, has_bridge, live_archs

import ra_lens
from ra_lens import capture, tasks
from ra_lens import ranking as rk
from ra_lens.capture import PATTERN, Z
from ra_lens.experiments import HeadRankingResult, head_ranking
from ra_lens.experiments.head_ranking import RANKINGS, check_rankings
from ra_lens.metrics import target_nll
from ra_lens.patching import head_ablation_hooks, mean_head_outputs
from ra_lens.tasks import Accuracy, shuffled_label_prompts, task_prompts
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def model(request):
    return tiny_model(request.param, n_layers=2)


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


@pytest.fixture(scope="module")
def small_llama(llama):
    """`llama` with HuggingFace's initial weight scale (std 0.02). HookedTransformer starts at
    0.8 / sqrt(d_model) = 0.14: its heads then move p(target) too far for a first-order estimate
    to track, so its matrices are scaled down to the HF toys' size."""
    if has_bridge():
        return llama
    model = tiny_model("hooked", n_layers=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # embeddings and weight matrices; layer norms stay at 1
                p.mul_(0.02 / model.cfg.initializer_range)
    return model


def prob_last(logits: torch.Tensor, target: int) -> float:
    return float(logits[0, -1].double().softmax(-1)[target])


def z_setter(head: int, value: torch.Tensor | None = None):
    """A hand-written hook writing zeros (or `value`) into one head of hook_z."""

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0 if value is None else value[:, :, head]
        return z

    return hook


def clean_z(model, tokens):
    seen = {}

    def keep(layer):
        def hook(z, hook):
            seen[layer] = z.detach().clone()

        return hook

    hooks = [(Z.format(la), keep(la)) for la in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens)
    return seen


# --------------------------------------------------------------------------------------------
# rankings against brute force


def test_ra_ranking_equals_reversed_attention_head_norms(model):
    reference = ra_lens.reversed_attention(model, CLEAN, target_nll(TARGETS)).head_norms()
    scores = rk.ra_ranking(model, CLEAN, TARGETS, batch_size=2)
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-8)


def test_ra_loss_row_is_the_norm_of_the_last_row(model):
    expected = []
    for text, target in zip(CLEAN, TARGETS, strict=True):
        ra = ra_lens.reversed_attention(model, text, target_nll([target]), keep="maps")
        expected.append(ra.maps[0, :, :, -1, :].double().norm(dim=-1).float())
    scores = rk.ra_ranking(model, CLEAN, TARGETS, loss_row=True, batch_size=2)
    torch.testing.assert_close(scores, torch.stack(expected).mean(0), rtol=1e-5, atol=1e-8)
    full = rk.ra_ranking(model, CLEAN, TARGETS)
    assert (scores <= full + 1e-6).all()  # one row of a map is never larger than the whole map


def test_forward_ranking_equals_forward_norms(model):
    reference = ra_lens.reversed_attention(model, CLEAN, target_nll(TARGETS)).forward_norms()
    scores = rk.forward_ranking(model, CLEAN, batch_size=2)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-6)


def test_causal_mediation_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(CLEAN, TARGETS, strict=True):
            tokens = model.to_tokens(text)
            before = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):
                    with model.hooks(fwd_hooks=[(Z.format(layer), z_setter(head))]):
                        after = prob_last(model(tokens), target)
                    expected[layer, head] += (before - after) / len(CLEAN)
    scores = rk.causal_mediation(model, CLEAN, TARGETS, batch_size=2)
    assert scores.shape == (n_layers, n_heads)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-7)


def test_activation_patching_with_transformer_lens_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
            source = clean_z(model, model.to_tokens(clean))
            tokens = model.to_tokens(corrupted)
            base = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):
                    hook = z_setter(head, source[layer])
                    with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                        patched = prob_last(model(tokens), target)
                    expected[layer, head] += (patched - base) / len(CLEAN)
    scores = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    assert scores.shape == (n_layers, n_heads)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)


def test_attribution_patching_equals_grad_times_difference_by_hand(model):
    n_layers = model.cfg.n_layers
    expected = torch.zeros(n_layers, model.cfg.n_heads, dtype=torch.float64)
    for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
        source = clean_z(model, model.to_tokens(clean))
        tokens = model.to_tokens(corrupted)
        base = clean_z(model, tokens)
        for layer in range(n_layers):
            # One layer at a time: its hook_z becomes a leaf, later layers still see its effect.
            leaf = base[layer].clone().requires_grad_(True)
            hook = (Z.format(layer), lambda z, hook, leaf=leaf: leaf)
            with torch.enable_grad(), model.hooks(fwd_hooks=[hook]):
                p = model(tokens)[0, -1].softmax(-1)[target]
                (grad,) = torch.autograd.grad(p, [leaf])
            diff = source[layer] - base[layer]
            expected[layer] += (grad * diff).sum((0, 1, 3)).double() / len(CLEAN)
    scores = rk.attribution_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-9)
    assert not any(p.grad is not None for p in model.parameters())


def pattern_grad_and_values(model, tokens, target, layer):
    """(dp(target)/dA, A) of one layer's hook_pattern, [head query key]: the pattern is swapped
    for a leaf of the same value."""
    seen = {}

    def leaf(pattern, hook):
        seen["a"] = pattern.detach().clone().requires_grad_(True)
        return seen["a"]

    with torch.enable_grad(), model.hooks(fwd_hooks=[(PATTERN.format(layer), leaf)]):
        p = model(tokens)[0, -1].double().softmax(-1)[target]
        (grad,) = torch.autograd.grad(p, [seen["a"]])
    return grad[0].double(), seen["a"][0].detach().double()


def patched_pattern(model, tokens, name, source, position):
    """One layer's pattern [head query key] with activation `name` (hook_q or hook_k) at
    `position` taken from `source`: the exact softmax, whatever the model computes."""

    def patch(x, hook):
        x = x.clone()
        x[:, position] = source[:, position]
        return x

    pattern = PATTERN.format(int(name.split(".")[1]))
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, patch)]):
        with capture.recorded(model, [pattern]) as acts:
            model(tokens)
    return acts[pattern][0].double()


@pytest.mark.parametrize("arch", live_archs())
def test_exact_qk_attribution_equals_exact_patterns_times_the_gradient(arch):
    model = tiny_model(arch, n_layers=2, dtype=torch.float64)
    # score[l, h] = mean_i sum_q R[q] . (A with h's query at q from clean - A)[q]
    #             + sum_k sum_q R[q] . (A with h's key/value head's key at k from clean - A)[q],
    # R = dp(target)/dA of head h on the corrupted run; each patched pattern read from the model.
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for clean, corrupted, target in zip(CLEAN, CORRUPTED, TARGETS, strict=True):
        clean_tokens, tokens = model.to_tokens(clean), model.to_tokens(corrupted)
        names = [f"blocks.{la}.attn.hook_{x}" for la in range(n_layers) for x in "qk"]
        with torch.no_grad(), capture.recorded(model, names) as acts:
            model(clean_tokens)
        sources = {name: acts[name].detach().clone() for name in names}
        for layer in range(n_layers):
            grad, base = pattern_grad_and_values(model, tokens, target, layer)
            for kind in "qk":
                name = f"blocks.{layer}.attn.hook_{kind}"
                for position in range(tokens.shape[1]):
                    # every head (or key/value head) at once: a head's pattern reads only its
                    # own query and its key/value head's keys
                    new = patched_pattern(model, tokens, name, sources[name], position)
                    expected[layer] += (grad * (new - base)).sum((1, 2)) / len(CLEAN)
    scores = rk.exact_qk_attribution(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    # the HF toys' near-uniform attention gives effects of 1e-8..1e-7 (HF takes the softmax in
    # float32 even for float64 models: errors up to 6e-11); HookedTransformer's are ~1e-5
    assert expected.abs().max() > 1e-8
    torch.testing.assert_close(scores.double(), expected, rtol=1e-3, atol=1e-10)
    assert not any(p.grad is not None for p in model.parameters())


def test_patching_rankings_vanish_without_corruption(llama):
    same = rk.activation_patching(llama, CLEAN, CLEAN, TARGETS)
    torch.testing.assert_close(same, torch.zeros_like(same))
    attribution = rk.attribution_patching(llama, CLEAN, CLEAN, TARGETS)
    torch.testing.assert_close(attribution, torch.zeros_like(attribution))


def test_attribution_patching_approximates_activation_patching(llama):
    exact = rk.activation_patching(llama, CLEAN, CORRUPTED, TARGETS)
    approx = rk.attribution_patching(llama, CLEAN, CORRUPTED, TARGETS)
    assert rk.spearman(exact, approx) > 0.8


def test_random_ranking_is_seeded():
    a = rk.random_ranking(3, 4, seed=1)
    torch.manual_seed(123)
    b = rk.random_ranking(3, 4, seed=1)
    assert a.shape == (3, 4)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, rk.random_ranking(3, 4, seed=2))


def test_layer_ranking_and_head_order():
    scores = rk.layer_ranking(3, 2)
    assert scores.tolist() == [[0, 0], [1, 1], [2, 2]]
    assert rk.head_order(scores) == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert rk.head_order(scores, reverse=True) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    scores = torch.tensor([[0.1, 0.9], [0.5, -1.0]])
    assert rk.head_order(scores) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    assert rk.kept_heads(scores, 0.5) == [(0, 1), (1, 0)]
    assert rk.kept_heads(scores, 0.5, reverse=True) == [(1, 1), (0, 0)]


# --------------------------------------------------------------------------------------------
# comparisons


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(5, 4, generator=gen)
    b = (torch.rand(5, 4, generator=gen) * 3).round()  # many ties
    expected = stats.spearmanr(a.flatten().numpy(), b.flatten().numpy()).statistic
    assert rk.spearman(a, b) == pytest.approx(expected, abs=1e-9)
    assert rk.spearman(a, a) == pytest.approx(1.0)
    assert rk.spearman(a, -a) == pytest.approx(-1.0)
    assert math.isnan(rk.spearman(a, torch.zeros_like(a)))


def test_top_k_overlap():
    a = torch.arange(12.0).reshape(3, 4)
    assert rk.top_k_overlap(a, a, k=3) == 1.0
    assert rk.top_k_overlap(a, -a, k=3) == 0.0
    b = a.clone()
    b[2, 3] = -1.0  # a's best head drops to the bottom of b
    assert rk.top_k_overlap(a, b, k=4) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="k must be"):
        rk.top_k_overlap(a, b, k=13)
    with pytest.raises(ValueError, match="different shapes"):
        rk.spearman(a, a[:2])


# --------------------------------------------------------------------------------------------
# ablation


def test_ablation_hooks_really_zero_the_heads(llama):
    scores = rk.random_ranking(2, llama.cfg.n_heads, seed=3)
    kept = rk.kept_heads(scores, 0.5)
    ablated = [h for h in rk.head_order(scores) if h not in kept]
    seen = clean_z(llama, llama.to_tokens(CLEAN[0]))  # unablated
    after = {}

    def record(layer):
        def hook(z, hook):
            after[layer] = z.detach().clone()

        return hook

    hooks = head_ablation_hooks(ablated) + [(Z.format(la), record(la)) for la in range(2)]
    with torch.no_grad(), llama.hooks(fwd_hooks=hooks):
        llama(llama.to_tokens(CLEAN[0]))
    for layer, head in ablated:
        assert after[layer][:, :, head].abs().max() == 0
    for layer, head in kept:
        assert after[layer][:, :, head].abs().max() > 0
    # Layer 0 sees the unablated input, so its kept heads are untouched.
    for layer, head in kept:
        if layer == 0:
            torch.testing.assert_close(after[0][:, :, head], seen[0][:, :, head])
    # Every head ablated: the attention blocks add nothing (the tiny Llama has no o bias,
    # HookedTransformer's b_O starts at zero).
    everything = head_ablation_hooks(torch.ones(2, llama.cfg.n_heads, dtype=torch.bool))
    out = {}

    def attn_out(layer):
        def hook(x, hook):
            out[layer] = x.detach().clone()

        return hook

    with (
        torch.no_grad(),
        llama.hooks(
            fwd_hooks=everything + [(f"blocks.{la}.hook_attn_out", attn_out(la)) for la in range(2)]
        ),
    ):
        llama(llama.to_tokens(CLEAN[0]))
    assert all(out[la].abs().max() == 0 for la in range(2))


def test_ablation_curve_ablates_the_complement(llama):
    n_heads = llama.cfg.n_heads
    scores = torch.arange(2.0 * n_heads).reshape(2, n_heads)  # later heads score higher
    calls = []

    def fake(ablated):
        calls.append(list(ablated))
        return Accuracy.from_ranks(torch.tensor([len(ablated)]))

    curve = rk.ablation_curve(llama, ["unused"], scores, (0.0, 0.25, 1.0), evaluate=fake)
    total = 2 * n_heads
    assert curve.n_kept == [0, round(0.25 * total), total]
    assert calls[0] == sorted(rk.head_order(scores)) and calls[-1] == []
    assert set(calls[1]) == set(rk.head_order(scores)[curve.n_kept[1] :])
    reverse = rk.ablation_curve(llama, ["x"], scores, (0.25,), reverse=True, evaluate=fake)
    assert set(calls[-1]) == set(rk.head_order(scores, reverse=True)[reverse.n_kept[0] :])


def test_ablation_curve_on_the_task(llama):
    _, test = _toy_prompts(llama)
    scores = rk.random_ranking(2, llama.cfg.n_heads)
    curve = rk.ablation_curve(llama, test, scores, (0.0, 1.0))
    unablated = tasks.evaluate(llama, test)
    assert curve.accuracies[1].ranks.tolist() == unablated.ranks.tolist()
    everything = head_ablation_hooks(torch.ones(2, llama.cfg.n_heads, dtype=torch.bool))
    none_kept = tasks.evaluate(llama, test, fwd_hooks=everything)
    assert curve.accuracies[0].ranks.tolist() == none_kept.ranks.tolist()
    means = mean_head_outputs(llama, [p.text for p in test])
    mean_curve = rk.ablation_curve(llama, test, scores, (0.5,), mode="mean", means=means)
    ablated = sorted(rk.head_order(scores)[mean_curve.n_kept[0] :])
    hooks = head_ablation_hooks(ablated, mode="mean", means=means)
    expected = tasks.evaluate(llama, test, fwd_hooks=hooks)
    assert mean_curve.accuracies[0].ranks.tolist() == expected.ranks.tolist()
    with pytest.raises(ValueError, match="means"):
        rk.ablation_curve(llama, test, scores, (0.5,), mode="mean")


def test_auc_of_known_curves():
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]

    def curve(values):
        # n = 4 prompts; a top-1 accuracy of v means round(4 v) prompts ranked 0.
        accs = [
            Accuracy.from_ranks(torch.tensor([0] * round(4 * v) + [5] * (4 - round(4 * v))))
            for v in values
        ]
        return rk.AblationCurve(fractions, [0] * 5, accs)

    assert curve([0, 0.25, 0.5, 0.75, 1.0]).auc == pytest.approx(0.5)
    assert curve([1.0] * 5).auc == pytest.approx(1.0)
    assert curve([0, 1, 1, 1, 1]).auc == pytest.approx(0.875)
    assert curve([0, 1, 1, 1, 1]).auc_top3 == pytest.approx(0.875)
    assert curve([0] * 5).to_dict()["auc"] == 0.0


# --------------------------------------------------------------------------------------------
# bad input


def test_bad_input_gives_clear_errors(llama):
    n_heads = llama.cfg.n_heads
    scores = torch.zeros(2, n_heads)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rk.ablation_curve(llama, ["x"], scores, (0.0, 1.5))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rk.kept_heads(scores, -0.1)
    with pytest.raises(ValueError, match="shape"):
        rk.ablation_curve(llama, ["x"], torch.zeros(3, n_heads), (0.5,))
    with pytest.raises(ValueError, match="NaN"):
        rk.ablation_curve(llama, ["x"], torch.full((2, n_heads), float("nan")), (0.5,))
    with pytest.raises(TypeError, match="Tensor"):
        rk.ablation_curve(llama, ["x"], [[0.0] * n_heads] * 2, (0.5,))
    with pytest.raises(ValueError, match="unknown ranking 'gradient': choose from ra, ra_loss_row"):
        check_rankings(["ra", "gradient"])
    with pytest.raises(ValueError, match="same token length"):
        rk.activation_patching(llama, CLEAN[:2], ["Q: b\nA:", "Q: c\nA:"], TARGETS[:2])
    with pytest.raises(ValueError, match="targets for"):
        rk.causal_mediation(llama, CLEAN, TARGETS[:2])
    with pytest.raises(ValueError, match="unknown ranking"):
        head_ranking(llama, TOY, shots=2, n_prompts=2, rankings=("ra", "nope"))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        head_ranking(llama, TOY, shots=2, n_prompts=2, fractions=(0.0, 2.0))


# --------------------------------------------------------------------------------------------
# the experiment


def _toy_prompts(model):
    return task_prompts(model, TOY, shots=2)


def test_shuffled_label_prompts_keep_queries_and_move_every_label(llama):
    train, _ = _toy_prompts(llama)
    corrupted = shuffled_label_prompts(train, seed=0)
    for clean, bad in zip(train, corrupted, strict=True):
        assert (bad.query, bad.answer) == (clean.query, clean.answer)
        assert [x for x, _ in bad.demos] == [x for x, _ in clean.demos]
        assert sorted(y for _, y in bad.demos) == sorted(y for _, y in clean.demos)
        assert all(a != b for (_, a), (_, b) in zip(bad.demos, clean.demos, strict=True))
        assert bad.text == tasks.format_prompt(bad.demos, bad.query)
    assert tasks.prompt_lengths(llama, corrupted) == tasks.prompt_lengths(llama, train)
    one_shot = tasks.build_prompts(TOY, shots=1)
    moved = shuffled_label_prompts(one_shot)
    assert all(a.demos[0][1] != b.demos[0][1] for a, b in zip(moved, one_shot, strict=True))
    with pytest.raises(ValueError, match="demonstrations"):
        shuffled_label_prompts(tasks.build_prompts(TOY, shots=0))


@pytest.fixture(scope="module")
def result(llama):
    return head_ranking(llama, TOY, shots=2, n_prompts=6, fractions=(0.0, 0.5, 1.0), progress=False)


def test_head_ranking_end_to_end(llama, result, tmp_path):
    assert isinstance(result, HeadRankingResult)
    assert list(result.scores) == list(RANKINGS)
    shape = (llama.cfg.n_layers, llama.cfg.n_heads)
    assert all(tuple(s.shape) == shape for s in result.scores.values())
    assert result.n_prompts == 6 and result.n_patching == 6
    # Fraction 0 ablates everything and fraction 1 nothing, whatever the ranking.
    for curves in (result.curves, result.reverse_curves):
        for curve in curves.values():
            assert curve.accuracies[-1].ranks.tolist() == result.unablated.ranks.tolist()
            assert curve.top1[0] == result.curves["ra"].top1[0]
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data["rankings"]) == set(RANKINGS)
    for entry in data["rankings"].values():
        assert len(entry["curve"]) == len(entry["reverse_curve_top3"]) == 3
        assert entry["seconds"] >= 0
        assert 0 <= entry["auc"] <= 1 and 0 <= entry["reverse_auc_top3"] <= 1
    assert set(data["spearman"]) == set(RANKINGS) - {"ra"}
    assert data["top10_overlap"]["ra_loss_row"] >= 0
    assert all(-1 <= rho <= 1 for rho in data["spearman"].values())
    nan_result = HeadRankingResult(**{**result.__dict__, "spearman": {"random": float("nan")}})
    assert json.loads(json.dumps(nan_result.to_dict(), allow_nan=False))["spearman"] == {
        "random": None
    }
    table = result.table()
    assert "causal_mediation" in table and "faster than causal mediation" in table
    result.save_json(tmp_path / "out" / "ranking.json")
    assert json.loads((tmp_path / "out" / "ranking.json").read_text())["task"] == "toy"
    paths = result.plots(tmp_path / "figs")
    names = {p.name for p in paths}
    assert {"ablation_curves.png", "ranking_maps.png"} <= names
    assert all(p.stat().st_size > 0 for p in paths)


def test_head_ranking_rankings_match_the_library(llama, result):
    train, _ = task_prompts(llama, TOY, shots=2)
    train = train[:6]
    texts = [p.text for p in train]
    targets = [tasks.answer_token(llama, p.answer) for p in train]
    torch.testing.assert_close(result.scores["ra"], rk.ra_ranking(llama, texts, targets))
    torch.testing.assert_close(result.scores["random"], rk.random_ranking(2, llama.cfg.n_heads, 42))
    assert result.spearman["ra_loss_row"] == pytest.approx(
        rk.spearman(result.scores["ra"], result.scores["ra_loss_row"])
    )


def test_head_ranking_zero_shot_skips_patching_and_mean_ablates(llama):
    res = head_ranking(
        llama, TOY, shots=0, n_prompts=3, fractions=(0.0, 1.0), ablation="mean",
        rankings=("ra", "activation_patching", "indirect_effect", "random"), progress=False,
    )  # fmt: skip
    assert list(res.scores) == ["ra", "random"]
    assert any("zero-shot" in note for note in res.notes)
    assert res.ablation == "mean" and res.to_dict()["ablation"] == "mean"
    # Todd et al.'s mean: every training prompt (held out from the test), aligned at the last token
    train, _ = task_prompts(llama, TOY, shots=0, equal_length=False)
    assert res.n_means == len(train) and res.to_dict()["n_means"] == len(train)
    _, test = task_prompts(llama, TOY, shots=0)
    means = rk.last_token_means(llama, [p.text for p in train])
    hooks = rk.ablation_hooks(rk.head_order(torch.zeros(2, llama.cfg.n_heads)), means=means)
    lengths = tasks.prompt_lengths(llama, test)
    for i, prompt in enumerate(test):  # one prompt at a time: no padding to misalign the means
        alone = tasks.evaluate(llama, [prompt], fwd_hooks=hooks)
        assert res.curves["ra"].accuracies[0].ranks[i] == alone.ranks[0], lengths[i]
    with pytest.raises(ValueError, match="unknown ablation"):
        head_ranking(llama, TOY, shots=0, n_prompts=2, ablation="resample")


# --------------------------------------------------------------------------------------------
# mean ablation aligned at the last token


def test_last_token_means_by_hand(llama):
    means = rk.last_token_means(llama, CLEAN, batch_size=2)  # padded batches of unequal prompts
    zs = [clean_z(llama, llama.to_tokens(text)) for text in CLEAN]
    longest = max(z[0].shape[1] for z in zs)
    assert means.shape == (2, llama.cfg.n_heads, longest, llama.cfg.d_head)
    for layer in range(2):
        for j in range(longest):  # j tokens before each prompt's last token
            rows = [z[layer][0, -1 - j] for z in zs if z[layer].shape[1] > j]
            torch.testing.assert_close(means[layer, :, -1 - j], torch.stack(rows).mean(0))


def test_aligned_mean_ablation_writes_the_means_from_the_last_token_back(llama):
    means = rk.last_token_means(llama, CLEAN[2:])  # the shortest prompt: 8 positions
    m = means.shape[2]
    tokens = llama.to_tokens(CLEAN[0])
    n = tokens.shape[1]
    assert n > m
    seen = {}

    def record(z, hook):
        seen["z"] = z.detach().clone()

    hooks = rk.ablation_hooks([(1, 2)], means=means) + [(Z.format(1), record)]
    with torch.no_grad(), llama.hooks(fwd_hooks=hooks):
        llama(tokens)
    z = seen["z"][0, :, 2]  # [pos d_head]
    torch.testing.assert_close(z[n - m :], means[1, 2])
    # further back than the means reach: their mean over positions
    torch.testing.assert_close(z[: n - m], means[1, 2].mean(0).expand(n - m, -1))
    # a padded batch with its lengths gives every prompt what it gets alone
    batch = capture.to_batch(llama, CLEAN)
    padded = rk.ablation_hooks([(1, 2), (0, 1)], means=means, lengths=batch.lengths)
    with torch.no_grad(), llama.hooks(fwd_hooks=padded):
        together = llama(batch.tokens)
    alone_hooks = rk.ablation_hooks([(1, 2), (0, 1)], means=means)
    for i, text in enumerate(CLEAN):
        with torch.no_grad(), llama.hooks(fwd_hooks=alone_hooks):
            alone = llama(llama.to_tokens(text))
        last = int(batch.lengths[i]) - 1
        torch.testing.assert_close(together[i, last], alone[0, -1], rtol=1e-4, atol=1e-5)
    # 3-D means (patching.mean_head_outputs) keep the old behaviour: one vector everywhere
    flat = mean_head_outputs(llama, CLEAN)
    assert rk.ablation_hooks([(1, 2)], means=flat)[0][0] == Z.format(1)
    with pytest.raises(ValueError, match="do not fit"):
        rk.causal_mediation(llama, CLEAN, TARGETS, means=means[:1])


def test_causal_mediation_with_aligned_means_equals_a_loop_over_prompts(llama):
    means = rk.last_token_means(llama, CLEAN)
    expected = torch.zeros(2, llama.cfg.n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(CLEAN, TARGETS, strict=True):
            tokens = llama.to_tokens(text)
            before = prob_last(llama(tokens), target)
            for layer in range(2):
                for head in range(llama.cfg.n_heads):
                    with llama.hooks(fwd_hooks=rk.ablation_hooks([(layer, head)], means=means)):
                        after = prob_last(llama(tokens), target)
                    expected[layer, head] += (before - after) / len(CLEAN)
    scores = rk.causal_mediation(llama, CLEAN, TARGETS, means=means, batch_size=3)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)
    per_prompt = rk.causal_mediation(llama, CLEAN, TARGETS, means=means, per_prompt=True)
    assert per_prompt.shape == (3, 2, llama.cfg.n_heads)
    torch.testing.assert_close(per_prompt.mean(0), scores, rtol=1e-5, atol=1e-9)


# --------------------------------------------------------------------------------------------
# the new rankings against brute force


@pytest.fixture(scope="module")
def gpt2_64():
    # float64 throughout (HF's Llama RMSNorm computes in float32, too coarse for a finite difference)
    return tiny_model(arch_or_hooked("gpt2"), n_layers=2, dtype=torch.float64)


def _prob_along(model, tokens, target, layer, head, direction, t):
    """p(target) with z[layer, :, head] moved by t * direction (every position)."""

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = z[:, :, head] + t * direction(z[:, :, head])
        return z

    with torch.no_grad(), model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
        return prob_last(model(tokens), target)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_first_order_mediation_equals_a_finite_difference(gpt2_64, ablation):
    model = gpt2_64
    means = rk.last_token_means(model, CLEAN) if ablation == "mean" else None
    eps = 1e-4
    expected = torch.zeros(2, model.cfg.n_heads, dtype=torch.float64)
    for text, target in zip(CLEAN, TARGETS, strict=True):
        tokens = model.to_tokens(text)
        lengths = torch.tensor([tokens.shape[1]])
        for layer in range(2):
            for head in range(model.cfg.n_heads):
                if means is None:
                    ablated = torch.zeros(1, tokens.shape[1], model.cfg.d_head)
                else:  # what mean ablation writes into this head's hook_z
                    ablate = rk.ablation_hooks([(layer, head)], means=means, lengths=lengths)
                    with torch.no_grad(), model.hooks(fwd_hooks=ablate):
                        with capture.recorded(model, [Z.format(layer)]) as seen:
                            model(tokens)
                    ablated = seen[Z.format(layer)][:, :, head]

                def direction(z, ablated=ablated):  # towards the ablated value
                    return ablated.to(z) - z

                up = _prob_along(model, tokens, target, layer, head, direction, eps)
                down = _prob_along(model, tokens, target, layer, head, direction, -eps)
                expected[layer, head] -= (up - down) / (2 * eps) / len(CLEAN)  # p - p(ablated)
    scores = rk.first_order_mediation(model, CLEAN, TARGETS, means=means, batch_size=2)
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_first_order_mediation_ranks_like_causal_mediation_on_a_tiny_model(small_llama, ablation):
    model = small_llama
    means = rk.last_token_means(model, CLEAN) if ablation == "mean" else None
    exact = rk.causal_mediation(model, CLEAN, TARGETS, means=means)
    approx = rk.first_order_mediation(model, CLEAN, TARGETS, means=means)
    # random small weights: every head's effect is small, so the Taylor term is close
    assert rk.spearman(exact, approx) > 0.8
    torch.testing.assert_close(approx, exact, rtol=0.5, atol=1e-5)


def test_indirect_effect_equals_a_hand_written_loop(model):
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    clean = [clean_z(model, model.to_tokens(text)) for text in CLEAN]
    mean_last = {la: torch.stack([z[la][0, -1] for z in clean]).mean(0) for la in range(n_layers)}
    corrupted = CORRUPTED[:2] + ["Q: d\nA: of\n\nQ: the city to\nA:"]  # other lengths are fine
    expected = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    with torch.no_grad():
        for text, target in zip(corrupted, TARGETS, strict=True):
            tokens = model.to_tokens(text)
            base = prob_last(model(tokens), target)
            for layer in range(n_layers):
                for head in range(n_heads):

                    def hook(z, hook, layer=layer, head=head):
                        z = z.clone()
                        z[:, -1, head] = mean_last[layer][head]
                        return z

                    with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                        patched = prob_last(model(tokens), target)
                    expected[layer, head] += (patched - base) / len(corrupted)
    scores = rk.indirect_effect(model, CLEAN, corrupted, TARGETS, batch_size=2)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-4, atol=1e-8)


def beta_gradient(model, text, target):
    """d(-log p(target))/d(beta[l, h]) at beta = 1, beta scaling the head's attention logits at
    hook_attn_scores (the masked entries stay masked)."""
    beta = torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    beta.requires_grad_(True)

    def scale(layer):
        def hook(scores, hook):
            b = beta[layer].to(scores.dtype)[None, :, None, None]
            # masked entries (-inf) stay out of the product: -inf * 0 would make the gradient NaN
            finite = torch.isfinite(scores)
            return torch.where(finite, scores, 0.0) * b + torch.where(finite, 0.0, scores)

        return hook

    hooks = [(f"blocks.{la}.attn.hook_attn_scores", scale(la)) for la in range(model.cfg.n_layers)]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        logits = model(model.to_tokens(text))
        loss = -logits[0, -1].double().log_softmax(-1)[target]
        (grad,) = torch.autograd.grad(loss, [beta])
    return grad


@pytest.mark.parametrize("arch", live_archs())
def test_temperature_score_is_the_gradient_of_a_per_head_logit_scale(arch):
    # GPT-2 and Llama bridges compute attention themselves: hook_attn_scores is in the graph
    # (on boot_native it is a copy of the pattern, so the reference cannot be built there).
    model = tiny_model(arch, n_layers=2, dtype=torch.float64)
    expected = torch.stack(
        [beta_gradient(model, text, t) for text, t in zip(CLEAN, TARGETS, strict=True)]
    )
    assert expected.abs().max() > 1e-4
    scores = rk.temperature_scores(model, CLEAN, TARGETS, batch_size=2)  # padded batches
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-7)
    ranking = rk.temperature_ranking(model, CLEAN, TARGETS)
    torch.testing.assert_close(ranking.double(), expected.abs().mean(0), rtol=1e-4, atol=1e-7)
    assert not any(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------------------------
# statistics


def _curve(hits_by_fraction, fractions):
    accs = [
        Accuracy.from_ranks(torch.tensor([0 if h else 9 for h in hits]))
        for hits in hits_by_fraction
    ]
    return rk.AblationCurve(list(fractions), [0] * len(fractions), accs)


def test_per_prompt_auc_averages_to_the_auc_and_the_bootstrap_is_seeded():
    gen = torch.Generator().manual_seed(0)
    fractions = rk.DENSE_FRACTIONS
    hits = (
        torch.rand(len(fractions), 40, generator=gen)
        < torch.linspace(0, 1, len(fractions))[:, None]
    )
    curve = _curve(hits.tolist(), fractions)
    assert float(rk.per_prompt_auc(curve).mean()) == pytest.approx(curve.auc)
    a = rk.auc_interval(curve, n_boot=500, seed=3)
    torch.manual_seed(99)  # the global RNG plays no part
    b = rk.auc_interval(curve, n_boot=500, seed=3)
    assert a == b and a.n == 40 and a.n_boot == 500 and a.level == 0.95
    assert a.estimate == pytest.approx(curve.auc) and a.low <= a.estimate <= a.high
    assert 0 < a.high - a.low < 0.5
    assert rk.auc_interval(curve, n_boot=500, seed=4) != a
    # by hand: percentiles of resampled means
    per_prompt = rk.per_prompt_auc(curve)
    stats = per_prompt[rk.bootstrap_indices(40, 500, 3)].mean(1)
    low, high = torch.quantile(stats, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert (a.low, a.high) == pytest.approx((low, high))
    assert str(a).startswith(f"{a.estimate:.3f} [")
    json.dumps(a.to_dict(), allow_nan=False)


def test_paired_auc_difference():
    gen = torch.Generator().manual_seed(1)
    fractions = (0.0, 0.5, 1.0)
    base = torch.rand(3, 30, generator=gen) < 0.5
    better = base | (torch.rand(3, 30, generator=gen) < 0.5)
    a, b = _curve(better.tolist(), fractions), _curve(base.tolist(), fractions)
    diff = rk.paired_auc_difference(a, b, n_boot=400, seed=0)
    assert diff.estimate == pytest.approx(a.auc - b.auc) and diff.estimate > 0
    assert diff.low <= diff.estimate <= diff.high
    same = rk.paired_auc_difference(a, a, n_boot=100)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same test prompts"):
        rk.paired_auc_difference(a, _curve(base[:, :10].tolist(), fractions))


def test_spearman_interval_resamples_prompts():
    gen = torch.Generator().manual_seed(2)
    truth = torch.rand(3, 4, generator=gen)
    a = truth + 0.3 * torch.rand(12, 3, 4, generator=gen)  # 12 prompts
    b = truth + 0.3 * torch.rand(12, 3, 4, generator=gen)
    rho = rk.spearman_interval(a, b, n_boot=300, seed=0)
    assert rho.estimate == pytest.approx(rk.spearman(a.mean(0), b.mean(0)))
    assert rho.low <= rho.estimate <= rho.high and rho.n == 12
    assert rk.spearman_interval(a, b, n_boot=300, seed=0) == rho
    same = rk.spearman_interval(a, a, n_boot=50)
    assert (same.low, same.high) == (1.0, 1.0)
    fixed = rk.layer_ranking(3, 4)  # not resampled
    mixed = rk.spearman_interval(a, fixed, n_boot=100, seed=0)
    assert mixed.estimate == pytest.approx(rk.spearman(a.mean(0), fixed))
    assert mixed.low <= mixed.estimate <= mixed.high


# --------------------------------------------------------------------------------------------
# the study script and the command line


def test_ranking_study_quick_writes_runtime_seconds_and_intervals(tmp_path, capsys):
    from ra_lens.experiments.ranking_study import QUICK_SETTINGS, main

    out = tmp_path / "study.json"
    assert main(["--quick", "--json", str(out), "--plots", str(tmp_path / "plots")]) == 0
    data = json.loads(out.read_text())
    assert data["runtime_seconds"] > 0
    assert data["config"]["model"] == f"tiny-{arch_or_hooked('llama')} (random weights)"
    fractions = list(QUICK_SETTINGS["fractions"])
    assert data["config"]["fractions"] == fractions and 0 < fractions[1] < 1
    cells = {(c["task"], c["shots"], c["ablation"]) for c in data["cells"]}
    assert cells == {("toy", s, a) for s in (0, 2) for a in ("zero", "mean")}
    goals = data["goals"]
    ratios = {
        f"toy {c['shots']}-shot {c['ablation']}": c["seconds"]["causal_mediation"]
        / c["seconds"]["ra"]
        for c in data["cells"]
    }
    assert goals["cm_over_ra_speed_ratio"] == pytest.approx(ratios)
    assert goals["cm_over_ra_speed_ratio_min"] == pytest.approx(min(ratios.values()))
    assert goals["cm_over_ra_speed_ratio_goal"] == 50.0  # reported, never asserted on timing
    assert goals["cm_over_ra_speed_ratio_met"] == (min(ratios.values()) >= 50.0)
    for cell in data["cells"]:
        expected = set(RANKINGS) if cell["shots"] else {
            n for n, spec in RANKINGS.items() if not spec.needs_labels
        }  # fmt: skip
        assert set(cell["rankings"]) == expected
        assert cell["fractions"] == fractions
        n_heads = cell["n_layers"] * cell["n_heads"]
        assert data["runtime_seconds"] >= cell["seconds"]["ablation_curves"] > 0
        assert cell["seconds"]["bootstrap"] > 0
        for name, entry in cell["rankings"].items():
            assert data["runtime_seconds"] > entry["seconds"] >= 0
            # heads kept grow with the fraction: none at 0 (every curve alike), all at 1
            assert entry["n_kept"] == [round(p * n_heads) for p in fractions]
            assert entry["n_kept"] == sorted(set(entry["n_kept"]))
            assert entry["curve"][0] == cell["rankings"]["ra"]["curve"][0]
            assert entry["curve"][-1] == entry["reverse_curve"][-1] == cell["unablated"]["top1"]
            for key in ("auc", "auc_top3", "reverse_auc"):
                ci = entry["intervals"][key]
                assert ci["low"] <= ci["estimate"] <= ci["high"]
                assert (ci["n"], ci["n_boot"]) == (cell["n_test"], QUICK_SETTINGS["n_boot"])
            assert entry["intervals"]["auc"]["estimate"] == pytest.approx(entry["auc"])
            if name != "ra":
                for key in ("paired_vs_ra", "spearman"):
                    ci = entry["intervals"][key]
                    assert ci["low"] <= ci["estimate"] <= ci["high"]
    # mean ablation reuses the protocol-independent rankings, recomputes causal mediation
    zero, mean = data["cells"][2], data["cells"][3]
    assert zero["rankings"]["ra"]["scores"] == mean["rankings"]["ra"]["scores"]
    assert (
        zero["rankings"]["causal_mediation"]["scores"]
        != mean["rankings"]["causal_mediation"]["scores"]
    )
    rows = data["summary"]
    assert all(row["n_test"] == 4 for row in rows)
    assert all(row["n_prompts"] == QUICK_SETTINGS["n_prompts"] for row in rows)
    assert len(list((tmp_path / "plots").glob("toy_*shot_*.png"))) == 4
    assert "causal mediation / RA seconds" in capsys.readouterr().out
    assert main(["--markdown", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(rows) and "| toy | 2 | mean | 4 | causal_mediation |" in "\n".join(
        table
    )


def test_rank_command_takes_several_tasks_and_rankings(capsys):
    from ra_lens.cli import build_parser, main

    args = build_parser().parse_args(
        ["rank", "--task", "antonym", "--task", "capitalize", "--ablation", "mean",
         "--rankings", "ra,cm_first_order,ra_temperature"]
    )  # fmt: skip
    assert args.task == ["antonym", "capitalize"] and args.ablation == "mean"
    assert (
        main(["rank", "--task", "antonym", "--rankings", "ra,nope", "--model", "tiny-llama"]) == 2
    )
    err = capsys.readouterr().err
    assert "unknown ranking 'nope'" in err and "indirect_effect" in err
    with pytest.raises(SystemExit):
        main(["rank", "--task", "antonym", "--ablation", "resample"])


# --- one target check, one set of counts, heads checked where they enter -------------------

#: Every ranking that reads targets, called on two prompts with the given targets.
TARGETED = {
    "ra_ranking": lambda m, t: rk.ra_ranking(m, CLEAN[:2], t),
    "temperature_ranking": lambda m, t: rk.temperature_ranking(m, CLEAN[:2], t),
    "forward_ranking": lambda m, t: rk.forward_ranking(m, CLEAN[:2], t),
    "causal_mediation": lambda m, t: rk.causal_mediation(m, CLEAN[:2], t),
    "first_order_mediation": lambda m, t: rk.first_order_mediation(m, CLEAN[:2], t),
    "indirect_effect": lambda m, t: rk.indirect_effect(m, CLEAN[:2], CORRUPTED[:2], t),
    "activation_patching": lambda m, t: rk.activation_patching(m, CLEAN[:2], CORRUPTED[:2], t),
    "attribution_patching": lambda m, t: rk.attribution_patching(m, CLEAN[:2], CORRUPTED[:2], t),
    "exact_qk_attribution": lambda m, t: rk.exact_qk_attribution(m, CLEAN[:2], CORRUPTED[:2], t),
}


@pytest.mark.parametrize("name", list(TARGETED))
@pytest.mark.parametrize(
    "targets, error, message",
    [
        ([5, -1], ValueError, "negative id is not counted from the end"),
        ([5, 300], ValueError, r"must lie in 0\.\.299"),
        ([5, 100000], ValueError, r"must lie in 0\.\.299"),
        (torch.tensor([5.0, 6.7]), TypeError, "integer token ids, got a torch.float32"),
        ([5.0, 6.7], TypeError, "integer token ids, got 5.0"),
        ([5], ValueError, "1 targets for 2 prompts"),
    ],
)
def test_every_ranking_refuses_bad_targets_before_running(llama, name, targets, error, message):
    with pytest.raises(error, match=message):
        TARGETED[name](llama, targets)


def test_rankings_accept_integer_targets_of_any_kind(llama):
    expected = rk.causal_mediation(llama, CLEAN[:2], [5, 6])
    for targets in (torch.tensor([5, 6]), torch.tensor([5, 6], dtype=torch.int32), [5, 6]):
        torch.testing.assert_close(rk.causal_mediation(llama, CLEAN[:2], targets), expected)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_rankings_refuse_bad_batch_sizes(llama, batch_size):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        rk.ra_ranking(llama, CLEAN, TARGETS, batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        rk.last_token_means(llama, CLEAN, batch_size=batch_size)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"n_test": -1}, "n_test must be an int >= 1, got -1"),
        ({"n_test": 0}, "n_test must be an int >= 1, got 0"),
        ({"n_prompts": -2}, "n_prompts must be an int >= 1"),
        ({"n_boot": 0}, "n_boot must be an int >= 1"),
        ({"n_means": -5}, "n_means must be an int >= 1"),
        ({"eval_batch_size": 0}, "eval_batch_size must be an int >= 1"),
        ({"shots": -1}, "shots must be an int >= 0"),
    ],
)
def test_head_ranking_refuses_negative_counts(llama, setting, message):
    with pytest.raises(ValueError, match=message):
        head_ranking(llama, TOY, **{"shots": 1, "n_prompts": 4, **setting}, progress=False)


@pytest.mark.parametrize(
    "heads, message",
    [([(1, 4)], r"head \(1, 4\) does not exist"), ([(0, -1)], r"head \(0, -1\) does not exist")],
)
def test_ablation_evaluation_checks_heads_against_the_model(llama, heads, message):
    test = task_prompts(llama, TOY, shots=1)[1]
    with pytest.raises(ValueError, match=message):
        rk.evaluate_ablated(llama, test, heads)


def test_the_registry_lists_functions_and_refuses_duplicates():
    from ra_lens.experiments.head_ranking import RankingSpec, register

    assert all(spec.function.__name__ != "<lambda>" for spec in RANKINGS.values())
    assert all(spec.name == name for name, spec in RANKINGS.items())
    registry = dict(RANKINGS)
    with pytest.raises(ValueError, match="'ra' is already registered"):
        register(registry, RankingSpec("ra", rk.ra_ranking, "again"))


def test_activation_patching_per_prompt_averages_to_its_mean(model):
    per_prompt = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, per_prompt=True)
    mean = rk.activation_patching(model, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    assert per_prompt.shape == (3, 2, model.cfg.n_heads)
    torch.testing.assert_close(per_prompt.double().mean(0).float(), mean, atol=1e-7, rtol=1e-5)
    one = rk.activation_patching(model, CLEAN[2:], CORRUPTED[2:], TARGETS[2:])
    torch.testing.assert_close(per_prompt[2], one, atol=1e-7, rtol=1e-5)


def test_exact_qk_attribution_per_prompt_averages_to_its_mean(llama):
    per_prompt = rk.exact_qk_attribution(llama, CLEAN, CORRUPTED, TARGETS, per_prompt=True)
    mean = rk.exact_qk_attribution(llama, CLEAN, CORRUPTED, TARGETS, batch_size=2)
    torch.testing.assert_close(per_prompt.double().mean(0).float(), mean, atol=1e-7, rtol=1e-5)


def test_the_public_list_holds_public_names_and_the_old_names_still_import():
    public = set(rk.__all__)
    assert not public & {"check_scores", "bootstrap_indices", "check_fractions", "target_probs"}
    assert {"ra_ranking", "spearman", "pearson", "top_recall", "ablation_curve"} <= public
    old = [
        "ablation_hooks", "bootstrap_indices", "check_fractions", "check_scores",
        "last_token_means", "target_probs", "HeadMeans", "PerPrompt",
    ]  # fmt: skip
    assert all(hasattr(rk, name) for name in [*public, *old])


def test_the_progress_bar_moves_inside_a_part_and_ends_full(llama, monkeypatch):
    import ra_lens.ranking.engine as engine

    seen = []

    class Bar:  # records where the engine's bar stands after each update
        def __init__(self, total, **kwargs):
            self.n, self.total = 0.0, total

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, step):
            self.n += step
            seen.append(round(self.n, 6))

    monkeypatch.setattr(engine, "tqdm", Bar)
    rk.causal_mediation(llama, CLEAN, TARGETS, batch_size=2, progress=True)
    n_heads = 2 * llama.cfg.n_heads  # one step per head in each part, then the part's end
    assert len(seen) == 2 * (n_heads + 1) and seen == sorted(seen) and seen[-1] == 3
    assert seen[n_heads - 1] == 2 and seen[0] == pytest.approx(2 / n_heads, abs=1e-6)
