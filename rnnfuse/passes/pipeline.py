"""The passes in order: graph -> rules -> planning -> rewrite. `run_pipeline`
is the one place that runs them; the rewrite runs only with
`options.choose_plans`, and makes a plain Keras model.

>>> import keras
>>> m = keras.Sequential([keras.Input((6, 2)),
...     keras.layers.GRU(4, return_sequences=True, name="a"), keras.layers.GRU(4, name="b")])
>>> [g.layers for g in run_pipeline(m, PassOptions()).report.groups]
[('a', 'b')]
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
