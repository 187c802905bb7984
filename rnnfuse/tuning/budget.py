"""How much timing a `fit`, `evaluate` or `predict` call can pay for:

    budget_s = FIT_SHARE x steps x t_original

with `steps` the call's steps (`call_steps`) and `t_original` the original
layers' step as timed. A plan replaces them only where it wins by
`tuner.KEEP_ORIGINAL_MARGIN`, so such a tuning pays for itself when a plan
wins and costs at most FIT_SHARE when none does. A call too short to time
the two leading candidates times nothing (the static table's proven plan
runs it); otherwise each stage is timed only where its projected cost
fits; a decision cut short is not cached; a call of unknown length times
everything.

Example:
    >>> import numpy as np
    >>> call_steps(np.zeros((1000, 10, 4)), batch_size=32, epochs=10)
    320
    >>> short, long = TuningBudget(steps=20), TuningBudget(steps=100_000)
    >>> short.times_anything(warmup=1, repeats=5), long.times_anything(warmup=1, repeats=5)
    (False, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rnnfuse.tuning import clock

__all__ = ["FIT_SHARE", "Spend", "TuningBudget", "call_steps"]

# The share of a call's time its tuning may take: a third of the winning margin.
FIT_SHARE = 0.03
# The candidates every timing starts with: the original layers, the static plan.
LEADING = 2


@dataclasses.dataclass(frozen=True)
class TuningBudget:
    """The timing one Keras call can pay for (see the module doc), in seconds
    of `rnnfuse.tuning.clock`."""

    steps: int
    share: float = FIT_SHARE

    def min_steps(self, warmup: int, repeats: int) -> int:
        """The fewest steps a call needs to time the LEADING candidates (a first
        call, `warmup` and `repeats` steps each, at the original layers' speed)."""
        return math.ceil(LEADING * (1 + warmup + repeats) / self.share)

    def times_anything(self, warmup: int, repeats: int) -> bool:
        """Whether this call is long enough to time the leading candidates."""
        return self.steps >= self.min_steps(warmup, repeats)

    def seconds(self, original_step_s: float) -> float:
        """The budget in seconds for a group whose original layers take `original_step_s` a step."""
        return self.share * self.steps * original_step_s

    def start(self) -> "Spend":
        """A group's spending, from now."""
        return Spend(self, clock.now())

    def why_static(self, warmup: int, repeats: int) -> str:
        return (f"static: a call of {self.steps} steps cannot pay for timing (at least "
                f"{self.min_steps(warmup, repeats)} at {self.share:.0%} of the call)")


@dataclasses.dataclass
class Spend:
    """One group's timing against its budget."""

    budget: TuningBudget
    started: float
    # Candidate timings so far (a candidate timed in two stages counts twice).
    timed: int = 0
    # Whether the budget left candidates out.
    cut: bool = False

    def spent(self) -> float:
        return clock.now() - self.started

    def allows(self, more: int, original_step_s: float | None) -> bool:
        """Whether `more` candidates, at the mean cost of those timed so far,
        fit in what is left."""
        if original_step_s is None or self.timed == 0:
            return False
        spent = self.spent()
        return spent + more * spent / self.timed <= self.budget.seconds(original_step_s)

    def why_not(self, original_step_s: float | None) -> str:
        limit = "?" if original_step_s is None else f"{self.budget.seconds(original_step_s):.2f}"
        return (f"not timed: the call's budget ({self.budget.steps} steps: {limit} s) was "
                f"spent ({self.spent():.2f} s)")


def call_steps(x: Any, batch_size: int | None = None, epochs: int = 1,
               steps: int | None = None, initial_epoch: int = 0,
               validation_split: float = 0.0) -> int | None:
    """The steps a `fit` (epochs=1: `evaluate`/`predict`) call will run over
    `x`, or None where the data would have to be consumed to know.

    >>> import numpy as np
    >>> call_steps(np.zeros((100, 5, 2)), 8, epochs=3, validation_split=0.2)
    30
    >>> call_steps(iter([]), 8) is None
    True
    """
    epochs = max(int(epochs) - int(initial_epoch or 0), 0)
    if steps is not None:
        return int(steps) * epochs
    per_epoch = _batches(x, batch_size, validation_split)
    return None if per_epoch is None else per_epoch * epochs


def _batches(x: Any, batch_size: int | None, validation_split: float) -> int | None:
    """Batches in one pass over `x`."""
    cardinality = getattr(x, "cardinality", None)
    if callable(cardinality):  # tf.data: -1 infinite, -2 unknown
        try:
            n = int(cardinality())
        except (TypeError, ValueError):
            return None
        return n if n >= 0 else None
    first = x
    if isinstance(x, dict):
        first = next(iter(x.values()), None)
    elif isinstance(x, (list, tuple)) and x and hasattr(x[0], "shape"):
        first = x[0]
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] is not None and not hasattr(x, "__next__"):
        if any(c.__name__ == "PyDataset" for c in type(x).__mro__):
            return len(x)
        rows = int(shape[0])
        if validation_split:
            rows = int(math.floor(rows * (1.0 - float(validation_split))))
        return math.ceil(rows / (batch_size or 32))
    if any(c.__name__ == "PyDataset" for c in type(x).__mro__):
        try:
            return len(x)
        except TypeError:
            return None
    return None
