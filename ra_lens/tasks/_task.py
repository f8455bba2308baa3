"""Word-pair tasks: loading the bundled JSON files and the 70/21/9 train/test/valid split."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from importlib.abc import Traversable

Pair = tuple[str, str]

#: The paper's split fractions (train, test, valid); valid takes whatever rounding leaves.
SPLIT_FRACTIONS: tuple[float, float, float] = (0.70, 0.21, 0.09)


@dataclass(frozen=True)
class Splits:
    """Disjoint train / test / valid parts of a task's pairs.

    >>> load("antonym").split(seed=42).sizes()
    {'train': 99, 'test': 30, 'valid': 12}
    """

    train: tuple[Pair, ...]
    test: tuple[Pair, ...]
    valid: tuple[Pair, ...]

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "test": len(self.test), "valid": len(self.valid)}


@dataclass(frozen=True)
class Task:
    """An in-context-learning task: (input, output) word pairs such as ("hot", "cold")."""

    name: str
    #: Any sequence of (input, output) string pairs; checked and stored as tuple[Pair, ...].
    pairs: Sequence[Sequence[str]]
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", normalise_pairs(self.pairs, what=f"task {self.name!r}"))

    def __len__(self) -> int:
        return len(self.pairs)

    def split(self, seed: int = 42) -> Splits:
        """Shuffle with `random.Random(seed)` and cut 70% train / 21% test / 9% valid.

        Sizes are round(0.70 n), round(0.21 n) and the rest, so 100 pairs give 70/21/9.

        Raises:
            ValueError: a split would be empty (fewer than about 10 pairs).

        >>> splits = Task("toy", [(f"x{i}", f"y{i}") for i in range(100)]).split(seed=0)
        >>> splits.sizes(), set(splits.train) & set(splits.test)
        ({'train': 70, 'test': 21, 'valid': 9}, set())
        """
        n = len(self.pairs)
        n_train = round(SPLIT_FRACTIONS[0] * n)
        n_test = round(SPLIT_FRACTIONS[1] * n)
        n_valid = n - n_train - n_test
        if min(n_train, n_test, n_valid) < 1:
            raise ValueError(
                f"task {self.name!r} has {n} pairs: too few for a 70/21/9 train/test/valid split "
                f"(would give {n_train}/{n_test}/{max(n_valid, 0)}); at least 10 are needed"
            )
        order = list(cast("tuple[Pair, ...]", self.pairs))  # as __post_init__ stored them
        random.Random(seed).shuffle(order)
        return Splits(
            train=tuple(order[:n_train]),
            test=tuple(order[n_train : n_train + n_test]),
            valid=tuple(order[n_train + n_test :]),
        )


def normalise_pairs(pairs: Sequence[Sequence[str]], *, what: str = "pairs") -> tuple[Pair, ...]:
    """Check that every item is a pair of strings and return them as a tuple of tuples.

    >>> normalise_pairs([["hot", "cold"], ("up", "down")])
    (('hot', 'cold'), ('up', 'down'))
    >>> normalise_pairs(["hot"])
    Traceback (most recent call last):
    TypeError: pairs: item 0 is 'hot', expected an (input, output) string pair
    """
    out: list[Pair] = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(s, str) for s in pair):
            raise TypeError(
                f"{what}: item {i} is {pair!r}, expected an (input, output) string pair"
            )
        out.append((pair[0], pair[1]))
    return tuple(out)


def _data_dir() -> Traversable:
    return resources.files("ra_lens.tasks").joinpath("data")


def available() -> list[str]:
    """Names of the bundled tasks, sorted (e.g. "antonym", "country-capital").

    >>> available()  # doctest: +NORMALIZE_WHITESPACE
    ['antonym', 'capitalize', 'country-capital', 'english-french', 'person-sport', 'present-past',
     'singular-plural', 'synonym']
    """
    return sorted(
        entry.name[: -len(".json")]
        for entry in _data_dir().iterdir()
        if entry.name.endswith(".json")
    )


@cache
def load(name: str) -> Task:
    """Load a bundled task by name.

    Raises:
        ValueError: unknown name; the message lists the available tasks.

    >>> task = load("antonym")
    >>> task.name, len(task), task.pairs[0]
    ('antonym', 141, ('hot', 'cold'))
    """
    names = available()
    if name not in names:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(names)}")
    raw = json.loads(_data_dir().joinpath(f"{name}.json").read_text(encoding="utf-8"))
    return Task(name=raw["name"], pairs=raw["pairs"], description=raw.get("description", ""))
