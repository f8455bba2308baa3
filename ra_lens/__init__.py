"""ra-lens: Reversed Attention (the backward pass of attention) for TransformerLens models.

    >>> import ra_lens
    >>> model = ra_lens.load_model()                                   # doctest: +SKIP
    >>> ra = ra_lens.reversed_attention(model, prompt, ra_lens.metrics.target_nll([t]))  # doctest: +SKIP
"""

from ra_lens import metrics
from ra_lens.capture import Batch, to_batch
from ra_lens.core import reversed_attention
from ra_lens.result import ReversedAttention

__all__ = ["Batch", "ReversedAttention", "metrics", "reversed_attention", "to_batch"]
__version__ = "0.1.0"
