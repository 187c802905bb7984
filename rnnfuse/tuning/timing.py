"""Timing candidates side by side: warm-up, interleaved rounds, medians.

Both the tuner and bench/ time with `interleaved_medians`, so a plan the
tuner picks and a row of docs/benchmarks.md come from the same measurement:
every round runs each candidate once, in an order that rotates between
rounds, so drift (clocks, temperature, other work) hits all of them alike.
A step must return something whose conversion to NumPy waits for the device
(a scalar tensor), which is what each timed call does.

Example:

    >>> import time
    >>> stats = interleaved_medians({"a": lambda: 1, "b": lambda: 2}, warmup=1, repeats=3)
    >>> sorted(stats), len(stats["a"]["times"])
    (['a', 'b'], 3)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["interleaved_medians", "sync"]


def sync(result: Any) -> None:
    """Waits until `result` (a tensor or nested tensors) is computed."""
    import keras

    for t in keras.tree.flatten(result):
        np.asarray(keras.ops.convert_to_numpy(t) if hasattr(t, "shape") else t)


def interleaved_medians(
    steps: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 7,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """Times each step `repeats` times, interleaved, after `warmup` calls.

    Returns:
        name -> {"median": seconds, "times": [seconds, ...]}.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            sync(steps[name]())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            sync(steps[name]())
            times[name].append(time.perf_counter() - start)
            if on_step is not None:
                on_step(name)
    return {n: {"median": statistics.median(t), "times": t} for n, t in times.items()}
