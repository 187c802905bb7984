"""The clock tuning's timing reads: `time.perf_counter`, or a test's fake
one (`using_clock`), so no decision depends on the machine's load.

>>> ticks = iter([10.0, 10.5])
>>> with using_clock(lambda: next(ticks)):
...     start = now()
...     now() - start
0.5
"""

from __future__ import annotations

import contextvars
import time
from typing import Callable, ContextManager

from rnnfuse.scoped import scoped

__all__ = ["Clock", "current_clock", "now", "using_clock"]

Clock = Callable[[], float]

_CLOCK: contextvars.ContextVar[Clock] = contextvars.ContextVar(
    "rnnfuse_tuning_clock", default=time.perf_counter
)


def now() -> float:
    """The current clock's reading, in seconds."""
    return _CLOCK.get()()


def current_clock() -> Clock:
    """The clock in effect here: hand it to a worker thread, which does not inherit this context."""
    return _CLOCK.get()


def using_clock(clock: Clock) -> ContextManager[Clock]:
    """Times with `clock` (no arguments, seconds) inside the `with` block."""
    return scoped(_CLOCK, clock)
