"""Head rankings: which heads matter for a prediction, scored by RA and by the usual baselines.

Every ranking is a score per head, Float[Tensor, "layer head"] (the shape of
`transformer_lens.patching`'s head outputs), on the CPU in float32; larger = more important.
Every ranking that runs the model has one signature, `(model, prompts, targets, *, batch_size,
progress, per_prompt)` (clean/corrupted rankings: `(model, clean, corrupted, targets, ...)`), and
runs in one loop, `engine.rank`: batching, target checks, eval mode with the model's state
restored, a progress bar, the mean over prompts or each prompt's scores.

- `gradient`: `ra_ranking` (RA's Frobenius norm; `loss_row=True`: its row at the loss position),
  `temperature_ranking` (|dL/d a head's inverse temperature| = |sum RA * QK^T|),
  `first_order_mediation`, `attribution_patching`, `exact_qk_attribution`: one forward + backward.
- `causal`: `causal_mediation` (ablate one head), `indirect_effect` (Todd et al.),
  `activation_patching` (TransformerLens's): one forward pass per head.
- `baselines`: `forward_ranking`, `random_ranking` (seeded), `layer_ranking`.
- `ablation`: `ablation_curve` keeps the top (or bottom) fraction of heads, ablates the rest
  (`patching.ablation_hooks`: zero, or mean with `last_token_means`) and records the task's
  top-k accuracy; `auc_interval`, `paired_auc_difference`.
- `statistics`: `spearman`, `pearson`, `top_k_overlap`, `top_recall`, `spearman_interval`,
  `bootstrap_mean`, `trapezoid_auc`.

    >>> scores = ra_ranking(model, prompts, targets)                      # doctest: +SKIP
    >>> curve = ablation_curve(model, test_prompts, scores)                # doctest: +SKIP
    >>> curve.auc, curve.top1                                              # doctest: +SKIP
"""

# `X as X`: importable from here as before (the experiments and tests use them), but not in
# __all__, the public list.
# The one area under a curve lives with the pure functions; it stays importable from here.
from ra_lens.math import trapezoid_auc  # noqa: E402
from ra_lens.patching import HeadMeans as HeadMeans
from ra_lens.patching import ablation_hooks, last_token_means
from ra_lens.ranking.ablation import (
    DEFAULT_FRACTIONS,
    DENSE_FRACTIONS,
    AblationCurve,
    AblationEvaluator,
    ablation_curve,
    auc_interval,
    evaluate_ablated,
    kept_heads,
    paired_auc_difference,
    per_prompt_auc,
)
from ra_lens.ranking.ablation import check_fractions as check_fractions
from ra_lens.ranking.baselines import forward_ranking, layer_ranking, random_ranking
from ra_lens.ranking.causal import activation_patching, causal_mediation, indirect_effect
from ra_lens.ranking.engine import PerPrompt as PerPrompt
from ra_lens.ranking.engine import check_scores as check_scores
from ra_lens.ranking.engine import head_order
from ra_lens.ranking.engine import rank as rank
from ra_lens.ranking.engine import target_probs as target_probs
from ra_lens.ranking.gradient import (
    attribution_patching,
    exact_qk_attribution,
    first_order_mediation,
    ra_ranking,
    temperature_ranking,
    temperature_scores,
)
from ra_lens.ranking.statistics import (
    Interval,
    bootstrap_mean,
    pearson,
    spearman,
    spearman_interval,
    top_k_overlap,
    top_recall,
)
from ra_lens.ranking.statistics import bootstrap_indices as bootstrap_indices

__all__ = [
    "DEFAULT_FRACTIONS",
    "DENSE_FRACTIONS",
    "AblationCurve",
    "AblationEvaluator",
    "Interval",
    "ablation_curve",
    "ablation_hooks",
    "activation_patching",
    "attribution_patching",
    "auc_interval",
    "bootstrap_mean",
    "causal_mediation",
    "evaluate_ablated",
    "exact_qk_attribution",
    "first_order_mediation",
    "forward_ranking",
    "head_order",
    "indirect_effect",
    "kept_heads",
    "last_token_means",
    "layer_ranking",
    "paired_auc_difference",
    "pearson",
    "per_prompt_auc",
    "ra_ranking",
    "random_ranking",
    "spearman",
    "spearman_interval",
    "temperature_ranking",
    "temperature_scores",
    "top_k_overlap",
    "top_recall",
    "trapezoid_auc",
]
