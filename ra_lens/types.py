"""The type aliases every module's signatures share: what prompts, metrics, hooks, targets and
head scores look like, and the contract every result class holds (`Result`, `OneFigure`,
`ManyFigures`). Import them from here; do not redefine them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from jaxtyping import Float, Int
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import Batch, HookedModel

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Prompts: token ids, a padded Batch, one string or a list of strings.
Tokens = Validated[Int[Tensor, "batch pos"] | Batch | str | Sequence[str]]
#: A metric: `metric(logits)` or `metric(logits, batch)` -> a scalar or one value per prompt.
MetricFn = Callable[..., Tensor]
#: A TransformerLens forward hook: (hook point name, function(value, hook)).
Hook = tuple[str, Callable[..., Any]]
#: One target token id per prompt.
Targets = Validated[Int[Tensor, "batch"] | Sequence[int]]
#: One score per attention head, TransformerLens's [n_layers, n_heads] layout.
Scores = Float[Tensor, "layer head"]


R = TypeVar("R", bound="Result")


@runtime_checkable
class Result(Protocol):
    """What every result class of ra-lens holds (tests/test_results_contract.py checks each one
    on a tiny model): a JSON-ready report, a Markdown table, and a file that loads back equal.

    - `to_dict()`: plain JSON values (`json.dumps` takes it); optional keyword arguments (how
      many top entries) have defaults.
    - `table()`: a Markdown table as one string.
    - `save(path)`: one file, written atomically through `ra_lens.files.write_file`;
      `cls.load(path)` reads it back with every field equal, and refuses another class's file or
      a damaged one with a ValueError naming the file.

    Pictures: a result that is one figure is a `OneFigure`, one that is several a `ManyFigures`
    (a study's tasks and curves: one file per figure, so no `Figure` to return).
    """

    def to_dict(self) -> dict[str, Any]: ...

    def table(self) -> str: ...

    def save(self, path: str | Path) -> None: ...

    @classmethod
    def load(cls: type[R], path: str | Path) -> R: ...


@runtime_checkable
class OneFigure(Result, Protocol):
    """A result drawn as one figure: `plot(save=None)` returns a fresh matplotlib Figure and, with
    `save`, also writes it (png, pdf, svg by suffix)."""

    def plot(self, save: str | Path | None = None) -> Figure: ...


@runtime_checkable
class ManyFigures(Result, Protocol):
    """A result drawn as several figures: `plots(out_dir)` writes them into `out_dir` and returns
    their paths."""

    def plots(self, out_dir: str | Path) -> list[Path]: ...


__all__ = [
    "HookedModel",
    "Hook",
    "ManyFigures",
    "MetricFn",
    "OneFigure",
    "Result",
    "Scores",
    "Targets",
    "Tokens",
]
