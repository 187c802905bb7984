"""The static plan table: what to do with a group when nothing is timed.

Used by `optimize` without `tune=` (and by the tuner when there is no GPU).
Each rule is backed by numbers measured on an H200 (TF 2.21, cuDNN 9.19);
the full matrix is in docs/benchmarks.md.

1. A group with a layer Keras runs in its generic Python-level loop
   (SimpleRNN, RNN(cell), StackedRNNCells, GRU/LSTM without bias): fuse it
   whole, default algorithm. One cuDNN call replaces a while-loop of small
   kernels (12.4x for SimpleRNN, 16.3x for RNN(LSTMCell), 4x512, B=64,
   T=200, train step).
2. LSTM/GRU (Keras already runs each layer on cuDNN):
   see `_CUDNN_RULES` below, one row per regime, first match wins.

Example:

    >>> import keras
    >>> from rnnfuse.passes import build_layer_graph, plan_fusion
    >>> m = keras.Sequential([keras.Input((10, 4)),
    ...     keras.layers.SimpleRNN(8, return_sequences=True),
    ...     keras.layers.SimpleRNN(8)])
    >>> g = plan_fusion(build_layer_graph(m), model_name=m.name).groups[0]
    >>> static_plan(g, "float32", training=True).name
    'fused'
"""

from __future__ import annotations

from rnnfuse.tuning.plans import FUSED, Plan

__all__ = ["static_plan"]


def _keras_loop(group) -> bool:
    """Whether Keras runs some layer of `group` in its generic loop."""
    import keras

    for view in group.views:
        layers = (
            (view.layer.forward_layer, view.layer.backward_layer)
            if isinstance(view.layer, keras.layers.Bidirectional)
            else (view.layer,)
        )
        for layer in layers:
            if type(layer) not in (keras.layers.LSTM, keras.layers.GRU):
                return True
            if not layer.cell.use_bias:
                return True
    return False


# (predicate(group, dtype, training), plan, the measurement behind it).
# Filled from bench/results; see docs/benchmarks.md "Static plan table".
_CUDNN_RULES: list = []


def static_plan(group, dtype: str, training: bool) -> Plan:
    """The plan the rule table gives `group` in `dtype`."""
    if _keras_loop(group):
        return FUSED
    for predicate, plan, _evidence in _CUDNN_RULES:
        if predicate(group, str(dtype), training):
            return plan
    return FUSED
