"""Timing candidates side by side: warm-up, interleaved rounds, medians.

Every round runs each candidate once, in an order that rotates between
rounds, so drift hits all alike; with `prune`, a candidate clearly slower
than the best stops being run. The tuner and bench/ both time this way.
Seconds come from `rnnfuse.tuning.clock.now()`, so tests use a fake clock.

>>> from rnnfuse.tuning.clock import using_clock
>>> t = [0.0]
>>> def costs(s): return lambda: t.__setitem__(0, t[0] + s)
>>> with using_clock(lambda: t[0]):
...     raced = interleaved_medians({"fast": costs(0.001), "slow": costs(0.02)},
...                                 warmup=1, repeats=5, prune=1.5)
>>> len(raced["fast"]["times"]), len(raced["slow"]["times"]), raced["slow"]["pruned"]
(2, 1, True)
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping

import numpy as np

from rnnfuse.tuning.clock import now

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
    prune: float | None = None,
    race: float | None = None,
    keep: tuple = (),
    beat: float | None = None,
) -> dict[str, dict]:
    """Times each step `repeats` times, interleaved, after `warmup` calls;
    returns name -> {"median": s, "times": [s, ...], "pruned": bool}.

    `prune` (> 1): a step over prune**2 x the best on its last warm-up or
    first-round call, or over prune x the best median after a timed round,
    stops. `race` (> 1): the tighter factor from the third round for steps
    not in `keep` (the baseline needs every round). `beat` (in (0, 1]): from
    the third round, a step over beat x the `keep` steps' best median stops.
    """
    if prune is not None and not prune > 1:
        raise ValueError(f"interleaved_medians: prune must be > 1 or None; received {prune!r}")
    if race is not None and (prune is None or not 1 < race <= prune):
        raise ValueError(
            f"interleaved_medians: race must be in (1, prune] with prune set; received {race!r}"
        )
    if beat is not None and (prune is None or not keep or not 0 < beat <= 1):
        raise ValueError(
            "interleaved_medians: beat must be in (0, 1] with prune and keep set; received "
            f"beat={beat!r}, prune={prune!r}, keep={keep!r}"
        )
    names = list(steps)
    last_warmup: dict[str, float] = {}
    for name in names:
        for _ in range(warmup):
            start = now()
            sync(steps[name]())
            last_warmup[name] = now() - start
    times: dict[str, list[float]] = {n: [] for n in names}
    pruned: set[str] = set()
    if prune is not None and warmup:
        pruned |= _clearly_slower({n: [last_warmup[n]] for n in names}, prune**2)
    for r in range(repeats):
        running = [n for n in names if n not in pruned]
        if prune is not None and r >= 2 and len(running) <= 1:
            break  # the race is decided: nothing left to compare with
        order = running[r % len(running):] + running[: r % len(running)]
        for name in order:
            start = now()
            sync(steps[name]())
            times[name].append(now() - start)
            if on_step is not None:
                on_step(name)
        if prune is not None:
            ran = {n: times[n] for n in running}
            # One call each: as after the warm-up (the first round may be the
            # first call timed).
            pruned |= _clearly_slower(ran, prune**2 if r == 0 else prune)
            if race is not None and r >= 2:
                pruned |= _clearly_slower(ran, race) - set(keep)
            if beat is not None and r >= 2:
                pruned |= _not_beating(ran, keep, beat, pruned)
    out = {}
    for n, t in times.items():
        t = t or [last_warmup[n]]
        out[n] = {"median": statistics.median(t), "times": t, "pruned": n in pruned}
    return out


def _not_beating(times: Mapping[str, list[float]], keep: tuple, beat: float,
                 pruned: set) -> set[str]:
    """The names not in `keep` whose fastest time is over `beat` x the best
    median of the `keep` steps in `times` and not `pruned` (none: set())."""
    base = [statistics.median(times[k]) for k in keep if k in times and k not in pruned]
    if not base:
        return set()
    return {n for n, t in times.items() if n not in keep and min(t) > beat * min(base)}


def _clearly_slower(times: Mapping[str, list[float]], factor: float) -> set[str]:
    """The names whose fastest time is over `factor` x the best median."""
    if len(times) < 2:
        return set()
    best = min(statistics.median(t) for t in times.values())
    return {n for n, t in times.items() if min(t) > factor * best}
