"""One way to switch a setting for a block of code: a ContextVar, set and reset.

Every run-time switch in rnnfuse (the tuner's clock, ProjectedLSTM's fast path,
...) is a `contextvars.ContextVar` changed only through `scoped`, so a
switch holds for the block that set it and the thread (or task) that runs
it, and is undone however the block ends.

Example:
    >>> import contextvars
    >>> level = contextvars.ContextVar("level", default="low")
    >>> with scoped(level, "high"):
    ...     level.get()
    'high'
    >>> level.get()
    'low'
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TypeVar

__all__ = ["scoped"]

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """Sets `var` to `value` for the `with` block; yields `value`."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
