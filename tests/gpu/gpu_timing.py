"""Timers of the GPU tests: whole `predict` calls of two models side by
side (the never-slower checks), the median of repeated calls, and a
callback that times each epoch of a `fit`.

`rnnfuse.tuning.timing.interleaved_medians` (the tuner's and the
benchmarks' clock) alternates the models' calls, so drift between them
hits both alike. Timed one model after the other, a host-bound torch
`predict` read 0.93x and then 1.04x on the same code.

    >>> import numpy as np
    >>> class Echo:
    ...     def predict(self, x, batch_size, verbose):
    ...         return x
    >>> sorted(predict_medians({"original": Echo(), "optimized": Echo()}, np.zeros((2, 3)), 2, repeats=2))
    ['optimized', 'original']
    >>> median_seconds(lambda: None, repeats=3) >= 0
    True
"""

from __future__ import annotations

import time

import keras
import numpy as np

from rnnfuse.tuning.timing import interleaved_medians


def predict_medians(models: dict, x, batch: int, repeats: int = 7) -> dict:
    """{name: median seconds of `model.predict(x, batch_size=batch)`} for
    each of `models`, after one untimed call each (its trace), interleaved."""
    steps = {name: (lambda m=m: m.predict(x, batch_size=batch, verbose=0))
             for name, m in models.items()}
    return {name: s["median"] for name, s in
            interleaved_medians(steps, warmup=1, repeats=repeats).items()}


def median_seconds(run, repeats: int, *, warmup: int = 1, sync=lambda: None) -> float:
    """Median seconds of `run()` over `repeats` calls after `warmup` untimed
    ones (traces, compiles); `sync` waits for the device on both sides of
    each timed call (torch.cuda.synchronize where launches are async)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class EpochTimes(keras.callbacks.Callback):
    """Seconds of each epoch of a `fit`, in `times`."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._t)
