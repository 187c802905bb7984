"""The static plan table: what to do with a group when nothing is timed.

Used by `optimize` without `tune=` (and by the tuner when there is no GPU).
A group is reduced to a `Regime` (cell kind, width, levels, directions,
whether Keras runs it in its generic loop, dtype, training or inference)
and the first rule of `RULES` that matches gives the plan. Each rule cites
the H200 measurements behind it (TF 2.21, cuDNN 9.19; the full matrix is in
docs/benchmarks.md, produced by bench/bench_tf.py).

Example:

    >>> plan_for_regime(Regime("rnn_tanh", 512, 4, False, True, "float32", True)).name
    'fused'
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rnnfuse.tuning.plans import FUSED, PER_LAYER, Plan

__all__ = ["Regime", "RULES", "plan_for_regime", "static_plan"]


@dataclasses.dataclass(frozen=True)
class Regime:
    """What the static table looks at."""

    kind: str  # lstm, gru, rnn_tanh, rnn_relu
    units: int
    levels: int
    bidirectional: bool
    # Keras runs some layer of the group in its generic loop (SimpleRNN,
    # RNN(cell), StackedRNNCells, LSTM/GRU without bias).
    keras_loop: bool
    dtype: str  # compute dtype: float32, float16, ...
    training: bool


# (name, predicate, plan, evidence). First match wins; the last rule is the
# default. Evidence: speedup over the original model, H200, train step
# unless noted, from bench/results/tf_h200.json.
RULES: list[tuple[str, Callable[[Regime], bool], Plan, str]] = [
    (
        "generic-loop stacks",
        lambda r: r.keras_loop,
        FUSED,
        "one cuDNN call replaces Keras' while-loop: DESIGN.md measured 12.4x "
        "(SimpleRNN) and 16.3x (RNN(LSTMCell)) at 4x512, B=64, T=200",
    ),
    (
        "default",
        lambda r: True,
        FUSED,
        "fused with TensorFlow's default algorithm",
    ),
]


def plan_for_regime(regime: Regime) -> Plan:
    """The plan of the first rule in `RULES` that matches `regime`."""
    for _name, predicate, plan, _evidence in RULES:
        if predicate(regime):
            return plan
    return FUSED


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


def regime_of(group, dtype: str, training: bool) -> Regime:
    return Regime(
        kind=group.cell,
        units=group.units,
        levels=group.num_layers,
        bidirectional=group.bidirectional,
        keras_loop=_keras_loop(group),
        dtype=str(dtype),
        training=bool(training),
    )


def static_plan(group, dtype: str, training: bool) -> Plan:
    """The plan the rule table gives `group` in `dtype`."""
    return plan_for_regime(regime_of(group, dtype, training))


# Keep PER_LAYER importable for rules that need it.
_ = PER_LAYER
