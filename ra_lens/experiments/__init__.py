"""The paper's experiments, end to end: attention patching on ICL tasks, head ranking."""

from ra_lens.experiments.patching import (
    DEFAULT_SCALES,
    PAPER_SCALES,
    PatchingResult,
    attention_patching,
)
from ra_lens.experiments.ranking import HeadRankingResult, head_ranking

__all__ = [
    "DEFAULT_SCALES",
    "PAPER_SCALES",
    "HeadRankingResult",
    "PatchingResult",
    "attention_patching",
    "head_ranking",
]
