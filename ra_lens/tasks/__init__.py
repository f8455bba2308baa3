"""In-context-learning word-pair tasks (Todd et al. style), n-shot prompts and top-k accuracy.

>>> from ra_lens import tasks
>>> task = tasks.load("antonym")
>>> splits = task.split(seed=42)                    # 70% train / 21% test / 9% valid
>>> prompts = tasks.build_prompts(task, splits.test, shots=5, demos_from=splits.train)
>>> prompts[0].text.endswith("\\nA:"), prompts[0].answer.startswith(" ")
(True, True)
>>> acc = tasks.evaluate(model, tasks.build_prompts(task, shots=0)[:8])  # any TL model
>>> acc.n, 0 <= acc.top1 <= acc.top3 <= 1
(8, True)
"""

from ra_lens.tasks._task import SPLIT_FRACTIONS, Pair, Splits, Task, available, load
from ra_lens.tasks.accuracy import Accuracy, answer_ranks, evaluate
from ra_lens.tasks.prompts import (
    DEMO_TEMPLATE,
    QUERY_TEMPLATE,
    Prompt,
    answer_token,
    build_prompts,
    format_prompt,
    prompt_lengths,
    same_length,
    shuffled_label_pairs,
    shuffled_label_prompts,
    single_token_pairs,
    task_prompts,
)

__all__ = [
    "DEMO_TEMPLATE",
    "QUERY_TEMPLATE",
    "SPLIT_FRACTIONS",
    "Accuracy",
    "Pair",
    "Prompt",
    "Splits",
    "Task",
    "answer_ranks",
    "answer_token",
    "available",
    "build_prompts",
    "evaluate",
    "format_prompt",
    "load",
    "prompt_lengths",
    "same_length",
    "shuffled_label_pairs",
    "shuffled_label_prompts",
    "single_token_pairs",
    "task_prompts",
]
