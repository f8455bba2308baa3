"""Annotations shared by the library's signatures.

The test run type-checks every ra_lens signature with jaxtyping + beartype
(`--jaxtyping-packages=ra_lens,...`, see the Makefile). A parameter that the function checks itself,
with an error naming the fix, is annotated `Validated[T]`: T says what to pass, and a run-time
checker lets any value through to the function's own check and message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

T = TypeVar("T")

if TYPE_CHECKING:
    # A static checker holds callers to T itself (what the function documents it takes).
    Validated = Annotated[T, "validated"]
else:
    #: `Validated[float]` = float, but any value reaches the function's own check (Union with Any).
    Validated = T | Any

#: A file path: a str or an os.PathLike of str. (Unsubscripted at run time: the beartype of the
#: TL 2 environment, 0.14, refuses os.PathLike[str].)
if TYPE_CHECKING:
    StrPath = str | os.PathLike[str]
else:
    StrPath = str | os.PathLike

F = TypeVar("F", bound=Callable[..., Any])


def no_type_check(function: F) -> F:
    """`function` itself, left out of the test run's checker: jaxtyping's import hook skips a
    function with a decorator named `no_type_check`, while mypy (unlike with
    `typing.no_type_check`) still checks its body. For the hook closures built on every call:
    the checker would wrap each one again each time (thousands of times per test file), and
    their arguments are plain Tensors the enclosing, checked method already describes.

    >>> no_type_check(len)("abc")
    3
    """
    return function
