"""ra-lens: Reversed Attention (the backward pass of attention) for TransformerLens models.

    >>> import ra_lens
    >>> model = ra_lens.load_model()                                   # doctest: +SKIP
    >>> target = model.to_single_token(" Florence")                    # doctest: +SKIP
    >>> ra = ra_lens.reversed_attention(model, prompt, ra_lens.metrics.target_nll([target]))  # doctest: +SKIP
    >>> ra.top_heads(3)                                                # doctest: +SKIP
    >>> with model.hooks(fwd_hooks=ra_lens.attention_patch_hooks(ra, -16.0)):  # doctest: +SKIP
    ...     logits = model(tokens)

Plots live in `ra_lens.viz`, the paper's experiments in `ra_lens.experiments` (imported on use, so
that `import ra_lens` does not pull in matplotlib).
"""

from ra_lens import metrics, tasks
from ra_lens._version import __version__ as __version__
from ra_lens.attribution import AttentionAttribution, attention_attribution
from ra_lens.capture import Batch, to_batch
from ra_lens.core import reversed_attention
from ra_lens.dynamics import EditDynamics, edit_dynamics
from ra_lens.liveness import live_attention
from ra_lens.models import load_model
from ra_lens.patching import attention_patch_hooks, forward_patch_hooks, head_ablation_hooks
from ra_lens.result import ReversedAttention

__all__ = [
    "AttentionAttribution",
    "Batch",
    "EditDynamics",
    "ReversedAttention",
    "attention_attribution",
    "attention_patch_hooks",
    "edit_dynamics",
    "forward_patch_hooks",
    "head_ablation_hooks",
    "live_attention",
    "load_model",
    "metrics",
    "reversed_attention",
    "tasks",
    "to_batch",
]
