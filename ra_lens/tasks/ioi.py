"""Paired prompts for circuit work: indirect-object identification and country-capital.

Every pair has a clean and a corrupted prompt of the same token length (patching is position by
position), the clean answer and a wrong answer; the usual metric is
`metrics.logit_diff(answer, wrong)`. Templates and names were written for this project.

- IOI (in the style of Wang et al. 2022): "When Mary and John went to the store, John gave a drink
  to" -> " Mary" (the indirect object), wrong " John" (the subject). Corrupted ("ABC"): the two
  names of the first clause replaced by two other names, so nothing says who the indirect
  object is.
- country-capital: "The capital of France is the city of" -> " Paris"; corrupted with another
  country, whose capital is the wrong answer.

    >>> pairs = ioi_pairs(40)
    >>> pairs[0].clean
    'When Mary and John went to the store, John gave a drink to'
    >>> clean, corrupted, metric = paired_batch(model, pairs)          # doctest: +SKIP
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ra_lens.capture import Batch, HookedModel, to_batch
from ra_lens.metrics import LogitDiff, logit_diff
from ra_lens.tasks._task import load

NAMES: tuple[str, ...] = (
    "Mary", "John", "Tom", "James", "Anna", "Lisa", "Sarah", "David", "Michael", "Emma", "Kate",
    "Paul", "Mark", "Peter", "Laura", "Alice", "Bob", "Jack", "Sam", "Ben", "Max", "Amy", "Rose",
    "Grace", "Alex", "Daniel", "Eric", "Adam", "Ryan", "Chris", "Jane", "Henry", "George",
    "Frank", "Steve", "Kevin", "Linda", "Karen", "Susan", "Helen", "Emily", "Julia", "Lucy",
)  # fmt: skip

#: {io} is the indirect object (the answer), {s} the subject, named twice.
IOI_TEMPLATES: tuple[str, ...] = (
    "When {io} and {s} went to the store, {s} gave a drink to",
    "When {io} and {s} got a snack at the cafe, {s} decided to give it to",
    "After {io} and {s} went to the park, {s} threw a ball to",
    "While {io} and {s} were working at the office, {s} handed a report to",
    "Then, {io} and {s} had a long talk. Afterwards {s} said goodbye to",
)

CAPITAL_TEMPLATE = "The capital of {country} is the city of"


@dataclass(frozen=True)
class PromptPair:
    """A clean prompt, its corrupted twin (same token length) and the two answers."""

    clean: str
    corrupted: str
    answer: str
    wrong: str
    task: str = ""


def ioi_pairs(n: int = 40, *, seed: int = 0, template: int | None = None) -> list[PromptPair]:
    """n IOI pairs, templates in turn (or only `template`), names drawn without repeats in a
    prompt. The first pair is always the Mary/John store example.

    >>> pair = ioi_pairs(2)[0]
    >>> print(pair.clean, pair.corrupted, sep="\\n")
    When Mary and John went to the store, John gave a drink to
    When Alice and Bob went to the store, John gave a drink to
    >>> pair.answer, pair.wrong
    (' Mary', ' John')
    """
    rng = random.Random(seed)
    templates = IOI_TEMPLATES if template is None else (IOI_TEMPLATES[template],)
    pairs = []
    for i in range(n):
        io, s, c, d = ("Mary", "John", "Alice", "Bob") if i == 0 else rng.sample(NAMES, 4)
        text = templates[i % len(templates)]
        pairs.append(
            PromptPair(
                clean=text.format(io=io, s=s),
                corrupted=_abc(text, io, s, c, d),
                answer=f" {io}",
                wrong=f" {s}",
                task="ioi",
            )
        )
    return pairs


def _abc(template: str, io: str, s: str, c: str, d: str) -> str:
    """The template with its first clause's names replaced by c and d; the second {s} stays."""
    first, _, rest = template.partition("{s}")
    return first.format(io=c) + d + rest.format(s=s)


def capital_pairs(
    model: HookedModel | None = None, n: int | None = None, *, seed: int = 0
) -> list[PromptPair]:
    """Country-capital pairs from the project's country-capital task, in a seeded shuffle.

    Each country is corrupted with the next country of the shuffle (whose capital is the wrong
    answer). Given a model, only countries whose capital is one token are kept, and each is
    paired with the next one whose prompt has the same token length.

    >>> pair = capital_pairs(n=1)[0]
    >>> pair.clean, pair.answer
    ('The capital of Mongolia is the city of', ' Ulaanbaatar')
    """
    rows = list(load("country-capital").pairs)
    random.Random(seed).shuffle(rows)
    groups: dict[int, list[tuple[str, str]]] = {}
    for country, capital in rows:
        length = 0
        if model is not None:
            if model.to_tokens(f" {capital}", prepend_bos=False).shape[1] != 1:
                continue
            length = int(model.to_tokens(CAPITAL_TEMPLATE.format(country=country)).shape[1])
        groups.setdefault(length, []).append((country, capital))
    pairs = []
    for group in groups.values():
        for (country, capital), (other, other_capital) in zip(group, group[1:] + group[:1]):
            if capital != other_capital:
                pairs.append(
                    PromptPair(
                        clean=CAPITAL_TEMPLATE.format(country=country),
                        corrupted=CAPITAL_TEMPLATE.format(country=other),
                        answer=f" {capital}",
                        wrong=f" {other_capital}",
                        task="country-capital",
                    )
                )
    return pairs if n is None else pairs[:n]


def usable(model: HookedModel, pairs: Sequence[PromptPair]) -> list[PromptPair]:
    """The pairs whose answers are one token each and whose prompts have equal token lengths
    under the model's tokenizer.

    >>> len(ioi_pairs(10)), len(usable(model, ioi_pairs(10)))  # the tiny tokenizer knows few names
    (10, 0)
    """

    def n_tokens(text: str) -> int:
        return int(model.to_tokens(text, prepend_bos=False).shape[1])

    return [
        p
        for p in pairs
        if n_tokens(p.answer) == 1
        and n_tokens(p.wrong) == 1
        and n_tokens(p.clean) == n_tokens(p.corrupted)
    ]


def paired_batch(model: HookedModel, pairs: Sequence[PromptPair]) -> tuple[Batch, Batch, LogitDiff]:
    """(clean batch, corrupted batch, logit_diff(answer, wrong)) for `attention_attribution`.

    Raises:
        ValueError: a pair whose answers are not single tokens or whose prompts differ in token
            length (filter with `usable` first).

    >>> pair = PromptPair("I like Italy", "I like Paris", " and", " the")  # one token apart
    >>> clean, corrupted, metric = paired_batch(model, [pair])
    >>> clean.tokens.shape == corrupted.tokens.shape, metric(model(clean.tokens)).shape
    (True, torch.Size([1]))
    >>> paired_batch(model, [PromptPair("I like Italy", "I like Spain", " and", " the")])
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: 1 pair(s) unusable with this tokenizer, e.g. PromptPair(...): answers must be ...
    """
    if not pairs:
        raise ValueError("no pairs: pass at least one PromptPair")
    bad = [p for p in pairs if p not in usable(model, [p])]
    if bad:
        raise ValueError(
            f"{len(bad)} pair(s) unusable with this tokenizer, e.g. {bad[0]!r}: answers must be "
            "one token and clean/corrupted the same token length; filter with tasks.ioi.usable"
        )
    clean = to_batch(model, [p.clean for p in pairs])
    corrupted = to_batch(model, [p.corrupted for p in pairs])
    answers = torch.tensor([int(model.to_tokens(p.answer, prepend_bos=False)[0, 0]) for p in pairs])
    wrongs = torch.tensor([int(model.to_tokens(p.wrong, prepend_bos=False)[0, 0]) for p in pairs])
    return clean, corrupted, logit_diff(answers, wrongs)
