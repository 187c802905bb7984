"""Whole `predict` calls of two models timed side by side, for the GPU
tests' never-slower checks.

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
"""

from __future__ import annotations

from rnnfuse.tuning.timing import interleaved_medians


def predict_medians(models: dict, x, batch: int, repeats: int = 7) -> dict:
    """{name: median seconds of `model.predict(x, batch_size=batch)`} for
    each of `models`, after one untimed call each (its trace), interleaved."""
    steps = {name: (lambda m=m: m.predict(x, batch_size=batch, verbose=0))
             for name, m in models.items()}
    return {name: s["median"] for name, s in
            interleaved_medians(steps, warmup=1, repeats=repeats).items()}
