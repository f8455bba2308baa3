"""`discover`: ra-lens's default circuit discovery, the recipe that measured best on held-out
pairs in MIB's units (docs/results/circuit-study.md): a learned edge mask (`learn_mask`, the
"scaled" rule, 10 steps) warm-started from `attribute`'s default (eap-ig, 5 steps).

`attribute` stays what it is, a one-pass-family attribution (its default equal to EAP-IG-inputs
edge by edge); `discover` trains on the pairs it is given, so judge its circuits on other pairs.
"""

from __future__ import annotations

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.circuits.masks import learn_mask
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import MetricFn, Tokens


def discover(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    steps: int = 10,
    budget_s: float | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> EdgeScores:
    """Edge scores for MIB's nested circuits from training pairs: `learn_mask(..., rule="scaled")`
    from eap-ig's scores (module docstring).

    On held-out pairs (SmolLM2 IOI, Gemma-3-270M IOI; 16 training, 32 held-out pairs, patching)
    its circuits' CPR was 3.1x and 3.3x eap-ig's with CMD no larger, at about 5.6x eap-ig's CPU
    seconds (README).

    Args:
        model, clean, corrupted, metric: as `attribute` takes them (>= 2 pairs).
        steps: training steps of the mask (one forward+backward pass per batch each).
        budget_s: stop training after this many process CPU seconds (warm start included).
        batch_size: pairs per pass.
        progress: show a progress bar.

    Returns:
        EdgeScores (method "mask", MIB's sign): `top(n)` / `greedy(n)`, `export_mib` and
        `faithfulness_curve` take it like `attribute`'s.

    Raises:
        ValueError: as `learn_mask` (too few pairs, a zero budget, a mask that collapsed).
    """
    return learn_mask(
        model, clean, corrupted, metric, steps=steps, rule="scaled", budget_s=budget_s,
        batch_size=batch_size, progress=progress,
    ).scores  # fmt: skip
