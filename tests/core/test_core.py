"""reversed_attention against autograd and finite differences, its properties, state and errors."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import CLEAN_TOKENS as TOKENS
from helpers import CORRUPTED_TOKENS as CORRUPTED
from helpers import FLORENCE, PROMPTS, all_archs, arch_or_hooked, kl_to, live_archs, snapshot
from helpers import FLORENCE as PROMPT
from helpers import bridge_model as tl4_arch

import ra_lens
from ra_lens import capture, metrics
from ra_lens.metrics import completion, logit_diff, target_nll, target_prob
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=all_archs())
def arch(request):
    return request.param


def scores_grad(model, tokens, metric, layer):
    """Reference: autograd gradient at hook_attn_scores, with parameters made differentiable."""
    store = {}

    def keep(x, hook):
        x.retain_grad()
        store["scores"] = x

    for p in model.parameters():
        p.requires_grad_(True)
    with model.hooks(fwd_hooks=[(capture.SCORES.format(layer), keep)]):
        logits = model(tokens)
        metric(logits).sum().backward()
    grad = store["scores"].grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return grad


@pytest.mark.parametrize("arch_name", live_archs())
def test_qk_equals_autograd_scores_grad_over_scale(arch_name):
    model = tiny_model(arch_name, n_layers=3)
    tokens = model.to_tokens([FLORENCE, FLORENCE.replace("Italy", "Spain")])
    metric = target_nll([5, 7])
    ra = ra_lens.reversed_attention(model, tokens, metric)
    for i, layer in enumerate(ra.layers):
        expected = scores_grad(model, tokens, metric, layer) / capture.attention_scale(model, layer)
        expected = expected.masked_fill(~torch.ones_like(expected, dtype=torch.bool).tril(), 0)
        torch.testing.assert_close(ra.maps[:, i], expected.float(), atol=1e-7, rtol=1e-4)
    assert ra.maps.abs().max() > 1e-5  # a real, non-trivial signal


def test_scale_read_from_model_matches_qk_over_scores(arch):
    if arch in ("opt", "native"):
        pytest.skip("hook_attn_scores is not the live pre-softmax score on this adapter")
    model = tiny_model(arch)
    rotary = "blocks.0.attn.hook_rot_q" in model.hook_dict
    q_name, k_name = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
    cache = {}

    def save(name):
        def hook(x, hook):
            cache[name] = x.detach()

        return hook

    names = [f"blocks.1.attn.{n}" for n in (q_name, k_name, "hook_attn_scores")]
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, save(n)) for n in names]):
        model(model.to_tokens(FLORENCE))
    q, k, scores = (cache[n] for n in names)
    if q.shape[1] != scores.shape[2]:  # [batch, head, pos, d] layout -> [batch, pos, head, d]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    qk = torch.einsum("bqhd,bkhd->bhqk", q, k)
    mask = torch.ones_like(qk, dtype=torch.bool).tril()
    s = capture.attention_scale(model, 1)
    torch.testing.assert_close(scores[mask], qk[mask] / s, atol=1e-5, rtol=1e-4)


def test_finite_differences_float64():
    """dL/dZ_ij by central differences on the live scores of a float64 model.

    GPT-2 rather than Llama: HF's RMSNorm computes in float32 whatever the model dtype, which
    would limit the differences to float32 precision.
    """
    model = tiny_model(live_archs()[0], n_layers=2)
    model = model.to(torch.float64)
    tokens = model.to_tokens(FLORENCE)
    metric = target_nll([11])
    ra = ra_lens.reversed_attention(model, tokens, metric)
    layer = 1
    s = capture.attention_scale(model, layer)
    # Central differences: truncation O(eps^2), rounding O(1e-16 / eps); 1e-4 balances them
    # (1e-6 left ~5e-10 of rounding noise on entries of ~3e-5).
    eps = 1e-4

    def loss_with(head, q, k, delta):
        def bump(scores, hook):
            scores = scores.clone()
            scores[0, head, q, k] += delta / s  # Z moves by delta, S = Z / s by delta / s
            return scores

        with torch.no_grad(), model.hooks(fwd_hooks=[(capture.SCORES.format(layer), bump)]):
            return metric(model(tokens)).item()

    for head, q, k in [(0, 5, 2), (1, 8, 8), (3, tokens.shape[1] - 1, 0), (2, 9, 4)]:
        fd = (loss_with(head, q, k, eps) - loss_with(head, q, k, -eps)) / (2 * eps)
        assert ra.maps[0, layer, head, q, k].item() == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_pattern_convention_by_finite_differences(arch):
    """The 'pattern' convention is dL/dA: checked by nudging the live pattern (float64)."""
    if arch == "opt":
        pytest.skip("edits at hook_pattern are discarded on this adapter")
    if arch == "llama":
        pytest.skip("HF's RMSNorm computes in float32: differences are float32-noisy")
    model = tiny_model(arch).to(torch.float64)
    tokens = model.to_tokens(FLORENCE)
    metric = target_nll([3])
    ra = ra_lens.reversed_attention(model, tokens, metric, convention="pattern")
    eps = 1e-6

    def loss_with(delta):
        def bump(pattern, hook):
            pattern = pattern.clone()
            pattern[0, 2, 7, 3] += delta
            return pattern

        with torch.no_grad(), model.hooks(fwd_hooks=[(capture.PATTERN.format(0), bump)]):
            return metric(model(tokens)).item()

    fd = (loss_with(eps) - loss_with(-eps)) / (2 * eps)
    assert ra.maps[0, 0, 2, 7, 3].item() == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_conventions_are_related(arch):
    model = tiny_model(arch)
    tokens = model.to_tokens(FLORENCE)
    metric = target_nll([4])
    qk = ra_lens.reversed_attention(model, tokens, metric)
    scores = ra_lens.reversed_attention(model, tokens, metric, convention="scores")
    pattern = ra_lens.reversed_attention(model, tokens, metric, convention="pattern")
    scale = torch.tensor(qk.scales)[None, :, None, None, None]
    torch.testing.assert_close(scores.maps, qk.maps * scale.float())
    a, r = pattern.patterns, pattern.maps
    torch.testing.assert_close(
        scores.maps, a * (r - (a * r).sum(-1, keepdim=True)), atol=1e-8, rtol=1e-4
    )


def test_hook_z_route_equals_hook_pattern_route(arch, monkeypatch):
    if arch == "opt":
        pytest.skip("only the hook_z route exists here")
    model = tiny_model(arch)
    tokens = model.to_tokens(PROMPTS[:1])
    via_pattern = ra_lens.reversed_attention(model, tokens, target_nll([9]))
    monkeypatch.setattr(capture, "live_pattern_layers", lambda m: [False] * m.cfg.n_layers)
    via_z = ra_lens.reversed_attention(model, tokens, target_nll([9]))
    assert via_pattern.routes == ["pattern", "pattern"] and via_z.routes == ["z", "z"]
    torch.testing.assert_close(via_z.maps, via_pattern.maps, atol=1e-8, rtol=1e-4)


@pytest.mark.parametrize("seam", [True, False])
def test_opt_matches_autograd_of_pattern_through_live_attention_and_hook_z(seam, monkeypatch):
    """OPT delegates attention to HuggingFace: hook_pattern gets no gradient as the adapter runs
    it. live_attention routes HF's softmax through hook_pattern (the pattern route); without it
    (simulated) the hook_z route gives the same RA."""
    from ra_lens import liveness

    model = tl4_arch("opt")
    if not seam:
        monkeypatch.setattr(liveness, "_seamable", lambda model: set())
    assert capture.live_pattern_layers(model) == [seam, seam]
    tokens = model.to_tokens(FLORENCE)
    ra = ra_lens.reversed_attention(model, tokens, target_nll([6]), convention="pattern")
    assert ra.routes == (["pattern", "pattern"] if seam else ["z", "z"])
    # Reference: dL/dA in a plain HuggingFace copy (same seed, same weights), outside the bridge.
    from transformers import AutoModelForCausalLM

    from ra_lens.toy_models import hf_config

    torch.manual_seed(0)
    config = hf_config("opt", 300, 32, 2, 4, 64)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config).eval()
    out = hf(tokens, output_attentions=True)
    torch.testing.assert_close(out.logits, model(tokens))
    for a in out.attentions:
        a.retain_grad()
    torch.nn.functional.cross_entropy(out.logits[:, -1], torch.tensor([6])).backward()
    for i, a in enumerate(out.attentions):
        torch.testing.assert_close(ra.maps[:, i], a.grad.tril(), atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(ra.patterns[:, i], a.detach(), atol=1e-6, rtol=1e-4)


def test_properties(arch):
    model = tiny_model(arch, n_layers=3)
    tokens = model.to_tokens(FLORENCE)
    n = tokens.shape[1]
    loss_pos = n - 4
    ra = ra_lens.reversed_attention(model, tokens, target_nll([8], position=loss_pos))
    maps = ra.maps[0]
    assert maps.triu(1).abs().max() == 0  # zero above the diagonal
    assert maps.sum(-1).abs().max() < 1e-6 * maps.abs().max().clamp_min(1e-12) * n  # rows sum to 0
    assert maps[:, :, 0].abs().max() == 0  # row 0
    assert maps[:, :, loss_pos + 1 :].abs().max() == 0  # rows after the loss position
    last = maps[-1]
    assert last[:, loss_pos].abs().max() > 0
    assert torch.cat([last[:, :loss_pos], last[:, loss_pos + 1 :]], 1).abs().max() == 0
    # Adding eta * RA keeps the rows of a pattern summing to one.
    patched = ra.patterns[0] + 5.0 * maps
    torch.testing.assert_close(patched.sum(-1)[:, :, :n], torch.ones(3, 4, n), atol=1e-5, rtol=0)


def test_keep_norms_equals_norms_of_maps(arch):
    model = tiny_model(arch)
    tokens = model.to_tokens(PROMPTS[:1])
    maps = ra_lens.reversed_attention(model, tokens, target_nll([2]))
    norms = ra_lens.reversed_attention(model, tokens, target_nll([2]), keep="norms")
    assert norms.maps is None and norms.patterns is None
    torch.testing.assert_close(norms.head_norms(), maps.maps.flatten(-2).norm(dim=-1).mean(0))
    torch.testing.assert_close(norms.forward_norms(), maps.forward_norms())


def test_batched_equals_per_prompt_and_padded_equals_unpadded(arch):
    model = tiny_model(arch)
    targets = [5, 17, 42]
    batched = ra_lens.reversed_attention(model, PROMPTS, target_nll(targets))
    assert batched.lengths.unique().numel() == 3  # really padded
    assert int(batched.lengths.min()) < batched.maps.shape[-1]  # so the padding checks check
    for i, prompt in enumerate(PROMPTS):
        alone = ra_lens.reversed_attention(model, prompt, target_nll([targets[i]]))
        n = int(batched.lengths[i])
        torch.testing.assert_close(
            batched.maps[i, ..., :n, :n], alone.maps[0], atol=1e-8, rtol=1e-4
        )
        # padded rows and columns are exactly zero (empty for the longest prompt)
        assert not batched.maps[i, ..., n:, :].any() and not batched.maps[i, ..., :, n:].any()
        assert (
            not batched.patterns[i, ..., n:, :].any() and not batched.patterns[i, ..., :, n:].any()
        )
        torch.testing.assert_close(batched.norms[i], alone.norms[0], atol=1e-8, rtol=1e-4)


def test_metrics_other_than_nll():
    model = tiny_model(all_archs()[0])
    tokens = model.to_tokens(FLORENCE)
    nll = ra_lens.reversed_attention(model, tokens, target_nll([5]))
    prob = ra_lens.reversed_attention(model, tokens, target_prob([5]))
    p = prob.metric_values[0]
    # d p / dZ = -p * d nll / dZ
    torch.testing.assert_close(prob.maps, -p * nll.maps, atol=1e-9, rtol=1e-4)
    diff = ra_lens.reversed_attention(model, tokens, logit_diff([5], [6]))
    assert diff.maps.abs().max() > 0


def test_teacher_forced_completion_equals_single_token_nll_for_one_token():
    model = tiny_model(all_archs()[0])
    batch, metric = completion(model, [FLORENCE], [" the"])
    assert int(batch.lengths[0]) == model.to_tokens(FLORENCE + " the").shape[1]
    target = int(batch.tokens[0, -1])
    forced = ra_lens.reversed_attention(model, batch, metric)
    prompt_only = model.to_tokens(FLORENCE)
    n = prompt_only.shape[1]
    single = ra_lens.reversed_attention(model, batch, target_nll([target], position=n - 1))
    torch.testing.assert_close(forced.maps, single.maps)
    multi_batch, multi = completion(
        model, [FLORENCE, "The quick"], [" the city", " brown fox jumps"]
    )
    ra = ra_lens.reversed_attention(model, multi_batch, multi)
    assert ra.metric_values.shape == (2,) and bool((ra.metric_values > 0).all())


@pytest.mark.parametrize("frozen", [True, False])
def test_model_left_as_it_was(arch, frozen):
    model = tiny_model(arch, frozen=frozen)
    model.train()
    ra_lens.reversed_attention(model, FLORENCE, target_nll([1]))  # warm the liveness cache
    before = snapshot(model)
    ra_lens.reversed_attention(model, FLORENCE, target_nll([1]))
    assert snapshot(model)[:2] == before[:2]
    assert all(g is None for g in snapshot(model)[2]) and snapshot(model)[3] == before[3]

    def broken(logits):
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        ra_lens.reversed_attention(model, FLORENCE, broken)
    after = snapshot(model)
    assert after[0] is True and after[1] == before[1] and after[3] == before[3]
    assert all(g is None for g in after[2])


def test_existing_grads_untouched():
    model = tiny_model(all_archs()[0])
    params = list(model.parameters())
    params[3].grad = torch.full_like(params[3], 7.0)
    ra_lens.reversed_attention(model, FLORENCE, target_nll([1]))
    assert torch.equal(params[3].grad, torch.full_like(params[3], 7.0))
    assert all(p.grad is None for i, p in enumerate(params) if i != 3)


def test_layers_subset_equals_full():
    model = tiny_model(all_archs()[0], n_layers=3)
    full = ra_lens.reversed_attention(model, FLORENCE, target_nll([5]))
    part = ra_lens.reversed_attention(model, FLORENCE, target_nll([5]), layers=[1, 2])
    assert part.layers == [1, 2]  # out-of-order layers are refused (test_clear_errors_for_layers)
    torch.testing.assert_close(part.maps, full.maps[:, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patterns_are_the_forward_passs_own_tensors(arch, dtype):
    """keep="maps" hands over each layer's hook_pattern tensor itself (float32 on the CPU; a
    float32 copy in half precision), stacked bit for bit on the first read of `patterns`, once;
    later forward passes allocate their own and leave the result as it was."""
    model = tiny_model(arch, n_layers=3, dtype=dtype)
    names = [capture.PATTERN.format(layer) for layer in range(3)]
    seen: dict[str, torch.Tensor] = {}
    hooks = [(name, lambda x, hook: seen.__setitem__(hook.name, x.detach())) for name in names]
    with model.hooks(fwd_hooks=hooks):
        ra = ra_lens.reversed_attention(model, PROMPT, target_nll([5]))
    held = vars(ra)["_patterns"]  # before the first read: one tensor per layer
    same = [t.data_ptr() == seen[name].data_ptr() for t, name in zip(held, names)]
    # A copy only where the pattern is not float32 (some bf16 models run the softmax in float32).
    assert same == [seen[name].dtype == torch.float32 for name in names]
    patterns = ra.patterns
    assert patterns is ra.patterns and patterns.dtype == torch.float32
    for i, name in enumerate(names):
        assert torch.equal(patterns[:, i], seen[name].float())
    before = patterns.clone()
    model(model.to_tokens(PROMPT))
    ra_lens.reversed_attention(model, PROMPT, target_nll([7]))
    assert torch.equal(ra.patterns, before)


def test_patterns_never_keep_a_larger_storage_alive():
    from ra_lens.core import _whole

    whole = torch.randn(2, 3, 4, 4)
    assert _whole(whole) is whole and _whole(whole.transpose(-1, -2)).data_ptr() == whole.data_ptr()
    part = whole[:, :2]  # a view into a larger buffer: copied, equal
    kept = _whole(part)
    assert kept.untyped_storage().nbytes() == part.numel() * 4 and torch.equal(kept, part)


def test_half_precision_computes_vjp_in_float32():
    model32 = tiny_model(live_archs()[-1 if "llama" in live_archs() else 0])
    model16 = tiny_model(live_archs()[-1 if "llama" in live_archs() else 0], dtype=torch.bfloat16)
    ra32 = ra_lens.reversed_attention(model32, FLORENCE, target_nll([5]))
    ra16 = ra_lens.reversed_attention(model16, FLORENCE, target_nll([5]))
    assert ra16.maps.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(ra16.maps.flatten(), ra32.maps.flatten(), dim=0)
    assert cos > 0.95


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model(all_archs()[0])
    ra = ra_lens.reversed_attention(model, PROMPTS[:2], target_nll([1, 2]))
    ra.save(tmp_path / "ra.safetensors")
    back = ra_lens.ReversedAttention.load(tmp_path / "ra.safetensors")
    for name in ("maps", "patterns", "norms", "tokens", "lengths", "metric_values"):
        assert torch.equal(getattr(back, name), getattr(ra, name))
    assert (
        back.layers == ra.layers and back.scales == ra.scales and back.str_tokens == ra.str_tokens
    )
    assert back.top_heads(3) == ra.top_heads(3)


def test_top_heads_order():
    model = tiny_model(all_archs()[0])
    ra = ra_lens.reversed_attention(model, FLORENCE, target_nll([5]))
    top = ra.top_heads(8)
    norms = [n for _, _, n in top]
    assert norms == sorted(norms, reverse=True) and len(top) == 8
    layer, head, norm = top[0]
    assert norm == pytest.approx(ra.head_norms().max().item())
    assert ra.head_norms()[ra.layers.index(layer), head].item() == pytest.approx(norm)


# Bad input: a clear error and the model untouched.


def test_errors(arch):
    model = tiny_model(arch)
    model(model.to_tokens(FLORENCE))  # the bridge adds its own hooks lazily on the first forward
    before = snapshot(model)
    metric = target_nll([1])
    cases = [
        (dict(layers=[5]), ValueError, "out of range"),
        (dict(convention="logits"), ValueError, "unknown convention"),
        (dict(keep="all"), ValueError, "unknown keep"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            ra_lens.reversed_attention(model, FLORENCE, metric, **kwargs)
    with pytest.raises(ValueError, match="one value per prompt"):
        ra_lens.reversed_attention(model, FLORENCE, lambda logits: logits[:, -1])
    with pytest.raises(ValueError, match="no gradient path"):
        ra_lens.reversed_attention(model, FLORENCE, lambda logits: logits[:, -1, 0].detach())
    with pytest.raises(ValueError, match="empty batch"):
        ra_lens.reversed_attention(model, [], metric)
    with pytest.raises(ValueError, match="exceed the model's context"):
        ra_lens.reversed_attention(model, torch.zeros(1, 65, dtype=torch.long), metric)
    with pytest.raises(ValueError, match="cannot know where each one ends"):
        ra_lens.reversed_attention(model, PROMPTS, lambda logits: logits[:, -1, 0])
    with pytest.raises(TypeError, match="TransformerLens model"):
        ra_lens.reversed_attention(torch.nn.Linear(2, 2), FLORENCE, metric)
    assert snapshot(model)[:2] == before[:2] and snapshot(model)[3] == before[3]


def test_concat_joins_batches_like_one_call():
    model = tiny_model(all_archs()[0])
    tokens = model.to_tokens([FLORENCE, FLORENCE])
    whole = ra_lens.reversed_attention(model, tokens, target_nll([5, 6]))
    parts = [
        ra_lens.reversed_attention(model, tokens[i : i + 1], target_nll([t]))
        for i, t in ((0, 5), (1, 6))
    ]
    joined = ra_lens.ReversedAttention.concat(parts)
    torch.testing.assert_close(joined.maps, whole.maps, atol=1e-8, rtol=1e-4)
    assert joined.str_tokens == whole.str_tokens and joined.layers == whole.layers
    with pytest.raises(ValueError, match="one token length"):
        ra_lens.ReversedAttention.concat(
            [whole, ra_lens.reversed_attention(model, "I like", target_nll([1]))]
        )


@pytest.fixture(scope="module", params=live_archs())
def tiny(request):
    return tiny_model(request.param, n_layers=2)


def scores_grad_over_scale(model, tokens, metric, user_hooks):
    """Reference: autograd's gradient at the scores the softmax actually received (the output
    of hook_attn_scores, after any user hook there), over the attention scale, per layer."""
    store = {}

    def keep(layer):
        def hook(x, hook):
            x.retain_grad()
            store[layer] = x

        return hook

    n_layers = model.cfg.n_layers
    for p in model.parameters():
        p.requires_grad_(True)
    hooks = list(user_hooks) + [(capture.SCORES.format(la), keep(la)) for la in range(n_layers)]
    with model.hooks(fwd_hooks=hooks):
        metric(model(tokens)).sum().backward()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)
    out = []
    for la in range(n_layers):
        grad = store[la].grad.detach() / capture.attention_scale(model, la)
        out.append(grad.masked_fill(~torch.ones_like(grad, dtype=torch.bool).tril(), 0))
    return torch.stack(out, 1).float()


def replace_head_with_uniform(head):
    def hook(pattern, hook):
        pattern = pattern.clone()
        n = pattern.shape[-1]
        uniform = torch.ones(n, n, dtype=pattern.dtype).tril()
        pattern[:, head] = uniform / uniform.sum(-1, keepdim=True)
        return pattern

    return hook


def shift_head(head, amount):
    def hook(pattern, hook):
        pattern = pattern.clone()
        pattern[:, head, -1, 0] += amount
        pattern[:, head, -1, -1] -= amount
        return pattern

    return hook


@pytest.mark.parametrize("edit", ["replace", "shift", "scores", "ra_patch"])
def test_ra_equals_autograd_with_user_hooks_editing_attention(tiny, edit):
    tokens = tiny.to_tokens([PROMPT, PROMPT.replace("Italy", "Spain")])
    metric = target_nll([5, 7])
    if edit == "replace":
        user = [(capture.PATTERN.format(1), replace_head_with_uniform(1))]
    elif edit == "shift":
        user = [(capture.PATTERN.format(la), shift_head(0, 0.2)) for la in range(2)]
    elif edit == "scores":

        def bias(scores, hook):
            return scores + 0.3 * torch.arange(scores.shape[-1], dtype=scores.dtype)

        user = [(capture.SCORES.format(0), bias)]
    else:  # ra-lens's own attention patch, as when patching is iterated
        user = ra_lens.attention_patch_hooks(ra_lens.reversed_attention(tiny, tokens, metric), -3.0)
    with tiny.hooks(fwd_hooks=user):
        ra = ra_lens.reversed_attention(tiny, tokens, metric)
    expected = scores_grad_over_scale(tiny, tokens, metric, user)
    torch.testing.assert_close(ra.maps, expected, atol=1e-7, rtol=1e-4)
    if edit == "replace":
        assert ra.maps[:, 1, 1].abs().max() == 0  # the softmax output no longer matters
        assert ra.maps[:, 1, 0].abs().max() > 1e-6
    assert len(tiny.hook_dict[capture.PATTERN.format(1)].fwd_hooks) == 0


def test_text_longer_than_context_is_refused(tiny):
    n_ctx = tiny.cfg.n_ctx
    long_text = " hello" * (n_ctx + 10)
    with pytest.raises(ValueError, match=f"n_ctx={n_ctx}"):
        ra_lens.reversed_attention(tiny, long_text, target_nll([3]))
    with pytest.raises(ValueError, match="n_ctx"):
        capture.to_batch(tiny, ["short", long_text])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_metric_is_refused(tiny, bad):
    def metric(logits):
        return logits[:, -1, 0] * bad

    with pytest.raises(ValueError, match="non-finite"):
        ra_lens.reversed_attention(tiny, tiny.to_tokens(PROMPT), metric)


def test_tensor_positions_count_from_each_prompts_own_end(tiny):
    batch = capture.to_batch(tiny, ["a b c d e f", "a b"])
    logits = torch.randn(2, batch.tokens.shape[1], tiny.cfg.d_vocab)
    targets = [3, 4]
    by_tensor = metrics.target_nll(targets, position=torch.tensor([-1, -1]))
    by_int = metrics.target_nll(targets, position=-1)
    torch.testing.assert_close(
        by_tensor(logits, lengths=batch.lengths), by_int(logits, lengths=batch.lengths)
    )
    last = batch.lengths - 1
    expected = -logits[torch.arange(2), last].log_softmax(-1)[torch.arange(2), torch.tensor([3, 4])]
    torch.testing.assert_close(by_tensor(logits, lengths=batch.lengths), expected)
    beyond = metrics.target_nll(targets, position=torch.tensor([2, 5]))  # 5 is padding in row 1
    with pytest.raises(ValueError, match="outside prompts"):
        beyond(logits, lengths=batch.lengths)


def test_clear_errors_for_bad_tokens(tiny):
    metric = target_nll([3])
    vocab = tiny.cfg.d_vocab
    with pytest.raises(ValueError, match=f"0..{vocab - 1}"):
        ra_lens.reversed_attention(tiny, torch.tensor([[1, 2, vocab]]), metric)
    with pytest.raises(ValueError, match="vocabulary"):
        ra_lens.reversed_attention(tiny, torch.tensor([[1, -2, 3]]), metric)
    with pytest.raises(ValueError, match="'batch pos'"):
        ra_lens.reversed_attention(tiny, torch.ones(1, 2, 3, dtype=torch.long), metric)
    with pytest.raises(ValueError, match="'batch pos'"):
        ra_lens.reversed_attention(tiny, torch.tensor(5), metric)
    bad_batch = ra_lens.Batch(torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 9]))
    with pytest.raises(ValueError, match=r"lengths \[4, 9\]"):
        ra_lens.reversed_attention(tiny, bad_batch, metric)


def test_clear_error_for_negative_target(tiny):
    with pytest.raises(ValueError, match="negative id is not counted from the end"):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll([-1]))


@pytest.mark.parametrize(
    "layers, message",
    [([1.0], "must be ints"), ([1, 1], "repeat"), ([1, 0], r"pass \[0, 1\]"), (1, "sequence")],
)
def test_clear_errors_for_layers(tiny, layers, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]), layers=layers)


def test_clear_error_inside_inference_mode(tiny):
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]))
    ra = ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]))  # and the model still works
    assert ra.maps.abs().max() > 0


def test_concurrent_calls_on_one_model_are_correct_or_refused_clearly(tiny):
    tokens = tiny.to_tokens(PROMPT)
    metric = target_nll([5])
    expected = ra_lens.reversed_attention(tiny, tokens, metric).maps
    outcomes: list[str] = []
    start = threading.Barrier(4)

    def work():
        start.wait()
        for _ in range(6):
            try:
                maps = ra_lens.reversed_attention(tiny, tokens, metric).maps
                outcomes.append("ok" if torch.equal(maps, expected) else "WRONG")
            except RuntimeError as error:
                assert "one call at a time per model" in str(error)
                outcomes.append("refused")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 24 and "WRONG" not in outcomes and "ok" in outcomes
    assert all(not hp.fwd_hooks and not hp.bwd_hooks for hp in tiny.hook_dict.values())


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


@pytest.mark.parametrize("rows_at", [torch.tensor([1.7, 2.9]), torch.tensor([True, False])])
def test_rows_at_refuses_non_integer_positions(model, rows_at):
    with pytest.raises(TypeError, match="rows_at must hold integer positions"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows", rows_at=rows_at)


def test_rows_at_takes_integer_positions(model):
    ra = ra_lens.reversed_attention(
        model, TOKENS, target_nll([5]), keep="rows", rows_at=torch.tensor([3, 4])
    )
    full = ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    torch.testing.assert_close(ra.rows[0], full.maps[0, :, :, 3])
    torch.testing.assert_close(ra.rows[1], full.maps[1, :, :, 4])


@pytest.mark.parametrize("memory", ["full", "layerwise"])
def test_metric_running_the_model_gives_the_ra_of_precomputed_references(model, memory):
    expected = ra_lens.reversed_attention(model, TOKENS, kl_to(model, CORRUPTED, inside=False))
    got = ra_lens.reversed_attention(
        model, TOKENS, kl_to(model, CORRUPTED, inside=True), memory=memory
    )
    assert expected.maps.abs().max() > 1e-6
    torch.testing.assert_close(got.maps, expected.maps, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.patterns, expected.patterns, rtol=0, atol=0)
