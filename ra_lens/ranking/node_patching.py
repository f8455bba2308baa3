"""The one node-patching ground truth: M(corrupted run with one node taken from the clean run) -
M(corrupted run), direction "denoise", in a plain hook loop.

A node is (kind, layer, head, position): a head's output ("output", its `hook_z`: the output is
z_h @ W_O[h], so patching z patches exactly that), its queries ("query"), the keys of one
key/value head ("key", after the rotary embedding where there is one) or its attention pattern
("pattern", rows at one query position), at one position or at every position (None). Jobs are
stacked along the batch axis, several per forward pass. The circuit study's head truth and the
attribution study's query/key/pattern truth both come from here; `activation_patching` is the
ranking computed by TransformerLens's own patching code, checked against this loop in the tests.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import PATTERN, Batch, HookedModel, Z
from ra_lens.pairs import metric_values
from ra_lens.progress import tqdm
from ra_lens.types import MetricFn

#: The node kinds a job may patch.
NODE_KINDS: tuple[str, ...] = ("output", "query", "key", "pattern")

#: A patching job: (kind, layer, head, position or None for every position).
Job = tuple[str, int, int, int | None]


def node_hook_name(model: HookedModel, kind: str, layer: int) -> str:
    """The hook point a node of `kind` is read from and patched at.

    >>> node_hook_name(model, "key", 0), node_hook_name(model, "output", 1)  # GPT-2: no rotary
    ('blocks.0.attn.hook_k', 'blocks.1.attn.hook_z')
    """
    if kind == "output":
        return Z.format(layer)
    if kind == "query":
        return capture.query_hook_name(model, layer)
    if kind == "key":
        return capture.key_hook_name(model, layer)
    if kind == "pattern":
        return PATTERN.format(layer)
    raise ValueError(f"unknown node kind {kind!r}: choose from {NODE_KINDS}")


def clean_activations(model: HookedModel, clean: Batch, names: Sequence[str]) -> dict[str, Tensor]:
    """The named activations of the clean run (the values patched in).

    >>> from ra_lens import to_batch
    >>> names = [node_hook_name(model, kind, 1) for kind in NODE_KINDS]
    >>> sorted(clean_activations(model, to_batch(model, "I like Italy"), names))
    ['blocks.1.attn.hook_k', 'blocks.1.attn.hook_pattern', 'blocks.1.attn.hook_q', 'blocks.1.attn.hook_z']
    """
    with capture.eval_mode(model), torch.no_grad(), capture.recorded(model, names) as seen:
        model(clean.tokens)
    return seen


def metric_repeated(metric: MetricFn, logits: Tensor, lengths: Tensor, repeats: int) -> Tensor:
    """The metric of a batch repeated `repeats` times (its per-pair targets repeated too).

    >>> from ra_lens.metrics import target_prob
    >>> logits = torch.randn(2, 3, 10)
    >>> repeated = metric_repeated(target_prob([4]), logits, torch.tensor([3, 3]), repeats=2)
    >>> torch.allclose(repeated, target_prob([4, 4])(logits))
    True
    """
    n = logits.shape[0] // repeats
    return torch.cat(
        [
            metric(logits[i * n : (i + 1) * n], lengths=lengths[i * n : (i + 1) * n])
            for i in range(repeats)
        ]
    )


def patching_effects(
    model: HookedModel,
    clean: Batch,
    corrupted: Batch,
    metric: MetricFn,
    jobs: Sequence[Job],
    *,
    max_rows: int = 64,
    progress: bool = True,
) -> Float[Tensor, "job batch"]:
    """M(corrupted with one node from clean) - M(corrupted) for every job and pair, float64.

    Runs in eval mode (the model's modes restored afterwards) under no_grad, `max_rows` rows
    per forward pass.

    >>> from ra_lens import to_batch
    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = to_batch(model, ["I like Italy"]), to_batch(model, ["I like Paris"])
    >>> metric = logit_diff(torch.tensor([5]), torch.tensor([7]))
    >>> jobs = [("query", 1, 2, None), ("pattern", 0, 1, 3), ("key", 1, 0, None), ("output", 0, 3, None)]
    >>> effects = patching_effects(model, clean, corrupted, metric, jobs, progress=False)
    >>> effects.shape  # [job batch]
    torch.Size([4, 1])
    >>> same = patching_effects(model, clean, clean, metric, jobs, progress=False)
    >>> bool(same.abs().max() < 1e-6)  # patching a run with itself: nothing but rounding
    True
    """
    names = [node_hook_name(model, kind, layer) for kind, layer, _, _ in jobs]
    source = clean_activations(model, clean, names)
    n = clean.tokens.shape[0]
    per_pass = max(1, max_rows // n)
    out = torch.zeros(len(jobs), n, dtype=torch.float64)
    chunks = [range(i, min(i + per_pass, len(jobs))) for i in range(0, len(jobs), per_pass)]
    with capture.eval_mode(model), torch.no_grad():
        base = metric_values(metric, model(corrupted.tokens), corrupted).double().cpu()
        for chunk in tqdm(chunks, desc="activation patching", disable=not progress):
            by_name: dict[str, list[tuple[int, int, int | None]]] = {}
            for slot, j in enumerate(chunk):
                _, _, head, position = jobs[j]
                by_name.setdefault(names[j], []).append((slot, head, position))
            # The name asked for, not hook.name: on TransformerBridge an alias such as hook_q
            # reports its canonical name (attn.q.hook_out).
            hooks = [
                (
                    name,
                    functools.partial(
                        _patch,
                        source=source[name],
                        slots=slots,
                        n=n,
                        pattern=name.endswith("hook_pattern"),
                    ),
                )
                for name, slots in by_name.items()
            ]
            repeats = len(chunk)
            tokens = corrupted.tokens.repeat(repeats, 1)
            lengths = corrupted.lengths.repeat(repeats)
            with model.hooks(fwd_hooks=hooks):
                values = metric_repeated(metric, model(tokens), lengths, repeats)
            out[list(chunk)] = values.double().cpu().reshape(repeats, n) - base
    return out


def _patch(
    x: Tensor,
    hook: Any,
    *,
    source: Tensor,
    slots: list[tuple[int, int, int | None]],
    n: int,
    pattern: bool,
) -> Tensor:
    """Copy each job's node from the clean run into its slot of the stacked corrupted batch."""
    x = x.clone()
    for slot, head, position in slots:
        rows = slice(slot * n, (slot + 1) * n)
        at = slice(None) if position is None else position
        if pattern:  # [batch, head, query, key]
            x[rows, head, at] = source[:, head, at]
        else:  # [batch, pos, head, d_head]
            x[rows, at, head] = source[:, at, head]
    return x
