"""The circuit study's prompt pairs: IOI, country-capital, antonyms (a fixed 3-shot context, the
query swapped), and --quick's toy pairs for the tiny tokenizer; each task's pairs are usable by
the model (answers one token, clean and corrupted of equal length)."""

from __future__ import annotations

import random
from typing import cast

from ra_lens.tasks import format_prompt, ioi, load
from ra_lens.tasks.ioi import PromptPair
from ra_lens.types import HookedModel

TASKS: tuple[str, ...] = ("ioi", "country-capital", "antonym")
#: Antonym pairs: one fixed 3-shot context, the query swapped between clean and corrupted.
ANTONYM_SHOTS = 3
#: --quick's words: one token each for the tiny tokenizer.
QUICK_WORDS = ("b", "c", "d", "l", "o", "s", "t", "F", "I")


def antonym_pairs(model: HookedModel, n: int, *, seed: int = 0) -> list[PromptPair]:
    """Antonym prompts with one fixed 3-shot context; the corrupted prompt asks about another word
    whose prompt has the same token length, and whose (one-token) antonym is the wrong answer."""
    rows = list(cast("tuple[tuple[str, str], ...]", load("antonym").pairs))  # a Task's pairs
    random.Random(seed).shuffle(rows)
    demos, rest = rows[:ANTONYM_SHOTS], rows[ANTONYM_SHOTS:]

    def one_token(text: str) -> bool:
        return model.to_tokens(text, prepend_bos=False).shape[1] == 1

    by_length: dict[int, list[tuple[str, str]]] = {}
    for x, y in rest:
        if one_token(f" {y}"):
            length = int(model.to_tokens(format_prompt(demos, x)).shape[1])
            by_length.setdefault(length, []).append((x, y))
    pairs = []
    for group in by_length.values():
        for (x, y), (x2, y2) in zip(group, group[1:] + group[:1]):
            if y != y2 and x != x2:
                clean, corrupted = format_prompt(demos, x), format_prompt(demos, x2)
                pairs.append(PromptPair(clean, corrupted, f" {y}", f" {y2}", task="antonym"))
    return pairs[:n]


def toy_pairs(model: HookedModel, n: int) -> list[PromptPair]:
    """--quick's pairs for the tiny tokenizer: "I like {x} and" against another word."""
    pairs = [
        PromptPair(f"I like {x} and", f"I like {y} and", " the", " of", task="toy")
        for x, y in zip(QUICK_WORDS, QUICK_WORDS[1:] + QUICK_WORDS[:1])
    ]
    return ioi.usable(model, pairs)[:n]


def task_pairs(model: HookedModel, task: str, n: int, seed: int = 0) -> list[PromptPair]:
    """Up to n usable pairs of a task (fewer where the tokenizer leaves fewer); `seed` draws
    other IOI pairs (the other tasks' pairs come from fixed lists)."""
    if seed and task != "ioi":
        raise ValueError(f"pair seed {seed} for task {task!r}: only ioi's pairs are drawn at random (country-capital and antonym come from fixed lists); leave the seed 0 for them")  # fmt: skip
    if task == "ioi":
        return ioi.usable(model, ioi.ioi_pairs(4 * n, seed=seed))[:n]
    if task == "country-capital":
        return ioi.capital_pairs(model, n)
    if task == "antonym":
        return antonym_pairs(model, n)
    if task == "toy":
        return toy_pairs(model, n)
    raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
