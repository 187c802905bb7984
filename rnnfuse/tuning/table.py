"""The static plan table: what to do with a group when nothing is timed.

Used by `optimize` without `tune=` (and by the tuner when there is no GPU),
and, with `proven_only`, for a shape nothing can be timed on
(`rnnfuse.tuning.per_shape`: a custom loop's trace in XLA, for one). A group
is reduced to a `Regime` (cell kind, width, levels, directions, whether
Keras runs it in its generic loop, dtype, training or inference, and the
batch size where it is known) and the first rule of `RULES` that matches
gives the plan. Each rule cites the measurements behind it (TF 2.21,
cuDNN 9.19; the full matrix is in docs/benchmarks.md, produced by
bench/bench_tf.py, and the user-view matrix, bench/bench_user_view.py) and
says whether its plan was slower than the original layers anywhere in them
(`proven` when not).

Example:

    >>> plan_for_regime(Regime("rnn_tanh", 512, 4, False, True, "float32", True)).name
    'fused'
    >>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True, batch=64)).name
    'fused @persistent_static+tc'
    >>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True)).name  # batch unknown
    'fused @persistent_static+tc'
    >>> plan_for_regime(Regime("gru", 192, 6, False, False, "float16", True, batch=173), proven_only=True).name
    'per-layer'
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
    # The batch size, where it is known (a custom loop's shape); None.
    batch: int | None = None


PERSISTENT = "persistent_static+tc"


def _halves(n: int) -> Plan:
    return Plan((n // 2, n - n // 2)) if n >= 2 else FUSED


# (name, predicate, plan for a run of n layers, evidence, proven). First
# match wins. Evidence: speedup over the original model (TF 2.21,
# cuDNN 9.19, docs/benchmarks.md): bench/results/tf_h200.json (26 cells, in-sample, the matrix
# the rules were fitted to) and the user-view matrix
# (bench/results/user_view_tf_h200_*.json: the training and inference
# decisions timed by first-batch tuning through fit and predict, out of
# sample). `proven`: the rule's plan was slower than the original layers in
# none of them (tests/test_table.py checks the user-view ones). Where
# nothing can be timed for a shape (`rnnfuse.tuning.per_shape`: a custom
# loop's trace in XLA, a batch size left open), only proven rules fuse
# (`static_plan(..., proven_only=True)`); elsewhere the original layers
# stay. The unproven rules, fitted in-sample, fused in the user-view matrix
# where the original layers were faster: float32 units <= 256 (17 of 32
# decisions, 0.64-0.98x), other dtypes (bfloat16: 13 of 40, 0.68-0.98x),
# float16 past batch 64 (0.23-0.35x at batch 173); optimize(model,
# tune=False) still uses them, and with tune="auto" (the default) a GPU
# times the real shapes instead.
#
# Exactness first: in float32 the table keeps TensorFlow's default cuDNN
# algorithm, whose fused results match Keras' per-layer path within 1e-5.
# cuDNN's persistent algorithm is faster for small float32 stacks (batch 8,
# 256 units: 1.10-2.25x against 0.99-1.20x fused with the default) and
# as accurate against a float64 reference, but its float32 results differ
# from Keras' by about 1e-4; `tune=` may pick it. In float16 (tolerance
# 1e-2) the table uses it.
RULES: list[tuple[str, Callable[[Regime], bool], Callable[[int], Plan], str, bool]] = [
    (
        "one LSTM/GRU layer on Keras' cuDNN path: per layer",
        lambda r: r.levels == 1 and not r.keras_loop,
        lambda n: PER_LAYER,
        "bench/bench_single_layers.py through fit: Keras' own call is one "
        "cuDNN call as well, so the "
        "fused call gains only from the algorithm. 1x512 B64 T1000 fp16: "
        "the standard algorithm fused 37.3 ms (LSTM) / 36.1 (GRU) a step "
        "against Keras' 38.5 / 37.4, persistent_static 19.2 / 20.6, so fit "
        "ran 1.42x / 1.41x where it was timed; float32 seq2seq (B64, T16 "
        "and 59) and forecaster (B64 T168) layers: 0.94-1.14x, fit 1.01-"
        "1.02x. A persistent algorithm's speed does not carry across batch "
        "sizes and the standard one gains nothing, so untimed, the "
        "original layer; first-batch tuning (tune='auto' on a GPU) decides",
        True,
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
        True,
    ),
    (
        "float16 at a batch of at most 16, or at most 64 unidirectional: "
        "fused, persistent algorithm",
        lambda r: r.dtype == "float16" and r.batch is not None
        and (r.batch <= 16 or (r.batch <= 64 and not r.bidirectional)),
        lambda n: Plan((n,), PERSISTENT),
        "user-view matrix, batch 2-64: 1.49-5.31x in training and "
        "1.61-7.77x in inference (LSTM 4x512 B64, bi-LSTM 4x736 B7 and "
        "3x448 B2, bi-GRU 5x224 B13, 3x192 B2, 5x256 B13; SimpleRNN "
        "training 1.95x, 2.62x); in-sample batch 8-64 1.14-2.42x. At 4x the "
        "fit batch bidirectional stacks lost (bi-LSTM 4x736 inference at batch 28: "
        "persistent_static 106.8 ms against 57.6 per layer, 0.54x, where "
        "batch 7 ran 1.82x; bi-GRU 5x224 at batch 52: 0.90x, batch 13 "
        "1.82x); unidirectional batch 33-64: LSTM 4x512 B64 1.49-2.32x, "
        "SimpleRNN training B33-41 1.95-2.62x",
        True,
    ),
    (
        "float16: fused, persistent algorithm",
        lambda r: r.dtype == "float16",
        lambda n: Plan((n,), PERSISTENT),
        "mixed_float16: LSTM/GRU train 1.14-1.59x (bidirectional GRU 1.58x), "
        "inference 2.42x; the default fused plan gave 0.84-1.26x. SimpleRNN "
        "and RNN(LSTMCell) 9.3x and 17.1x. Out of sample (user-view matrix, "
        "docs/benchmarks.md): right at batch 2-64 (the rule above), 3x "
        "wrong at batch 173 (GRU 6x192: 0.35x training, 0.23x inference); "
        "where the batch is unknown, first-batch tuning decides",
        False,
    ),
    (
        "Keras' generic loop: fused",
        lambda r: r.keras_loop,
        lambda n: FUSED,
        "SimpleRNN 4x512 B64 T200 train 11.9x, RNN(LSTMCell) 14.9x; the "
        "persistent algorithm halves that at this width (7.5x, 8.2x); in the "
        "user-view matrix 1.5-2.7x in every training decision",
        True,
    ),
    (
        "float32, units <= 256: fused",
        lambda r: r.dtype == "float32" and r.units <= 256,
        lambda n: FUSED,
        "batch 8: LSTM train 1.01-1.05x, GRU 0.99x, inference 1.10-1.20x, "
        "SimpleRNN inference 6.7x (tune= finds 1.10-2.25x and 14.3x with "
        "the persistent algorithm); user-view matrix: 0.64-0.98x in 17 of "
        "32 decisions (GRU 3x96 B66 masked 0.64x)",
        False,
    ),
    (
        "float32 bidirectional training, 4 layers or more: split in halves",
        lambda r: r.dtype == "float32" and r.bidirectional and r.levels >= 4 and r.training,
        lambda n: _halves(n),
        "4x512 B32 T1000 train: split 2+2 1.33x, fused 1.18x; the "
        "persistent algorithm 0.89x; user-view matrix, training: 1.02-1.35x "
        "in all 3 decisions",
        True,
    ),
    (
        "float32 bidirectional: split in halves from 4 layers",
        lambda r: r.dtype == "float32" and r.bidirectional,
        lambda n: _halves(n) if n >= 4 else FUSED,
        "4x512 B32 T1000 inference 1.3x; user-view matrix: bi-GRU 5x160 B10 "
        "inference 0.93x",
        False,
    ),
    (
        "float32, units >= 512, 4 layers: split 2+2",
        lambda r: r.dtype == "float32" and not r.bidirectional and r.levels == 4,
        lambda n: _halves(n),
        "LSTM/GRU 4 layers, B32-64, T1000, units 512-1024: split 2+2 "
        "1.00-1.23x (train and inference), fused 0.97-1.02x, persistent "
        "0.29-0.58x",
        True,
    ),
    (
        "float32, units >= 512: per layer",
        lambda r: r.dtype == "float32" and not r.bidirectional,
        lambda n: PER_LAYER,
        "2 and 8 layers: fused 0.87-1.13x (GRU 8x512 B64 0.87x, LSTM 2x1024 "
        "B8 inference 0.93x); Keras' per-layer cuDNN is the safe choice",
        True,
    ),
    (
        "otherwise: fused",
        lambda r: True,
        lambda n: FUSED,
        "other dtypes: float64; mixed_bfloat16 fuses on rnnfuse's op with "
        "the standard algorithm (4x512 LSTM 141 ms vs Keras' 176 ms; in the "
        "user-view matrix 0.68-0.98x in 13 of 40 decisions: bi-LSTM 3x320 B6 "
        "0.68x)",
        False,
    ),
]


def plan_for_regime(regime: Regime, num_layers: int | None = None, proven_only: bool = False) -> Plan:
    """The plan of the first rule in `RULES` that matches `regime`.

    Args:
        regime: what the table looks at.
        num_layers: Keras layers in the run (defaults to its levels).
        proven_only: where that rule is not proven (its plan measured slower
            than the original layers somewhere), the original layers.
    """
    n = num_layers if num_layers is not None else regime.levels
    for _name, predicate, plan, _evidence, proven in RULES:
        if predicate(regime):
            return plan(n) if proven or not proven_only else PER_LAYER
    return PER_LAYER


def _keras_loop(group) -> bool:
    """Whether Keras runs some layer of `group` in its generic loop."""
    from rnnfuse.recurrent import keras_has_cudnn_path

    return not all(keras_has_cudnn_path(view) for view in group.views)


def regime_of(group, dtype: str, training: bool, batch: int | None = None) -> Regime:
    return Regime(
        kind=group.cell,
        units=group.units,
        levels=group.num_layers,
        bidirectional=group.bidirectional,
        keras_loop=_keras_loop(group),
        dtype=str(dtype),
        training=bool(training),
        batch=None if batch is None else int(batch),
    )


def static_plan(group, dtype: str, training: bool, batch: int | None = None,
                proven_only: bool = False) -> Plan:
    """The plan the rule table gives `group` in `dtype` (at `batch`, where
    it is known; with `proven_only`, only a plan that lost in none of the
    table's measurements, else the original layers).

    The TensorFlow table was measured with TensorFlow's kernels. The torch
    table fuses where fusing never measured slower (Keras' Python loops,
    float32) and keeps Keras' layers in half precision (fused 0.84-0.99x
    in 9 of the user-view matrix's torch decisions); torch makes its own
    call choice (one call, or one call per level where PyTorch's persistent
    kernels need single-layer calls). Under JAX, one multi-layer call
    measured 0.88x-1.62x against Keras' per-layer calls (bench/bench_jax.py),
    so without `tune=` the original layers stay; `tune=` fuses where it
    measures faster.
    """
    table = TABLES[get_backend().capabilities.plan_table]
    return table(group, dtype, training, batch, proven_only)


def _tensorflow_table(group, dtype, training, batch=None, proven_only=False) -> Plan:
    regime = regime_of(group, dtype, training, batch)
    return plan_for_regime(regime, len(group.layers), proven_only)


def _torch_table(group, dtype, training, batch=None, proven_only=False) -> Plan:
    """torch: every run fused; proven only outside half precision on
    Keras' cuDNN path (user-view matrix, torch: fused 0.84-0.99x in 9
    half-precision decisions; Keras' Python loops 14-48x)."""
    if proven_only and str(dtype) in ("float16", "bfloat16") and not _keras_loop(group):
        return PER_LAYER
    return FUSED


# The static tables a backend can name (`Capabilities.plan_table`): the
# rule table above (measured with TensorFlow's kernels), torch's,
# "fuse every run whole" and "keep Keras' layers".
TABLES: dict[str, Callable] = {
    "tensorflow": _tensorflow_table,
    "torch": _torch_table,
    "fused": lambda group, dtype, training, batch=None, proven_only=False: FUSED,
    "per_layer": lambda group, dtype, training, batch=None, proven_only=False: PER_LAYER,
}
