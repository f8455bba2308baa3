"""The clean/corrupted prompt pairs of `ra-lens attribute` and `ra-lens circuit`: a built-in task's
(--task) or a JSONL file's (--pairs), cut to --n-pairs and checked against the tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ra_lens.types import HookedModel

CIRCUIT_TASKS = ("ioi", "country-capital")
PAIR_KEYS = ("clean", "corrupted", "answer", "wrong")


def read_pairs(path: Path) -> list[Any]:
    """PromptPairs from a JSONL file, one {"clean", "corrupted", "answer", "wrong"} a line."""
    from ra_lens.tasks.ioi import PromptPair

    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"--pairs {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(
            f"--pairs {path} is a folder: give a JSONL file, one pair a line"
        ) from None
    except OSError as error:
        raise ValueError(f"--pairs {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--pairs {path}: not UTF-8 text (byte {error.start}): give a JSONL file, one pair "
            "a line"
        ) from None
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--pairs {path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or set(row) != set(PAIR_KEYS):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"--pairs {path}, line {number}: expected an object with exactly the keys "
                f"{list(PAIR_KEYS)}, got {got}"
            )
        if not all(isinstance(row[key], str) and row[key] for key in PAIR_KEYS):
            raise ValueError(f"--pairs {path}, line {number}: every value must be non-empty text")
        pairs.append(PromptPair(*(row[key] for key in PAIR_KEYS)))
    if not pairs:
        raise ValueError(f"--pairs {path}: no pairs in the file")
    return pairs


def circuit_pairs(args: argparse.Namespace, model: HookedModel, file_pairs: list[Any]) -> list[Any]:
    """The pairs to use: the first --n-pairs of the file (each must suit the tokenizer) or of
    the task's pairs that suit it."""
    from ra_lens.tasks import ioi

    if args.pairs is not None:
        pairs = file_pairs[: args.n_pairs]
        for number, pair in enumerate(pairs, 1):
            if not ioi.usable(model, [pair]):
                raise ValueError(
                    f"--pairs {args.pairs}, pair {number}: answer and wrong must be one token "
                    "each and clean/corrupted the same number of tokens for this model"
                )
        return pairs
    if args.task == "ioi":
        pairs = ioi.usable(model, ioi.ioi_pairs(max(40, 4 * args.n_pairs)))
    else:
        pairs = ioi.capital_pairs(model)
    if not pairs:
        raise ValueError(
            f"--task {args.task}: no pair suits this model's tokenizer (one-token answers, "
            "equal token lengths); write your own with --pairs FILE.jsonl"
        )
    return pairs[: args.n_pairs]
