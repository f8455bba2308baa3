"""The type aliases every module's signatures share: what prompts, metrics, hooks, targets and
head scores look like. Import them from here; do not redefine them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import Batch, HookedModel

#: Prompts: token ids, a padded Batch, one string or a list of strings.
Tokens = Validated[Int[Tensor, "batch pos"] | Batch | str | Sequence[str]]
#: A metric: `metric(logits)` or `metric(logits, batch)` -> a scalar or one value per prompt.
MetricFn = Callable[..., Tensor]
#: A TransformerLens forward hook: (hook point name, function(value, hook)).
Hook = tuple[str, Callable[..., Any]]
#: One target token id per prompt.
Targets = Validated[Int[Tensor, "batch"] | Sequence[int]]
#: One score per attention head, TransformerLens's [n_layers, n_heads] layout.
Scores = Float[Tensor, "layer head"]

__all__ = ["HookedModel", "Hook", "MetricFn", "Scores", "Targets", "Tokens"]
