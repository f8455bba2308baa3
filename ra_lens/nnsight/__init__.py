"""nnsight models in ra-lens: Reversed Attention, attention patching and RA ranking on an
`nnsight.TransformersModel` wrapping a HuggingFace causal LM with eager attention.

`ra_lens.reversed_attention`, `ra_lens.ranking.ra_ranking` and `ra_lens.tasks.evaluate` (with
`attention_patch_hooks`) dispatch here for nnsight models; `adapter` finds what RA needs in the
HuggingFace modules, `_trace` holds the trace itself (torch only, so it can run on a server
without ra-lens), `patch` applies TransformerLens-style pattern hooks inside an nnsight trace.
"""

from ra_lens.nnsight.adapter import is_nnsight_model
from ra_lens.nnsight.patch import run_with_pattern_hooks
from ra_lens.nnsight.route import reversed_attention

__all__ = ["is_nnsight_model", "reversed_attention", "run_with_pattern_hooks"]
