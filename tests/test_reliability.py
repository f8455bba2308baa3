"""Nothing lost, nothing silent: each defect of issue 10's bad-input probe, one test each.

Every test here failed before its fix. They run under both TransformerLens versions (the
`tiny` fixture gives a bridge under TL 4 and a HookedTransformer under TL 2); the model-cache
items live in test_models.py.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch
from helpers import has_bridge

import ra_lens
from ra_lens import capture, cli, metrics, tasks
from ra_lens.metrics import target_nll
from ra_lens.result import ReversedAttention
from ra_lens.toy_models import tiny_model

PROMPT = "I like Italy and France. I visited the city of"


def live_archs() -> list[str]:
    return ["gpt2", "llama"] if has_bridge() else ["hooked"]


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


# --- item 2: RA under user hooks that edit the pattern or the scores -------------------------


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


# --- item 3: no silent truncation -------------------------------------------------------------


def test_text_longer_than_context_is_refused(tiny):
    n_ctx = tiny.cfg.n_ctx
    long_text = " hello" * (n_ctx + 10)
    with pytest.raises(ValueError, match=f"n_ctx={n_ctx}"):
        ra_lens.reversed_attention(tiny, long_text, target_nll([3]))
    with pytest.raises(ValueError, match="n_ctx"):
        capture.to_batch(tiny, ["short", long_text])


def test_cli_refuses_text_longer_than_context(capsys):
    model = "tiny-" + live_archs()[0]
    code = cli.main(["maps", "--model", model, "--prompt", " a" * 200, "--target", " b"])
    assert code == 2
    assert "n_ctx=" in capsys.readouterr().err


# --- item 4: evaluate with position-aligned hooks on prompts of different lengths -------------


def test_evaluate_with_patch_on_mixed_lengths_equals_one_prompt_at_a_time(tiny):
    task = tasks.load("antonym")
    prompts = tasks.build_prompts(task, task.pairs[:12], shots=0)
    prompts += tasks.build_prompts(task, task.pairs[12:20], shots=1, demos_from=task.pairs[30:])
    assert len(set(tasks.prompt_lengths(tiny, prompts))) > 1
    n = tasks.prompt_lengths(tiny, prompts[:1])[0]
    maps = torch.randn(tiny.cfg.n_layers, tiny.cfg.n_heads, n, n) * 0.05
    hooks = ra_lens.attention_patch_hooks(maps, -5.0)
    together = tasks.evaluate(tiny, prompts, fwd_hooks=hooks, batch_size=16)
    alone = [tasks.evaluate(tiny, [p], fwd_hooks=hooks).ranks[0] for p in prompts]
    assert together.ranks.tolist() == [int(r) for r in alone]


# --- item 6: NaN and inf ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_metric_is_refused(tiny, bad):
    def metric(logits):
        return logits[:, -1, 0] * bad

    with pytest.raises(ValueError, match="non-finite"):
        ra_lens.reversed_attention(tiny, tiny.to_tokens(PROMPT), metric)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_patch_scale_is_refused(tiny, bad):
    maps = torch.zeros(tiny.cfg.n_layers, tiny.cfg.n_heads, 4, 4)
    with pytest.raises(ValueError, match="finite"):
        ra_lens.attention_patch_hooks(maps, bad)
    per_head = torch.full((tiny.cfg.n_layers, tiny.cfg.n_heads), -1.0)
    per_head[0, 1] = bad
    with pytest.raises(ValueError, match="finite"):
        ra_lens.attention_patch_hooks(maps, per_head)


# --- item 7: the CLI checks its outputs before computing, writes JSON atomically --------------


def test_cli_checks_outputs_before_computing(tmp_path, capsys, monkeypatch):
    computed = []
    monkeypatch.setattr(cli, "_load", lambda name, *a, **k: computed.append(name))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    args = ["maps", "--model", "tiny-gpt2", "--prompt", "a b", "--target", " c"]
    assert cli.main([*args, "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert cli.main([*args, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root writes into a 0500 folder anyway; /sys is read-only for everyone
    unwritable = locked if not os.access(locked, os.W_OK) else Path("/sys")
    try:
        assert cli.main([*args, "--json", str(unwritable / "sub" / "r.json")]) == 2
        assert "cannot write" in capsys.readouterr().err
        assert cli.main([*args, "--out", str(unwritable / "plots")]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)
    assert computed == []  # nothing was loaded or computed


def test_cli_json_is_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    target.write_text('{"old": true}')

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cli.json, "dumps", lambda *a, **k: "{}")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        cli._emit_json(str(target), {"new": True})
    assert target.read_text() == '{"old": true}'  # untouched, and no temporary left behind
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_cli_top_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["maps", "--prompt", "a", "--target", " b", "--top", "-3"])
    assert ">= 1" in capsys.readouterr().err


# --- item 8: tensor positions follow the per-prompt rule --------------------------------------


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


# --- item 9: clear errors ---------------------------------------------------------------------


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


def test_clear_errors_for_heads_and_maps(tiny):
    with pytest.raises(ValueError, match=r"heads=\[\(layer, head\)\]"):
        ra_lens.head_ablation_hooks((0, 1))
    maps = torch.zeros(tiny.cfg.n_layers, tiny.cfg.n_heads, 4, 4)
    with pytest.raises(ValueError, match=r"heads=\[\(layer, head\)\]"):
        ra_lens.attention_patch_hooks(maps, -1.0, heads=(0, 1))
    with pytest.raises(ValueError, match="as many queries as keys"):
        ra_lens.attention_patch_hooks(torch.zeros(2, 4, 3, 5), -1.0)


def test_clear_error_inside_inference_mode(tiny):
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]))
    ra = ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]))  # and the model still works
    assert ra.maps.abs().max() > 0


# --- item 10: one call at a time per model ----------------------------------------------------


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


# --- item 11: save replaces nothing it should not ---------------------------------------------


@pytest.fixture(scope="module")
def small_ra(tiny):
    return ra_lens.reversed_attention(tiny, PROMPT, target_nll([3]))


def test_save_keeps_mode_and_follows_symlinks(tmp_path, small_ra):
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    real.chmod(0o640)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    small_ra.save(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    torch.testing.assert_close(ReversedAttention.load(link).maps, small_ra.maps)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.safetensors", "real.safetensors"]


def test_save_refuses_what_is_not_a_regular_file(tmp_path, small_ra):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        small_ra.save(folder)
    assert folder.is_dir()


def test_concat_errors_are_clear(tiny, small_ra):
    with pytest.raises(ValueError, match="at least one"):
        ReversedAttention.concat([])

    def scalar(logits):
        return logits[:, -1, 3].sum()

    ra = ra_lens.reversed_attention(tiny, PROMPT, scalar)
    with pytest.raises(ValueError, match="scalar metric"):
        ReversedAttention.concat([ra, ra])


def test_mixed_train_eval_modes_come_back_module_by_module(tiny):
    """RA runs in eval mode and restores each submodule's own mode (not one mode for all)."""
    modules = list(tiny.modules())
    tiny.train()
    modules[len(modules) // 2].eval()
    before = [m.training for m in modules]
    seen = []
    hooks = [(capture.PATTERN.format(0), lambda x, hook: seen.append(tiny.training))]
    with tiny.hooks(fwd_hooks=hooks):
        ra_lens.reversed_attention(tiny, PROMPT, target_nll(5))
    try:
        assert seen and not any(seen)  # every forward pass ran in eval mode
        assert [m.training for m in modules] == before
    finally:
        tiny.eval()
