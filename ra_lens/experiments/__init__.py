"""The paper's experiments, end to end: attention patching on ICL tasks, head ranking.

The modules are named for what they run (`attention_patching`, `head_ranking`); the package
re-exports their entry points under the same names, so `ra_lens.experiments.head_ranking` is the
function (import the module's other names with `from ra_lens.experiments.head_ranking import
RANKINGS`). The task helpers live in `ra_lens.tasks` and are re-exported here.
"""

from ra_lens.experiments.attention_patching import (
    DEFAULT_SCALES,
    PAPER_SCALES,
    PatchingResult,
    attention_patching,
)
from ra_lens.experiments.head_ranking import HeadRankingResult, head_ranking
from ra_lens.tasks import shuffled_label_prompts, task_prompts

__all__ = [
    "DEFAULT_SCALES",
    "PAPER_SCALES",
    "HeadRankingResult",
    "PatchingResult",
    "attention_patching",
    "head_ranking",
    "shuffled_label_prompts",
    "task_prompts",
]
