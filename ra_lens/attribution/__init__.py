"""Query, key and pattern attribution of every attention head, with an exact softmax.

Attribution patching estimates what patching one node from another run would do to a metric M.
For the attention pattern itself that estimate is sum_s R_ts (A_other - A)_ts with R = dM/dA (the
gradient at `hook_pattern`). For the query and key of a head, tools linear through the softmax
(TransformerLens 4's `attribution_patch`, EAP) multiply R by the *first-order* change of A; on a
saturated (near one-hot) row that change is almost zero even when the real one is large. AtP*
(Kramar et al. 2024) fixes it by recomputing the changed attention rows exactly, then
multiplying by R. This module does that for every head and position at once, from one forward
and backward pass on the run that gets patched plus one forward pass on the other run:

- query node (layer, head h, position t): row t becomes softmax(q'_t K^T / s + mask), with q'_t
  taken from the other run;
- key node (layer, key/value head g, position s): in every query head reading g (GQA: heads
  g*r .. g*r + r - 1, r = n_heads / n_kv_heads), every row t >= s changes in the single logit
  (t, s) by delta = q_t . (k'_s - k_s) / s. Closed form: the new weight on s is
  p' = sigmoid(logit(A_ts) + delta) and the row's estimate is (p' - A_ts) (R_ts - Rbar_t^(-s)),
  Rbar^(-s) the mean of R over the other keys weighted by A (computed in log space, so a
  saturated row and a large delta stay exact);
- pattern node (layer, head h, query row t): sum_s R_ts (A_other - A)_ts; `edges` keeps the
  per-link terms.

`method="linear"` gives the first-order estimate through the softmax instead (what linear tools
compute; it equals dM/dq . (q' - q) and dM/dk . (k' - k)). `method="exact-ig"` averages the exact
estimate over `steps` runs whose embeddings lie on the straight line from the other run's to
the patched run's (point k = other + (k / steps)(patched - other), k = 1..steps, as EAP-IG
"inputs"): at each point the node is moved by the same difference (q' - q, k' - k, A' - A) and
the rows are recomputed with that point's q, k, A and R, so the nonlinearity after the node (the
metric's, later layers') is averaged along the path as integrated gradients do; steps=1 is
"exact".

A query (key) node is the query (key) the softmax reads: on rotary models the rotated q and k
(`hook_rot_q`, `hook_rot_k`), after any q/k norm. Where that norm is per head (Qwen3, Gemma-3)
this is the same as patching the head's `hook_q`; where it spans all heads (OLMo-2's q_norm over
the whole projection) it is not: there the node is the normalised query, and a patch of one
head's `hook_q` would also move the other heads' queries through the shared norm. The scale,
soft-cap (Gemma-2: S = c tanh(q k^T / (s c))) and sliding window are read from the model
(`capture.attention_facts`), so the recomputed rows are the model's own.

In the examples, `model` is a tiny random 2-layer x 4-head model (`ra_lens.toy_models.tiny_model`):

    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"  # 8 tokens each
    >>> att = attention_attribution(model, clean, corrupted, logit_diff([294], [52]))
    >>> {kind: tuple(scores.shape) for kind, scores in att.scores.items()}  # [layer head]
    {'pattern': (2, 4), 'query': (2, 4), 'key': (2, 4)}
"""

from ra_lens.attribution.compute import attention_attribution
from ra_lens.attribution.result import AttentionAttribution
from ra_lens.attribution.softmax import (
    DIRECTIONS,
    METHODS,
    NODES,
    Direction,
    Method,
    NodeKind,
    key_delta_rows,
    key_terms,
    log_other_mass,
)

__all__ = [
    "DIRECTIONS",
    "METHODS",
    "NODES",
    "AttentionAttribution",
    "Direction",
    "Method",
    "NodeKind",
    "attention_attribution",
    "key_delta_rows",
    "key_terms",
    "log_other_mass",
]
