"""The paper's experiments, end to end: attention patching on ICL tasks, head ranking."""

from ra_lens.experiments.patching import (
    DEFAULT_SCALES,
    PAPER_SCALES,
    PatchingResult,
    attention_patching,
    evaluate_by_length,
    task_prompts,
)
from ra_lens.experiments.ranking import HeadRankingResult, head_ranking, shuffled_label_prompts

__all__ = [
    "DEFAULT_SCALES",
    "PAPER_SCALES",
    "HeadRankingResult",
    "PatchingResult",
    "attention_patching",
    "evaluate_by_length",
    "head_ranking",
    "shuffled_label_prompts",
    "task_prompts",
]
