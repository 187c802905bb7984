"""One way to switch a setting for a block of code: a ContextVar, set and
reset. Every run-time switch in rnnfuse is a `contextvars.ContextVar`, so
it holds for the thread (or task) that set it; `scoped` undoes it however
the block ends.

>>> import contextvars
>>> level = contextvars.ContextVar("level", default="low")
>>> with scoped(level, "high"):
...     level.get()
'high'
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence, TypeVar

__all__ = ["checked_choice", "scoped"]

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """Sets `var` to `value` for the `with` block; yields `value`."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def checked_choice(value: Any, allowed: Sequence[str], where: str, noun: str) -> str:
    """`value` where it is one of `allowed`; else a ValueError naming `where`,
    the value received and the choices.

    >>> checked_choice("one", ("auto", "one"), "call_mode(mode)", "mode")
    'one'
    """
    if value not in allowed:
        raise ValueError(
            f"{where}: unknown {noun} {value!r}; expected one of "
            f"{', '.join(repr(a) for a in allowed)}."
        )
    return value
