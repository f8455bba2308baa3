"""TransformerLens-style `hook_pattern` hooks (`attention_patch_hooks`, `forward_patch_hooks`)
applied inside an nnsight trace: each hook edits the output of its layer's softmax call, before
the pattern meets the values, exactly where TransformerLens's `hook_pattern` sits."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ra_lens.nnsight import adapter

if TYPE_CHECKING:
    from ra_lens.tasks.accuracy import Accuracy

_PATTERN = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")


def run_with_pattern_hooks(
    model: Any, tokens: Tensor, fwd_hooks: Sequence[tuple[str | Callable[[str], bool], Any]]
) -> Tensor:
    """Logits Float[Tensor, "batch pos vocab"] of `tokens` with each (hook name, hook function)
    applied to its layer's attention pattern A ([batch, head, query, key]), as
    `model.hooks(fwd_hooks=...)` would on a TransformerLens model. Runs in eval mode under
    no_grad; the model is left as found.

    Raises:
        ValueError: a hook on anything but `blocks.{layer}.attn.hook_pattern`.
    """
    by_layer: dict[int, list[Any]] = {}
    for name, fn in fwd_hooks:
        match = _PATTERN.match(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(
                f"hook {name!r}: nnsight models take hooks on blocks.{{layer}}.attn.hook_pattern "
                "only (attention_patch_hooks, forward_patch_hooks)"
            )
        by_layer.setdefault(int(match.group(1)), []).append(fn)
    found = adapter.layout(model)
    if any(layer >= len(found.attention_paths) for layer in by_layer):
        raise ValueError(
            f"hooks on layers {sorted(by_layer)}: the model has {len(found.attention_paths)}"
        )
    path = adapter.softmax_path(model) if by_layer else None
    with adapter.preserved(model), torch.no_grad():
        return _run(model, tokens.to(adapter._device(model)), found, path, by_layer)


def _run(
    model: Any, tokens: Tensor, found: Any, path: str | None, by_layer: dict[int, list[Any]]
) -> Tensor:
    with model.trace(tokens):
        for layer in sorted(by_layer):
            # path is a str whenever there are hooks (by_layer not empty)
            softmax = adapter.resolve(
                adapter.resolve(model, found.attention_paths[layer]), cast(str, path)
            )
            pattern = softmax.output
            for fn in by_layer[layer]:
                edited = fn(pattern, None)
                pattern = pattern if edited is None else edited
            softmax.output = pattern
        logits: Tensor = model.output.logits.save()
    return logits


def evaluate(
    model: Any,
    prompts: Sequence[Any],
    *,
    fwd_hooks: Sequence[tuple[str | Callable[[str], bool], Any]] = (),
    batch_size: int = 16,
    ks: Sequence[int] = (1, 2, 3),
    by_length: bool | None = None,
) -> Accuracy:
    """`ra_lens.tasks.evaluate` on an nnsight model (which calls this): the same batching
    (prompts of one token length per batch under end-aligned hooks), tokens and ranks."""
    from ra_lens.nnsight.route import to_batch, to_tokens
    from ra_lens.tasks.accuracy import Accuracy, answer_ranks

    prompts = list(prompts)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    token_of = {
        a: int(to_tokens(model, a, prepend_bos=False)[0]) for a in {p.answer for p in prompts}
    }
    answers = torch.tensor([token_of[p.answer] for p in prompts], dtype=torch.long)
    if by_length is None:
        by_length = any(getattr(fn, "aligned_to_end", False) for _, fn in fwd_hooks)
    lengths = [len(to_tokens(model, p.text)) for p in prompts]
    keys = sorted(set(lengths)) if by_length else [None]
    groups = [[i for i, n in enumerate(lengths) if key in (None, n)] for key in keys]
    ranks = torch.empty(len(prompts), dtype=torch.long)
    for group in groups:
        for start in range(0, len(group), batch_size):
            idx = group[start : start + batch_size]
            batch = to_batch(model, [prompts[i].text for i in idx])
            logits = run_with_pattern_hooks(model, batch.tokens, fwd_hooks)
            ranks[idx] = answer_ranks(logits, batch.lengths, answers[idx]).cpu()
    return Accuracy.from_ranks(ranks, ks)
