"""The interactive pages are written with `ra_lens.files.write_file` (the one writer): through a
symlink to its target, the file's mode kept, missing folders created, a folder refused by name."""

from __future__ import annotations

import os

import pytest
from helpers import arch_or_hooked

import ra_lens
from ra_lens import viz
from ra_lens.metrics import target_nll
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def ra():
    model = tiny_model(arch_or_hooked("gpt2"))
    return ra_lens.reversed_attention(model, "The capital of France is", target_nll([5]))


def test_page_through_a_symlink_keeps_link_and_mode(ra, tmp_path):
    target = tmp_path / "real.html"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.html"
    link.symlink_to(target)
    page = viz.circuitsvis_heads(ra, [(0, 1)], save=link)
    assert link.is_symlink() and target.read_text(encoding="utf-8") == page
    assert os.stat(target).st_mode & 0o777 == 0o640
    nested = tmp_path / "new" / "folder" / "page.html"
    assert viz.circuitsvis_heads(ra, [(0, 1)], save=nested) == nested.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=str(tmp_path)):
        viz.circuitsvis_heads(ra, [(0, 1)], save=tmp_path)  # a folder, not a file
