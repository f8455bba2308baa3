"""n-shot prompts in the paper's template, and the filters for "constant-length" subsets.

Q: {x1}\\nA: {y1}\\n\\nQ: {x2}\\nA: {y2}\\n\\nQ: {query}\\nA:        target " {answer}"
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.tasks._task import Pair, Task, load, normalise_pairs

DEMO_TEMPLATE = "Q: {x}\nA: {y}\n\n"
QUERY_TEMPLATE = "Q: {x}\nA:"


@dataclass(frozen=True)
class Prompt:
    """One ICL prompt. `answer` carries the leading space: the target is its first token.

    >>> prompt = build_prompts([("hot", "cold"), ("up", "down")], [("big", "small")], shots=1)[0]
    >>> prompt.text, prompt.answer, prompt.shots
    ('Q: hot\\nA: cold\\n\\nQ: big\\nA:', ' small', 1)
    """

    text: str
    answer: str
    query: str
    demos: tuple[Pair, ...] = ()

    @property
    def shots(self) -> int:
        return len(self.demos)


def format_prompt(demos: Sequence[Pair], query: str) -> str:
    """The prompt text for `demos` followed by the query (no answer, no trailing space).

    >>> format_prompt([("hot", "cold")], "up")
    'Q: hot\\nA: cold\\n\\nQ: up\\nA:'
    """
    demo_text = "".join(DEMO_TEMPLATE.format(x=x, y=y) for x, y in demos)
    return demo_text + QUERY_TEMPLATE.format(x=query)


def build_prompts(
    source: Task | Sequence[Pair],
    queries: Sequence[Pair] | None = None,
    *,
    shots: int = 0,
    demos_from: Sequence[Pair] | None = None,
    seed: int = 42,
    split_seed: int = 42,
) -> list[Prompt]:
    """One n-shot prompt per query pair, with demonstrations drawn at random (seeded).

    Args:
        source: a Task or a list of (x, y) pairs; supplies the defaults below.
        queries: the pairs to ask about. Default: the task's test split (`split_seed`), or all
            the pairs when `source` is a plain list.
        shots: demonstrations per prompt.
        demos_from: the pool of demonstrations. Default: the task's train split, or the pairs
            themselves for a plain list. A demo never has the query's input (so never the query
            pair itself), and the demos in one prompt are distinct.
        seed: seeds one `random.Random` that draws the demos for all prompts in order.
        split_seed: the seed of `Task.split` used for the defaults.

    Raises:
        ValueError: negative shots, or a pool with fewer than `shots` pairs besides the query.

    >>> pairs = [("hot", "cold"), ("up", "down"), ("big", "small")]
    >>> [(p.query, p.demos) for p in build_prompts(pairs, shots=1, seed=0)]  # never the query
    [('hot', (('big', 'small'),)), ('up', (('big', 'small'),)), ('big', (('hot', 'cold'),))]
    """
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if isinstance(source, Task):
        if queries is None or demos_from is None:
            splits = source.split(split_seed)
            queries = splits.test if queries is None else queries
            demos_from = splits.train if demos_from is None else demos_from
        label = f"task {source.name!r}"
    else:
        pairs = normalise_pairs(source)
        queries = pairs if queries is None else queries
        demos_from = pairs if demos_from is None else demos_from
        label = "pairs"
    queries = normalise_pairs(queries, what="queries")
    pool = normalise_pairs(demos_from, what="demos_from")
    rng = random.Random(seed)
    prompts = []
    for x, y in queries:
        candidates = [pair for pair in pool if pair[0] != x]
        if len(candidates) < shots:
            raise ValueError(
                f"{label}: {shots}-shot prompt for query {x!r} needs {shots} demonstrations but "
                f"the pool has only {len(candidates)} pairs besides the query"
            )
        demos = tuple(rng.sample(candidates, shots))
        prompts.append(Prompt(text=format_prompt(demos, x), answer=" " + y, query=x, demos=demos))
    return prompts


def answer_token(model: HookedModel, answer: str) -> int:
    """Id of the first token of `answer` (tokenised on its own, no BOS).

    >>> answer_token(model, " the") == model.to_tokens(" the", prepend_bos=False)[0, 0]
    tensor(True)
    """
    return int(model.to_tokens(answer, prepend_bos=False)[0, 0])


def _check_model(model: Validated[HookedModel], call: str) -> None:
    """Model first: the old (prompts, model) order gets a clear error, not an AttributeError."""
    if not isinstance(model, HookedModel):
        raise TypeError(
            f"{call}: the first argument must be the TransformerLens model, got "
            f"{type(model).__name__}: pass the model first, e.g. {call.split('(')[0]}(model, ...)"
        )


def single_token_pairs(model: Validated[HookedModel], pairs: Task | Sequence[Pair]) -> list[Pair]:
    """Keep the pairs whose answer `" " + y` is exactly one token for `model`'s tokenizer.

    >>> single_token_pairs(model, [("b", "of"), ("c", "Florence and Paris")])  # tiny tokenizer
    [('b', 'of')]
    """
    _check_model(model, "single_token_pairs(model, pairs)")
    # a Task holds its pairs as tuple[Pair, ...] (its __post_init__ stores them so)
    pairs = (
        cast("tuple[Pair, ...]", pairs.pairs) if isinstance(pairs, Task) else normalise_pairs(pairs)
    )
    return [(x, y) for x, y in pairs if model.to_tokens(" " + y, prepend_bos=False).shape[1] == 1]


def prompt_lengths(model: Validated[HookedModel], prompts: Sequence[Prompt]) -> list[int]:
    """Token length of each prompt text as the model sees it (`model.to_tokens`, with BOS).

    >>> prompt_lengths(model, build_prompts([("b", "of"), ("quick", "fox")], shots=0))
    [7, 12]
    """
    _check_model(model, "prompt_lengths(model, prompts)")
    return [int(model.to_tokens(p.text).shape[1]) for p in prompts]


def same_length(
    model: Validated[HookedModel], prompts: Sequence[Prompt], *, length: int | None = None
) -> list[Prompt]:
    """The prompts whose token length is `length`; default: the most common length.

    Ties between equally common lengths go to the shorter length. Order is kept. This is the
    paper's "constant-length" subset, needed to average RA maps position by position.

    >>> prompts = build_prompts([("b", "of"), ("c", "is"), ("quick", "fox")], shots=0)
    >>> prompt_lengths(model, prompts), [p.query for p in same_length(model, prompts)]
    ([7, 7, 12], ['b', 'c'])
    """
    _check_model(model, "same_length(model, prompts)")
    prompts = list(prompts)
    if not prompts:
        return []
    lengths = prompt_lengths(model, prompts)
    if length is None:
        counts = Counter(lengths)
        length = min(counts, key=lambda n: (-counts[n], n))
    return [p for p, n in zip(prompts, lengths, strict=True) if n == length]


def task_prompts(
    model: HookedModel,
    task: str | Task,
    shots: int,
    *,
    seed: int = 42,
    equal_length: bool = True,
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, test) prompts whose answers are one token for this model (the paper's filter).

    Train prompts keep only the most common token length (`same_length`), so their maps can be
    averaged position by position; test prompts keep every length. Demonstrations come from
    the usable train pairs; the split is `task.split(seed)`.

    Args:
        equal_length: False keeps the train prompts of every length (e.g. for the held-out
            means of mean ablation).

    Raises:
        ValueError: too few train or test pairs have a one-token answer for this tokenizer.

    >>> toy = Task("toy", [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"),
    ...                    ("s", "the"), ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "b")])
    >>> train, test = task_prompts(model, toy, shots=1)
    >>> len(train), len(test), len(set(prompt_lengths(model, train)))
    (7, 2, 1)
    >>> print(test[0].text + test[0].answer)
    Q: F
    A: Par
    <BLANKLINE>
    Q: o
    A: and
    """
    task = load(task) if isinstance(task, str) else task
    splits = task.split(seed)
    usable = set(single_token_pairs(model, task))
    train_pairs = [p for p in splits.train if p in usable]
    test_pairs = [p for p in splits.test if p in usable]
    if len(train_pairs) < max(shots + 1, 2) or not test_pairs:
        raise ValueError(
            f"task {task.name!r} has {len(train_pairs)} train and {len(test_pairs)} test pairs whose "
            "answer is one token for this tokenizer: too few for the experiment"
        )
    train = build_prompts(task, train_pairs, shots=shots, demos_from=train_pairs, seed=seed)
    test = build_prompts(task, test_pairs, shots=shots, demos_from=train_pairs, seed=seed + 1)
    return same_length(model, train) if equal_length else train, test


def shuffled_label_prompts(prompts: Sequence[Prompt], *, seed: int = 0) -> list[Prompt]:
    """The same prompts with their demonstrations' labels shuffled (Todd et al.'s corruption).

    With two or more demonstrations, the labels of each prompt are permuted so that none stays
    with its own input (a random cycle); with one, each prompt takes the label of the next
    prompt's demonstration whose label differs. The query and the answer are unchanged.

    Raises:
        ValueError: zero-shot prompts (nothing to shuffle) or prompts without demonstrations.

    >>> pairs = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow")]
    >>> clean = build_prompts(pairs, pairs[:1], shots=3, demos_from=pairs, seed=0)
    >>> clean[0].demos
    (('big', 'small'), ('fast', 'slow'), ('up', 'down'))
    >>> shuffled = shuffled_label_prompts(clean)
    >>> shuffled[0].demos, shuffled[0].answer
    ((('big', 'down'), ('fast', 'small'), ('up', 'slow')), ' cold')
    """
    prompts = list(prompts)
    if not prompts or any(p.shots == 0 for p in prompts):
        raise ValueError(
            "shuffled-label corruption needs demonstrations in every prompt (shots >= 1)"
        )
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts):
        xs = [x for x, _ in prompt.demos]
        ys = [y for _, y in prompt.demos]
        if len(ys) >= 2:
            cycle = list(range(len(ys)))
            rng.shuffle(cycle)
            new = list(ys)
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
                new[a] = ys[b]
        else:
            others = [
                q.demos[0][1]
                for q in prompts[i + 1 :] + prompts[:i]
                if q.demos and q.demos[0][1] != ys[0]
            ]
            new = [others[0] if others else ys[0]]
        demos = tuple(zip(xs, new, strict=True))
        out.append(replace(prompt, text=format_prompt(demos, prompt.query), demos=demos))
    return out


def shuffled_label_pairs(
    model: Validated[HookedModel], prompts: Sequence[Prompt], *, seed: int = 0
) -> list[tuple[Prompt, Prompt]]:
    """(clean, corrupted) pairs for activation/attribution patching: each prompt with its
    shuffled-label twin (`shuffled_label_prompts(prompts, seed=seed)`), kept where the twin has
    the same token length (patching compares the two runs position by position). Order is kept.

    Raises:
        ValueError: no prompt keeps its token length once its labels are shuffled.

    >>> pairs = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow")]
    >>> prompts = build_prompts(pairs, shots=2, demos_from=pairs, seed=0)
    >>> kept = shuffled_label_pairs(model, prompts)
    >>> all(len(model.to_tokens(c.text)[0]) == len(model.to_tokens(d.text)[0]) for c, d in kept)
    True
    >>> all(c.answer == d.answer and c.query == d.query for c, d in kept)
    True
    """
    _check_model(model, "shuffled_label_pairs(model, prompts)")
    prompts = list(prompts)
    corrupted = shuffled_label_prompts(prompts, seed=seed)
    lengths = prompt_lengths(model, prompts)
    kept = [
        (clean, other)
        for clean, other, n, m in zip(
            prompts, corrupted, lengths, prompt_lengths(model, corrupted), strict=True
        )
        if n == m
    ]
    if not kept:
        raise ValueError(
            "no prompt keeps its token length once its labels are shuffled: activation and "
            "attribution patching need clean/corrupted pairs of equal length (try another seed "
            "or more prompts)"
        )
    return kept
