"""The rankings the head-ranking experiment knows: a registry, `RANKINGS` (name -> `RankingSpec`),
in the order `head_ranking` computes them. Each spec names a `ra_lens.ranking` function, what it
reads (`Inputs`: the ranking prompts, their shuffled-label twins, equal-length pairs, the model's
shape, a seed) and how it is called; `register` adds one and refuses a name already there,
`check_rankings` checks names against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from ra_lens import capture
from ra_lens import ranking as rk
from ra_lens.capture import HookedModel
from ra_lens.patching import HeadMeans


@dataclass
class RankingInputs:
    """What a ranking may read: the ranking prompts, their shuffled-label twins, the means of
    the ablation protocol (None = zero ablation) and run settings."""

    model: HookedModel
    texts: list[str]
    targets: list[int]
    seed: int
    batch_size: int
    progress: bool
    means: HeadMeans | None = None
    #: (clean, corrupted, targets) for the prompts whose shuffled twin has the same token length.
    pairs: tuple[list[str], list[str], list[int]] | None = None
    #: every ranking prompt's shuffled-label twin (any length), for the indirect effect.
    shuffled: list[str] | None = None


#: What a ranking reads: the ranking prompts; them and their shuffled-label twins; the clean /
#: shuffled pairs of equal token length; the model's shape; the shape and the seed.
Inputs = Literal["prompts", "shuffled", "pairs", "shape", "seeded"]


@dataclass(frozen=True)
class RankingSpec:
    """One ranking in the registry: a library function and how head_ranking calls it.

    Attributes:
        name: the registry key.
        function: a `ra_lens.ranking` function. "prompts": `f(model, texts, targets, *,
            batch_size, progress, per_prompt, **options)`; "shuffled" and "pairs":
            `f(model, clean, corrupted, targets, ...)`; "shape": `f(n_layers, n_heads)`;
            "seeded": `f(n_layers, n_heads, seed)`.
        description: one line for tables and help.
        inputs: what it reads (see `Inputs`).
        options: fixed keyword arguments (e.g. loss_row=True).
        protocol: takes the ablation protocol's `means` (causal mediation ablates the way the
            curves do).
        per_prompt: asked for each prompt's scores, so that its Spearman interval resamples
            its prompts; False keeps the ranking fixed in the interval.
    """

    name: str
    function: Callable[..., Tensor]
    description: str
    inputs: Inputs = "prompts"
    options: Mapping[str, Any] = field(default_factory=dict)
    protocol: bool = False
    per_prompt: bool = True

    @property
    def needs_labels(self) -> bool:
        """Needs demonstrations to shuffle (skipped zero-shot)."""
        return self.inputs in ("shuffled", "pairs")

    @property
    def paired(self) -> bool:
        """Needs clean/shuffled-label prompt pairs of equal token length."""
        return self.inputs == "pairs"

    def compute(self, inputs: RankingInputs) -> Tensor:
        """Float[Tensor, "batch layer head"] (per prompt) or Float[Tensor, "layer head"]."""
        if self.inputs in ("shape", "seeded"):
            shape = capture.model_shape(inputs.model)
            seed = (inputs.seed,) if self.inputs == "seeded" else ()
            return self.function(shape.n_layers, shape.n_heads, *seed, **self.options)
        if self.inputs == "prompts":
            data: tuple[Any, ...] = (inputs.texts, inputs.targets)
        elif self.inputs == "shuffled":
            data = (inputs.texts, inputs.shuffled, inputs.targets)
        else:
            assert inputs.pairs is not None, "a paired ranking ran without shuffled-label pairs"
            data = inputs.pairs
        options = dict(self.options, means=inputs.means) if self.protocol else self.options
        return self.function(
            inputs.model,
            *data,
            batch_size=inputs.batch_size,
            progress=inputs.progress,
            per_prompt=self.per_prompt,
            **options,
        )


def register(registry: dict[str, RankingSpec], spec: RankingSpec) -> None:
    """Add a ranking to a registry; a name already there is refused.

    >>> registry = {}
    >>> register(registry, RankingSpec("layer", rk.layer_ranking, "layer index", "shape"))
    >>> register(registry, RankingSpec("layer", rk.layer_ranking, "again", "shape"))
    Traceback (most recent call last):
    ValueError: a ranking named 'layer' is already registered: choose another name
    """
    if spec.name in registry:
        raise ValueError(
            f"a ranking named {spec.name!r} is already registered: choose another name"
        )
    registry[spec.name] = spec


#: Every ranking head_ranking knows, in the order it computes them ("ra" is the reference).
RANKINGS: dict[str, RankingSpec] = {}
for _spec in (
    RankingSpec("ra", rk.ra_ranking, "RA, mean Frobenius norm"),
    RankingSpec("ra_loss_row", rk.ra_ranking, "RA, loss row only", options={"loss_row": True}),
    RankingSpec("ra_temperature", rk.temperature_ranking, "RA x QK^T (|dL/d inverse temperature|)"),
    RankingSpec("forward", rk.forward_ranking, "forward-pattern norm"),
    RankingSpec("random", rk.random_ranking, "random (seeded)", "seeded"),
    RankingSpec("layer", rk.layer_ranking, "layer index", "shape"),
    RankingSpec(
        "causal_mediation",
        rk.causal_mediation,
        "causal mediation (ablate one head, p drop)",
        protocol=True,
    ),
    RankingSpec(
        "cm_first_order",
        rk.first_order_mediation,
        "causal mediation, first order (grad x (z - ablated))",
        protocol=True,
    ),
    RankingSpec("indirect_effect", rk.indirect_effect, "indirect effect (Todd et al.)", "shuffled"),
    # The two below stay fixed in their Spearman intervals, as in the published study.
    RankingSpec(
        "activation_patching",
        rk.activation_patching,
        "activation patching (transformer_lens.patching)",
        "pairs",
        per_prompt=False,
    ),
    RankingSpec("attribution_patching", rk.attribution_patching, "attribution patching", "pairs"),
    RankingSpec(
        "exact_qk_attribution",
        rk.exact_qk_attribution,
        "exact query/key attribution (AtP* QK fix)",
        "pairs",
        per_prompt=False,
    ),
):
    register(RANKINGS, _spec)
#: Rankings that need clean/corrupted prompt pairs of equal token length.
PAIRED: frozenset[str] = frozenset(name for name, spec in RANKINGS.items() if spec.paired)


def check_rankings(names: Sequence[str]) -> list[str]:
    """Known ranking names, de-duplicated in RANKINGS order, always with "ra"; or a ValueError
    listing the names the registry knows.

    >>> check_rankings(["forward", "random", "forward"])  # RANKINGS order, with "ra"
    ['ra', 'forward', 'random']
    >>> check_rankings(["nope"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown ranking 'nope': choose from ra, ra_loss_row, ...
    """
    unknown = [n for n in names if n not in RANKINGS]
    if unknown:
        raise ValueError(f"unknown ranking {unknown[0]!r}: choose from {', '.join(RANKINGS)}")
    chosen = set(names) | {"ra"}
    return [n for n in RANKINGS if n in chosen]
