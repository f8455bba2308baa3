"""Bad input to RA, attribution and their results is refused with a clear error, and odd but
valid input gives the right answer (issue 19 items 4-8 and 10 for these modules)."""

from __future__ import annotations

import pytest
import torch
from helpers import arch_or_hooked

import ra_lens
from ra_lens.capture import Batch
from ra_lens.metrics import logit_diff, target_nll
from ra_lens.toy_models import tiny_model

TOKENS = torch.tensor([[0, 5, 9, 14, 20, 33, 7, 41, 12], [0, 8, 3, 14, 25, 33, 7, 40, 12]])
CORRUPTED = torch.tensor([[0, 5, 17, 14, 20, 61, 7, 41, 12], [0, 8, 3, 19, 25, 33, 70, 40, 12]])
DIFF = logit_diff([30, 31], [32, 33])


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# item 4: positions must be integers


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


# --------------------------------------------------------------------------------------------
# item 10: a metric that runs the model itself


def _kl_to(model, reference_tokens, *, inside: bool):
    """KL(model(reference_tokens) || logits) at the last position; with inside=True the
    reference logits are computed inside the metric, under no_grad, by a second forward pass."""
    with torch.no_grad():
        fixed = model(reference_tokens).log_softmax(-1)[:, -1]

    def metric(logits):
        ref = fixed
        if inside:
            with torch.no_grad():
                ref = model(reference_tokens).log_softmax(-1)[:, -1]
        return (ref.exp() * (ref - logits[:, -1].log_softmax(-1))).sum(-1)

    return metric


@pytest.mark.parametrize("memory", ["full", "layerwise"])
def test_metric_running_the_model_gives_the_ra_of_precomputed_references(model, memory):
    expected = ra_lens.reversed_attention(model, TOKENS, _kl_to(model, CORRUPTED, inside=False))
    got = ra_lens.reversed_attention(
        model, TOKENS, _kl_to(model, CORRUPTED, inside=True), memory=memory
    )
    assert expected.maps.abs().max() > 1e-6
    torch.testing.assert_close(got.maps, expected.maps, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.patterns, expected.patterns, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["exact", "linear"])
def test_attribution_with_a_metric_running_the_model(model, method):
    other = TOKENS.flip(0)
    expected = ra_lens.attention_attribution(
        model, TOKENS, CORRUPTED, _kl_to(model, other, inside=False), method=method
    )
    got = ra_lens.attention_attribution(
        model, TOKENS, CORRUPTED, _kl_to(model, other, inside=True), method=method
    )
    assert expected.edges.abs().max() > 1e-8
    torch.testing.assert_close(got.edges, expected.edges, rtol=0, atol=1e-12)
    for kind in expected.nodes:
        torch.testing.assert_close(got.by_position[kind], expected.by_position[kind])


# --------------------------------------------------------------------------------------------
# item 6: concat joins results of one model computed alike


def test_concat_refuses_different_keep(model):
    parts = [
        ra_lens.reversed_attention(model, TOKENS[:1], target_nll([5]), keep=keep)
        for keep in ("maps", "rows")
    ]
    with pytest.raises(ValueError, match=r"different keep= \(\['maps', 'rows'\]\)"):
        ra_lens.ReversedAttention.concat(parts)


def test_concat_refuses_results_of_different_models(model):
    other = tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64, n_heads=2)
    parts = [ra_lens.reversed_attention(m, TOKENS[:1], target_nll([5])) for m in (model, other)]
    with pytest.raises(ValueError, match="different models"):
        ra_lens.ReversedAttention.concat(parts)
    scaled = ra_lens.reversed_attention(model, TOKENS[1:], target_nll([5]))
    scaled.scales = [2 * s for s in scaled.scales]
    with pytest.raises(ValueError, match="different models"):
        ra_lens.ReversedAttention.concat([parts[0], scaled])


# --------------------------------------------------------------------------------------------
# item 7: load checks what it reads


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("ra") / "ra.safetensors"
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows")
    ra.save(path)
    return ra, path


def _rewrite(path, target, edit):
    """Copy the saved file to `target` with its metadata and tensors passed through `edit`."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["ra_lens"])
    tensors = load_file(str(path))
    edit(meta, tensors)
    tensors = {name: value.contiguous() for name, value in tensors.items()}
    save_file(tensors, str(target), metadata={"ra_lens": json.dumps(meta)})
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m, t: m.update(layers=[0, 1, 2]), "one entry per layer"),
        (lambda m, t: m.update(layers=[1, 0]), "increasing order"),
        (lambda m, t: m.update(convention="logits"), "unknown convention"),
        (lambda m, t: m.update(scales=[1.0]), "one entry per layer"),
        (lambda m, t: m.pop("routes"), "metadata has keys"),
        (lambda m, t: t.update(rows=t["rows"][:, :, :2]), "rows have shape"),
        (lambda m, t: t.pop("row_positions"), "rows come without row_positions"),
        (lambda m, t: t.update(lengths=t["lengths"][:1]), "lengths have shape"),
        (lambda m, t: t.update(extra=torch.zeros(1)), "unexpected tensors"),
    ],
)
def test_load_refuses_metadata_that_disagrees_with_the_tensors(saved, tmp_path, edit, message):
    _, path = saved
    bad = _rewrite(path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(ValueError, match=message) as error:
        ra_lens.ReversedAttention.load(bad)
    assert str(bad) in str(error.value)


def test_load_reads_back_what_was_saved(saved):
    ra, path = saved
    back = ra_lens.ReversedAttention.load(path)
    assert back.keep == "rows" and back.layers == ra.layers
    torch.testing.assert_close(back.rows, ra.rows, rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["truncated", "empty", "folder", "bad json"])
def test_load_names_a_damaged_file(saved, tmp_path, damage):
    _, path = saved
    bad = tmp_path / "bad.safetensors"
    if damage == "truncated":
        bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "folder":
        bad.mkdir()
    else:
        from safetensors.torch import save_file

        save_file({"norms": torch.zeros(1, 1, 1)}, str(bad), metadata={"ra_lens": "{layers"})
    with pytest.raises(ValueError, match="not a readable ra-lens result file") as error:
        ra_lens.ReversedAttention.load(bad)
    assert str(bad) in str(error.value)


# --------------------------------------------------------------------------------------------
# item 5 (and issue 21 item 6): what to_transformer_lens exports


@pytest.fixture(scope="module")
def mixed(model):
    """Two pairs of different real lengths (9 and 7 tokens, right-padded)."""
    lengths = torch.tensor([9, 7])
    clean, corrupted = Batch(TOKENS, lengths), Batch(CORRUPTED, lengths)
    return ra_lens.attention_attribution(model, clean, corrupted, target_nll([5]))


@pytest.mark.tl4  # TransformerLens 4's AttributionResult
def test_to_transformer_lens_refuses_noise(model):
    att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, DIFF, direction="noise")
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


# --------------------------------------------------------------------------------------------
# issue 20: AttentionAttribution's vocabulary, to_dict/save/load


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_clean_and_corrupted_metric_keep_their_meaning(model, direction):
    att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, DIFF, direction=direction)
    with torch.no_grad():
        clean, corrupted = DIFF(model(TOKENS)), DIFF(model(CORRUPTED))
    torch.testing.assert_close(att.clean_metric, clean.float())
    torch.testing.assert_close(att.corrupted_metric, corrupted.float())


def test_attribution_top_heads_to_dict_and_save_load(model, tmp_path):
    att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, DIFF)
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
    ra_lens.reversed_attention(model, TOKENS, target_nll([5])).save(folder / "ra.safetensors")
    return folder / "ra.safetensors"


@pytest.mark.parametrize("k", [0, -3])
def test_top_heads_refuses_a_non_positive_k(model, k):
    att = ra_lens.attention_attribution(model, TOKENS, CORRUPTED, DIFF, nodes=["query"])
    with pytest.raises(ValueError, match="k must be a positive number"):
        att.top_heads(k)
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms")
    with pytest.raises(ValueError, match="k must be a positive number"):
        ra.top_heads(k)


# --------------------------------------------------------------------------------------------
# item 8: counts and sweeps that would silently shrink are refused


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_prompts": -1}, "n_prompts must be a whole number >= 2"),
        ({"n_prompts": 1}, "n_prompts must be a whole number >= 2"),
        ({"n_test": -1}, "n_test must be a whole number >= 1"),
        ({"n_test": 0}, "n_test must be a whole number >= 1"),
        ({"scales": []}, "non-empty sequence of finite numbers"),
        ({"scales": [1.0, float("nan")]}, "non-empty sequence of finite numbers"),
        ({"shots": -1}, "shots must be a whole number >= 0"),
    ],
)
def test_attention_patching_refuses_bad_counts(model, kwargs, message):
    from ra_lens.experiments import attention_patching

    arguments = {"shots": 1, "n_prompts": 2, "scales": [-4.0], "progress": False} | kwargs
    with pytest.raises(ValueError, match=message):
        attention_patching(model, "antonym", **arguments)


def test_cli_attribute_refuses_a_negative_top(capsys):
    from ra_lens import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["attribute", "--clean", "a", "--corrupted", "b", "--target", " c",
                  "--top", "-3"])  # fmt: skip
    assert exit_.value.code == 2
    assert "expected a whole number >= 1, got '-3'" in capsys.readouterr().err
