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
    >>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True)).name
    'fused @persistent_static+tc'
    >>> plan_for_regime(Regime("gru", 1024, 4, False, False, "float32", True)).name
    'split 2+2'
    >>> plan_for_regime(Regime("lstm", 512, 1, False, False, "float16", True)).name
    'per-layer'
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rnnfuse.backends import get_backend
from rnnfuse.plan import FUSED, PER_LAYER, Plan

__all__ = ["Regime", "RULES", "TABLES", "plan_for_regime", "static_plan"]


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


PERSISTENT = "persistent_static+tc"


def _halves(n: int) -> Plan:
    return Plan((n // 2, n - n // 2)) if n >= 2 else FUSED


# (name, predicate, plan for a run of n layers, evidence). First match wins.
# Evidence: speedup over the original model on the H200 (TF 2.21, cuDNN
# 9.19), bench/results/tf_h200.json. These rules were fitted to those 26
# cells (in-sample); shapes far from them are not guaranteed. Coverage, out
# of sample (the user-view matrix: the anchor and 30 drawn cells,
# bench/results/user_view_tf_h200_s4_part*.json and _s5.json, 56
# training/inference decisions timed by first-batch tuning): the table's
# plan was the tuned one in 22, within 3% of it in 5, and over 3% slower
# than the original layers in 13 as run; with the SimpleRNN inference rule
# (refitted from the first 29 cells), 10 (`bench/report_user_view.py`
# prints the list). What is left depends on the batch (float16 GRU 6x192 at
# batch 173: the persistent rule 0.35x) or on a padding mask, which the
# table does not see; with tune="auto" (the default) a GPU times the real
# batch instead.
#
# Exactness first: in float32 the table keeps TensorFlow's default cuDNN
# algorithm, whose fused results match Keras' per-layer path within 1e-5.
# cuDNN's persistent algorithm is faster for small float32 stacks (batch 8,
# 256 units: 1.10-2.25x against 0.99-1.20x fused with the default) and
# as accurate against a float64 reference, but its float32 results differ
# from Keras' by about 1e-4; `tune=` may pick it. In float16 (tolerance
# 1e-2) the table uses it.
RULES: list[tuple[str, Callable[[Regime], bool], Callable[[int], Plan], str]] = [
    (
        "one LSTM/GRU layer on Keras' cuDNN path: per layer",
        lambda r: r.levels == 1 and not r.keras_loop,
        lambda n: PER_LAYER,
        "no measured row yet (bench/bench_single_layers.py times them "
        "through fit): Keras' own call is one cuDNN call as well, so the "
        "fused call gains only from the algorithm; with raw ops, 1x512 B64 "
        "T1000 fp16, cuDNN's persistent forward alone took 39.9 -> 24.1 ms, "
        "but a persistent algorithm's speed does not carry across batch "
        "sizes, so first-batch tuning (tune='auto' on a GPU) decides",
    ),
    (
        "SimpleRNN inference: per layer",
        lambda r: r.kind in ("rnn_tanh", "rnn_relu") and not r.training,
        lambda n: PER_LAYER,
        "refitted from the user-view matrix (docs/benchmarks.md): Keras "
        "XLA-compiles a SimpleRNN model under jit_compile='auto', and "
        "against that the fused inference plans ran 0.62-0.98x in all 4 "
        "SimpleRNN cells (2x32 B32 T34 0.62x, 3x64 B41 T100 fp16 0.66x, "
        "6x160 B33 T1605 fp16 0.65x, 7x64 B58 T447 bf16 0.98x); in "
        "training they won 1.5-3.1x, so training keeps the rules below",
    ),
    (
        "float16: fused, persistent algorithm",
        lambda r: r.dtype == "float16",
        lambda n: Plan((n,), PERSISTENT),
        "mixed_float16: LSTM/GRU train 1.14-1.59x (bidirectional GRU 1.58x), "
        "inference 2.42x; the default fused plan gave 0.84-1.26x. SimpleRNN "
        "and RNN(LSTMCell) 9.3x and 17.1x. Out of sample (user-view matrix, "
        "docs/benchmarks.md): right at batch 2-64 (persistent_static 1.95x "
        "at 4x512 B64, 2.7x bi-GRU B2), 3x wrong at batch 173 (GRU 6x192: "
        "85 ms vs 29 ms per layer); the table cannot see the batch, so "
        "first-batch tuning decides",
    ),
    (
        "Keras' generic loop: fused",
        lambda r: r.keras_loop,
        lambda n: FUSED,
        "SimpleRNN 4x512 B64 T200 train 11.9x, RNN(LSTMCell) 14.9x; the "
        "persistent algorithm halves that at this width (7.5x, 8.2x)",
    ),
    (
        "float32, units <= 256: fused",
        lambda r: r.dtype == "float32" and r.units <= 256,
        lambda n: FUSED,
        "batch 8: LSTM train 1.01-1.05x, GRU 0.99x, inference 1.10-1.20x, "
        "SimpleRNN inference 6.7x (tune= finds 1.10-2.25x and 14.3x with "
        "the persistent algorithm)",
    ),
    (
        "float32 bidirectional: split in halves from 4 layers",
        lambda r: r.dtype == "float32" and r.bidirectional,
        lambda n: _halves(n) if n >= 4 else FUSED,
        "4x512 B32 T1000 train: split 2+2 1.33x, fused 1.18x; the "
        "persistent algorithm 0.89x",
    ),
    (
        "float32, units >= 512, 4 layers: split 2+2",
        lambda r: r.dtype == "float32" and not r.bidirectional and r.levels == 4,
        lambda n: _halves(n),
        "LSTM/GRU 4 layers, B32-64, T1000, units 512-1024: split 2+2 "
        "1.00-1.23x (train and inference), fused 0.97-1.02x, persistent "
        "0.29-0.58x",
    ),
    (
        "float32, units >= 512: per layer",
        lambda r: r.dtype == "float32" and not r.bidirectional,
        lambda n: PER_LAYER,
        "2 and 8 layers: fused 0.87-1.13x (GRU 8x512 B64 0.87x, LSTM 2x1024 "
        "B8 inference 0.93x); Keras' per-layer cuDNN is the safe choice",
    ),
    (
        "otherwise: fused",
        lambda r: True,
        lambda n: FUSED,
        "other dtypes: float64; mixed_bfloat16 fuses on rnnfuse's op with "
        "the standard algorithm (4x512 LSTM 141 ms vs Keras' 176 ms; in the "
        "user-view matrix the tuner chose persistent_dynamic in 2 of 4 "
        "bfloat16 cells, 1.00-1.08x through fit)",
    ),
]


def plan_for_regime(regime: Regime, num_layers: int | None = None) -> Plan:
    """The plan of the first rule in `RULES` that matches `regime`.

    Args:
        regime: what the table looks at.
        num_layers: Keras layers in the run (defaults to its levels).
    """
    n = num_layers if num_layers is not None else regime.levels
    for _name, predicate, plan, _evidence in RULES:
        if predicate(regime):
            return plan(n)
    return FUSED


def _keras_loop(group) -> bool:
    """Whether Keras runs some layer of `group` in its generic loop."""
    from rnnfuse.recurrent import keras_has_cudnn_path

    return not all(keras_has_cudnn_path(view) for view in group.views)


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
    """The plan the rule table gives `group` in `dtype`.

    The table was measured with TensorFlow's kernels. The torch backend
    fuses every run whole and makes its own call choice (one call, or one
    call per level where PyTorch's persistent kernels need single-layer
    calls). Under JAX, one multi-layer call measured 0.88x-1.62x against
    Keras' per-layer calls (bench/bench_jax.py), so without `tune=` the
    original layers stay; `tune=` fuses where it measures faster.
    """
    table = TABLES[get_backend().capabilities.plan_table]
    return table(group, dtype, training)


def _tensorflow_table(group, dtype: str, training: bool) -> Plan:
    return plan_for_regime(regime_of(group, dtype, training), len(group.layers))


# The static tables a backend can name (`Capabilities.plan_table`): the
# H200 rule table above (measured with TensorFlow's kernels), "fuse every
# run whole" and "keep Keras' layers".
TABLES: dict[str, Callable] = {
    "tensorflow": _tensorflow_table,
    "fused": lambda group, dtype, training: FUSED,
    "per_layer": lambda group, dtype, training: PER_LAYER,
}
