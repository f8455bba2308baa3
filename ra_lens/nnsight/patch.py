"""TransformerLens-style `hook_pattern` hooks (`attention_patch_hooks`, `forward_patch_hooks`)
applied inside an nnsight trace: each hook edits the output of its layer's softmax call, before
the pattern meets the values, exactly where TransformerLens's `hook_pattern` sits."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ra_lens.nnsight import adapter
from ra_lens.nnsight.adapter import NnsightModel

_PATTERN = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")


def run_with_pattern_hooks(
    model: NnsightModel,
    tokens: Tensor,
    fwd_hooks: Sequence[tuple[str | Callable[[str], bool], Any]],
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
        return _run(model, tokens.to(adapter.input_device(model)), found, path, by_layer)


def _run(
    model: NnsightModel,
    tokens: Tensor,
    found: Any,
    path: str | None,
    by_layer: dict[int, list[Any]],
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
        logits: Tensor = cast(Any, model).output.logits.save()  # a proxy inside the trace
    return logits
