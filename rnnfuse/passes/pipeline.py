"""The passes in order: graph -> rules -> planning -> rewrite.

`run_pipeline` is the one place that runs them. Each has the signature of
`rnnfuse.passes.result`; the rewrite runs only when `options.choose_plans`
is given, and makes a plain Keras model (`rnnfuse.api` makes it an
optimized one).

Example:
    >>> import keras
    >>> m = keras.Sequential([keras.Input((6, 2)),
    ...     keras.layers.GRU(4, return_sequences=True, name="a"),
    ...     keras.layers.GRU(4, name="b")])
    >>> found = run_pipeline(m, PassOptions())
    >>> [g.layers for g in found.report.groups], found.modified
    ([('a', 'b')], False)
    >>> done = run_pipeline(m, PassOptions(choose_plans=lambda r: [(g, None) for g in r.groups]))
    >>> [type(l).__name__ for l in done.rewritten.layers]
    ['FusedRNN']
"""

from __future__ import annotations

import keras

from rnnfuse.passes.candidates import rules_pass
from rnnfuse.passes.graph import graph_pass
from rnnfuse.passes.planning import planning_pass
from rnnfuse.passes.result import PassOptions, PassResult
from rnnfuse.passes.rewrite import rewrite_pass

__all__ = ["PassOptions", "PassResult", "run_pipeline"]


def run_pipeline(model: keras.Model, options: PassOptions) -> PassResult:
    """Runs the passes over `model` in order; the last one's result."""
    result = graph_pass(model, PassResult(), options)
    result = rules_pass(model, result, options)
    result = planning_pass(model, result, options)
    return rewrite_pass(model, result, options)
