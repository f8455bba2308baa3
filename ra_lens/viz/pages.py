"""Interactive HTML pages drawn by circuitsvis: a result's heads (Reversed Attention, then the
forward patterns) and an attribution's edge maps.

Each function returns one self-contained page as a string (circuitsvis' JavaScript bundle is
inlined once, so it renders offline); `save="page.html"` also writes it.
"""

from __future__ import annotations

import html as _html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ra_lens.files import write_file
from ra_lens.viz._base import (
    NEGATIVE,
    POSITIVE,
    SHORT_NAMES,
    PathLike,
    as_numpy,
    head_matrices,
    map_name,
    symmetric_limit,
    token_labels,
)

# Results import their views; views name results for type hints only.
if TYPE_CHECKING:
    from ra_lens.attribution import AttentionAttribution
    from ra_lens.result import ReversedAttention


__all__ = ["attribution_edges_page", "circuitsvis_heads"]


def circuitsvis_heads(
    ra: ReversedAttention,
    heads: Sequence[Sequence[Any]] | None = None,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> str:
    """An interactive circuitsvis page: the heads' RA maps, then the same heads' forward patterns.

    Args:
        ra: a result computed with keep="maps".
        heads: (layer, head) pairs (the (layer, head, norm) triples of `ra.top_heads` work too);
            default: the 8 heads with the largest RA norm.
        prompt: which prompt of the batch; maps are cut to its real length.
        save: optional path of an .html file to write.

    Returns:
        One self-contained HTML page (circuitsvis' JavaScript bundle inlined once, so it renders
        offline). RA is shown signed with a symmetric range shared by all the chosen heads
        (min_value == -max_value == -max|RA|); forward patterns on [0, 1]. Heads are named
        "L{layer}H{head} RA" and "L{layer}H{head} attn".

    >>> from ra_lens import metrics, reversed_attention
    >>> ra = reversed_attention(model, "The capital of France is", metrics.target_nll([294]))
    >>> page = circuitsvis_heads(ra, [(1, 2), (0, 3)])
    >>> page.startswith("<!DOCTYPE html>"), "L1H2 RA" in page, "L0H3 attn" in page
    (True, True, True)
    """
    chosen = _parse_heads(ra, heads)
    if not chosen:
        raise ValueError("no heads to show")
    pairs = [head_matrices(ra, layer, head, prompt) for layer, head in chosen]
    ra_maps = np.stack([np.tril(p[0]) for p in pairs])
    patterns = np.stack([p[1] for p in pairs])
    limit = symmetric_limit(ra_maps)
    labels = token_labels(ra, prompt)
    short = SHORT_NAMES.get(ra.convention, "RA")
    sections = [
        (
            f"{map_name(ra)} (signed; red = raising this logit raises the metric, blue = "
            f"lowers it; colour range \u00b1{limit:.3g})",
            _signed_heads(ra_maps, labels, [f"L{la}H{h} {short}" for la, h in chosen], limit),
        ),
        (
            "Forward attention (range 0 to 1)",
            _forward_heads(patterns, labels, chosen),
        ),
    ]
    return _write_page(_assemble_page(sections, ra, prompt), save)


def attribution_edges_page(
    att: AttentionAttribution,
    heads: Sequence[Sequence[Any]] | None = None,
    *,
    prompt: int = 0,
    save: PathLike | None = None,
) -> str:
    """An offline circuitsvis page of edge maps R * (A_other - A) for chosen heads, then their
    forward patterns on the patched run.

    Args:
        att: an AttentionAttribution.
        heads: (layer, head) pairs (`att.top_heads(k, "pattern")` triples work); default: the 8 heads
            with the largest |pattern| score.
        prompt: which pair of the batch.
        save: optional .html path.

    >>> from ra_lens import attention_attribution, metrics
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> att = attention_attribution(model, clean, corrupted, metrics.logit_diff([294], [52]))
    >>> page = attribution_edges_page(att, att.top_heads(2, node="pattern"))
    >>> page.startswith("<!DOCTYPE html>"), "Edges R * (A_other - A)" in page
    (True, True)
    """

    chosen = [(int(h[0]), int(h[1])) for h in (heads or att.top_heads(8, node="pattern"))]
    if not chosen:
        raise ValueError("no heads to show")
    n = int(att.lengths[prompt])
    idx = [att.layers.index(la) for la, _ in chosen]
    edges = np.stack([as_numpy(att.edges[prompt, i, h, :n, :n]) for i, (_, h) in zip(idx, chosen)])
    patterns = np.stack(
        [as_numpy(att.patterns[prompt, i, h, :n, :n]) for i, (_, h) in zip(idx, chosen)]
    )
    limit = symmetric_limit(edges)
    labels = token_labels(att, prompt)
    sections = [
        (
            f"Edges R * (A_other - A), {att.direction}: the metric change each query-key link "
            f"carries (red = raises it; colour range \u00b1{limit:.3g})",
            _signed_heads(
                np.tril(edges),
                labels,
                [f"L{la}H{h} edges" for la, h in chosen],
                limit,
            ),
        ),
        (
            "Forward attention of the patched run (range 0 to 1)",
            _forward_heads(patterns, labels, chosen),
        ),
    ]
    return _write_page(_assemble_page(sections, att, prompt), save)


def _parse_heads(
    ra: ReversedAttention, heads: Sequence[Sequence[Any]] | None
) -> list[tuple[int, int]]:
    if heads is None:
        heads = ra.top_heads(8)
    return [(int(h[0]), int(h[1])) for h in heads]


def _signed_heads(values: Any, labels: list[str], names: list[str], limit: float) -> Any:
    """A circuitsvis view of signed maps, blue to red, symmetric range +-limit."""
    from circuitsvis.attention import attention_heads

    return attention_heads(
        values.tolist(),
        labels,
        attention_head_names=names,
        max_value=limit,
        min_value=-limit,
        negative_color=NEGATIVE,
        positive_color=POSITIVE,
        mask_upper_tri=True,
    )


def _forward_heads(patterns: Any, labels: list[str], chosen: Any) -> Any:
    """A circuitsvis view of forward patterns, range 0 to 1."""
    from circuitsvis.attention import attention_heads

    return attention_heads(
        patterns.tolist(),
        labels,
        attention_head_names=[f"L{la}H{h} attn" for la, h in chosen],
        max_value=1.0,
        min_value=0.0,
        mask_upper_tri=True,
    )


def _circuitsvis_section(rendered: Any) -> tuple[str, str, str] | None:
    """Split circuitsvis' offline HTML into (div id, inlined JS bundle, render call).

    Returns None if the layout is not the one of circuitsvis 1.43 (`render_local`)."""
    src: str = rendered.local_src
    found = re.match(r'\s*<div id="([^"]+)"[^>]*/?>\s*<script[^>]*>', src)
    call_at, end = src.rfind("CircuitsVis.render("), src.rfind("</script>")
    if not found or call_at < found.end() or end < call_at:
        return None
    return found.group(1), src[found.end() : call_at], src[call_at:end]


def _assemble_page(
    sections: list[tuple[str, Any]], ra: ReversedAttention | AttentionAttribution, prompt: int
) -> str:
    text = "".join(ra.str_tokens[prompt][: int(ra.lengths[prompt])]) if ra.str_tokens else ""
    head = (
        '<!DOCTYPE html>\n<html>\n<head><meta charset="utf-8"><title>ra-lens heads</title></head>'
        '\n<body style="font-family: sans-serif">\n'
        f"<p><b>Prompt {prompt}:</b> <code>{_html.escape(text)}</code></p>\n"
    )
    parts = [_circuitsvis_section(rendered) for _, rendered in sections]
    if any(p is None for p in parts):
        # Unknown circuitsvis layout: concatenate its own offline HTML (bundle repeated).
        body = "".join(
            f"<h3>{_html.escape(title)}</h3>\n<div>{r.local_src}</div>\n" for title, r in sections
        )
        return head + body + "</body>\n</html>\n"
    divs, calls = [], []
    found = cast("list[tuple[str, str, str]]", parts)  # none is None (see above)
    for (title, _), (div_id, _, call) in zip(sections, found, strict=True):
        divs.append(f'<h3>{_html.escape(title)}</h3>\n<div id="{div_id}"></div>\n')
        calls.append(call.strip().replace("</", "<\\/"))
    bundle = found[0][1]
    script = '<script type="module">\n' + bundle + "\n" + "\n".join(calls) + "\n</script>\n"
    return head + "".join(divs) + script + "</body>\n</html>\n"


def _write_page(page: str, save: str | Path | None) -> str:
    if save is not None:
        write_file(save, page, make_folders=True)
    return page
