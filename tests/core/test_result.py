"""ReversedAttention (result.py): save keeps the file's mode and follows symlinks, refuses what is not
a regular file, load reads back what was saved and names a damaged or disagreeing file; concat
refuses what does not belong together."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from helpers import CLEAN_TOKENS as TOKENS
from helpers import FLORENCE as PROMPT
from helpers import arch_or_hooked, live_archs

import ra_lens
from ra_lens.metrics import target_nll
from ra_lens.result import ReversedAttention
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module", params=live_archs())
def tiny(request):
    return tiny_model(request.param, n_layers=2)


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


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("gpt2"), dtype=torch.float64)


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


def test_patterns_given_per_layer_read_as_one_tensor(small_ra):
    """The constructor takes `patterns` as one [batch head query key] tensor per layer (what
    reversed_attention hands over) and reads back the stacked [batch layer head query key]
    tensor: equal, stacked once, and through save, concat, replace and records alike."""
    import dataclasses

    from ra_lens.record import decode, encode

    stacked = small_ra.patterns
    fields = {f.name: getattr(small_ra, f.name) for f in dataclasses.fields(small_ra)}
    per_layer = [stacked[:, i].clone() for i in range(stacked.shape[1])]
    lazy = ReversedAttention(**{**fields, "patterns": per_layer})
    assert torch.equal(lazy.patterns, stacked) and lazy.patterns is lazy.patterns
    assert ReversedAttention.__dataclass_fields__["patterns"].default is None
    assert ReversedAttention(**{**fields, "maps": None, "patterns": None}).patterns is None
    again = ReversedAttention(**{**fields, "patterns": list(per_layer)})
    assert torch.equal(ReversedAttention.concat([again, lazy]).patterns, torch.cat([stacked] * 2))
    assert torch.equal(dataclasses.replace(lazy).patterns, stacked)
    assert torch.equal(decode(encode(lazy)).patterns, stacked)
