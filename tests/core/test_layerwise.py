"""memory="layerwise" equals the default route; keep="rows"; accelerate-dispatched models."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers import has_bridge, hook_count

import ra_lens
from ra_lens.capture import PATTERN
from ra_lens.metrics import target_nll
from ra_lens.result import ReversedAttention
from ra_lens.toy_models import tiny_model

PROMPTS = ["I like Italy and France. I visited the city of", "The quick brown fox", "Q: hot\nA:"]


def archs() -> list[str]:
    """Architectures of the installed TransformerLens (OPT: the hook_z route)."""
    return ["gpt2", "llama", "opt", "native"] if has_bridge() else ["hooked"]


@pytest.fixture(scope="module", params=archs())
def model64(request):
    return tiny_model(request.param, n_layers=3, dtype=torch.float64)


def both(model, tokens, metric, **kwargs) -> tuple[ReversedAttention, ReversedAttention]:
    full = ra_lens.reversed_attention(model, tokens, metric, **kwargs)
    layerwise = ra_lens.reversed_attention(model, tokens, metric, memory="layerwise", **kwargs)
    return full, layerwise


def assert_same(a: ReversedAttention, b: ReversedAttention) -> None:
    for name in ("maps", "patterns", "norms", "pattern_norms", "rows", "metric_values"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-12, msg=name)
    assert a.routes == b.routes and a.layers == b.layers


@pytest.mark.parametrize("keep", ["maps", "norms", "rows"])
def test_layerwise_equals_full_on_a_padded_batch(model64, keep):
    full, layerwise = both(model64, PROMPTS, target_nll([5, 6, 7]), keep=keep)
    assert bool((full.lengths < full.tokens.shape[1]).any()), "the batch must be padded"
    assert full.norms.abs().max() > 0
    assert_same(full, layerwise)


@pytest.mark.parametrize("convention", ["scores", "pattern"])
def test_layerwise_equals_full_for_other_conventions_and_a_layer_subset(model64, convention):
    full, layerwise = both(
        model64, PROMPTS[:1], target_nll([5]), convention=convention, layers=[1, 2]
    )
    assert layerwise.layers == [1, 2]
    assert_same(full, layerwise)


def test_user_hook_editing_the_pattern_applies_in_both_passes(model64):
    calls = []

    def edit(pattern, hook):
        calls.append(pattern.requires_grad)
        n = pattern.shape[-1]
        uniform = torch.ones(n, n, dtype=pattern.dtype).tril()
        uniform = uniform / uniform.sum(-1, keepdim=True)
        return 0.5 * pattern + 0.5 * uniform

    metric = target_nll([5, 6, 7])
    plain = ra_lens.reversed_attention(model64, PROMPTS, metric, memory="layerwise")
    with model64.hooks(fwd_hooks=[(PATTERN.format(1), edit)]):
        full, layerwise = both(model64, PROMPTS, metric)
    # Full route: one forward. Layerwise: the forward without autograd, then the recomputation.
    assert len(calls) == 3
    assert_same(full, layerwise)
    if layerwise.routes[1] == "pattern":
        assert not torch.allclose(layerwise.maps, plain.maps)
        assert float((layerwise.metric_values - plain.metric_values).abs().max()) > 1e-6
    else:  # OPT's adapter discards edits at hook_pattern: the model, hence RA, is unchanged
        assert_same(plain, layerwise)


def test_rows_are_the_maps_at_each_loss_position():
    model = tiny_model(archs()[0], dtype=torch.float64)
    maps = ra_lens.reversed_attention(model, PROMPTS, target_nll([5, 6, 7]))
    rows = ra_lens.reversed_attention(model, PROMPTS, target_nll([5, 6, 7]), keep="rows")
    assert rows.maps is None and rows.rows.shape == (3, 2, 4, maps.tokens.shape[1])
    assert rows.row_positions.tolist() == (maps.lengths - 1).tolist()
    for i, n in enumerate(maps.lengths.tolist()):
        torch.testing.assert_close(rows.rows[i], maps.maps[i, :, :, n - 1])
    torch.testing.assert_close(rows.norms, maps.norms)
    at = torch.tensor([3, 2, 1])
    chosen = ra_lens.reversed_attention(
        model, PROMPTS, target_nll([5, 6, 7]), keep="rows", rows_at=at
    )
    for i, p in enumerate(at.tolist()):
        torch.testing.assert_close(chosen.rows[i], maps.maps[i, :, :, p])
    assert "keep='rows'" in repr(rows)


def test_rows_errors():
    model = tiny_model(archs()[0])
    with pytest.raises(ValueError, match="pass keep='rows'"):
        ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([5]), rows_at=torch.tensor([1]))
    with pytest.raises(ValueError, match="inside its real length"):
        ra_lens.reversed_attention(
            model, PROMPTS[:2], target_nll([5, 6]), keep="rows", rows_at=torch.tensor([1, 99])
        )
    norms = ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([5]), keep="norms")
    with pytest.raises(ValueError, match="keep='rows'"):
        norms.top_keys(0, 0)


def test_top_keys_rank_the_row_by_magnitude():
    model = tiny_model(archs()[0])
    ra = ra_lens.reversed_attention(model, PROMPTS, target_nll([5, 6, 7]), keep="rows")
    top = ra.top_keys(1, 2, k=4, prompt=1)
    row = ra.rows[1, 1, 2, : int(ra.lengths[1])]
    assert [p for p, _, _ in top] == row.abs().argsort(descending=True)[:4].tolist()
    assert [v for _, _, v in top] == pytest.approx([row[p].item() for p, _, _ in top])
    assert [t for _, t, _ in top] == [ra.str_tokens[1][p] for p, _, _ in top]
    assert all(p < int(ra.lengths[1]) for p, _, _ in top)


def test_rows_survive_save_load_and_concat(tmp_path):
    model = tiny_model(archs()[0])
    a = ra_lens.reversed_attention(model, PROMPTS[:2], target_nll([5, 6]), keep="rows")
    b = ra_lens.reversed_attention(model, PROMPTS[:2], target_nll([7, 8]), keep="rows")
    a.save(tmp_path / "ra.safetensors")
    loaded = ReversedAttention.load(tmp_path / "ra.safetensors")
    assert torch.equal(loaded.rows, a.rows) and torch.equal(loaded.row_positions, a.row_positions)
    joined = ReversedAttention.concat([a, b])
    assert torch.equal(joined.rows, torch.cat([a.rows, b.rows]))
    assert joined.row_positions.tolist() == a.row_positions.tolist() * 2


def test_errors_name_the_fix():
    model = tiny_model(archs()[0])
    with pytest.raises(ValueError, match="'full' or 'layerwise'"):
        ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([1]), memory="cheap")
    ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([1]))  # the bridge wires its hooks
    hooks = hook_count(model)
    # Something between two blocks: the recomputation could not reproduce it.
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * 2, *args[1:]))
    try:
        with pytest.raises(RuntimeError, match="back to back.*memory='full'"):
            ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([1]), memory="layerwise")
    finally:
        handle.remove()
    # Logits changed after the unembedding: the head cannot be recomputed from the residual.
    handle = model.register_forward_hook(lambda m, args, out: out * 2)
    try:
        with pytest.raises(RuntimeError, match="unembed.*memory='full'"):
            ra_lens.reversed_attention(model, PROMPTS[:1], target_nll([1]), memory="layerwise")
    finally:
        handle.remove()
    assert hook_count(model) == hooks


# ---------------------------------------------------------------------------------------------
# accelerate: a model split across devices, here with layers offloaded to disk
# ---------------------------------------------------------------------------------------------


def dispatched_pair():
    """The same tiny Llama twice: plain, and with layers 1-2 offloaded to disk by accelerate
    (their weights live on the meta device and accelerate's hooks load them for each call)."""
    pytest.importorskip("accelerate")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ra_lens.models import hub_offline
    from ra_lens.toy_models import hf_config, tiny_tokenizer_dir

    torch.manual_seed(0)
    config = hf_config("llama", 300, 32, 4, 4, 64)
    config._attn_implementation = "eager"
    folder = tempfile.mkdtemp(prefix="ra_lens_test_dispatch_")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.layers.3": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    split = AutoModelForCausalLM.from_pretrained(
        folder,
        device_map=device_map,
        offload_folder=tempfile.mkdtemp(prefix="ra_lens_test_offload_"),
        attn_implementation="eager",
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with hub_offline():
        return tuple(
            TransformerBridge.boot_transformers(folder, hf_model=m, tokenizer=tokenizer)
            for m in (plain, split)
        )


@pytest.mark.tl4  # accelerate dispatch through HF models: TransformerBridge.boot_transformers
def test_disk_offloaded_model_gives_the_plain_models_ra_patching_and_ranking():
    pytest.importorskip("transformer_lens.model_bridge")
    from ra_lens.ranking import ra_ranking

    plain, split = dispatched_pair()
    assert next(split.blocks[1].parameters()).device.type == "meta"
    metric = target_nll([5, 6, 7])
    reference = ra_lens.reversed_attention(plain, PROMPTS, metric)
    for memory in ("full", "layerwise"):
        ra = ra_lens.reversed_attention(split, PROMPTS, metric, memory=memory)
        assert ra.maps.device.type == "cpu"
        torch.testing.assert_close(ra.maps, reference.maps, rtol=1e-5, atol=1e-8)
    tokens = reference.tokens[:1]
    with plain.hooks(fwd_hooks=ra_lens.attention_patch_hooks(reference, -4.0)):
        patched = plain(tokens)
    with split.hooks(fwd_hooks=ra_lens.attention_patch_hooks(reference, -4.0)):
        torch.testing.assert_close(split(tokens), patched)
    targets = torch.tensor([5, 6, 7])
    torch.testing.assert_close(
        ra_ranking(split, PROMPTS, targets), ra_ranking(plain, PROMPTS, targets)
    )
    assert next(split.blocks[1].parameters()).device.type == "meta"


@pytest.mark.real_model
@pytest.mark.parametrize("keep", ["norms", "rows"])
def test_smollm2_layerwise_equals_full_at_256_tokens(smollm2, keep):
    text = "The committee met on a grey morning to review the quarterly reports. " * 30
    tokens = smollm2.to_tokens(text)[:, :256]
    full, layerwise = both(smollm2, tokens, target_nll(tokens[:, -1]), keep=keep)
    for name in ("norms", "rows"):
        x, y = getattr(full, name), getattr(layerwise, name)
        if x is not None:
            assert float((y - x).norm() / x.norm()) <= 1e-5, name
