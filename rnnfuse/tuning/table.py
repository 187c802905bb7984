"""The static plan table: what to do with a group when nothing is timed.

Used by `optimize` without `tune=`, by the tuner without a GPU, and, with
`proven_only`, for a shape nothing can be timed on
(`rnnfuse.tuning.per_shape`). A group is reduced to a `Regime` (cell kind,
width, levels, directions, Keras' generic loop or not, dtype, mode, batch)
and the first rule of `RULES` that matches gives the plan. Each rule says
why, and whether its plan was slower than the original layers anywhere in
the measurements of docs/benchmarks.md (`proven` when not).

Example:
    >>> plan_for_regime(Regime("rnn_tanh", 512, 4, False, True, "float32", True)).name
    'fused'
    >>> plan_for_regime(Regime("lstm", 512, 4, False, False, "float16", True, batch=64)).name
    'fused @persistent_static+tc'
    >>> plan_for_regime(Regime("gru", 192, 6, False, False, "float16", True, batch=173), proven_only=True).name
    'per-layer'
    >>> plan_for_regime(Regime("gru", 1024, 4, False, False, "float32", True)).name
    'split 2+2'
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rnnfuse.backends import get_backend
from rnnfuse.plan import FUSED, PER_LAYER, Plan

__all__ = ["JAX_RULES", "KERNEL_RULE", "Regime", "RULES", "TABLES", "jax_plan_for_regime",
           "kernel_plan", "plan_for_regime", "static_plan", "static_source"]


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
    batch: int | None = None  # where known (a custom loop's shape)


PERSISTENT = "persistent_static+tc"


def _halves(n: int) -> Plan:
    return Plan((n // 2, n - n // 2)) if n >= 2 else FUSED


# (name, predicate, plan for a run of n layers, why, proven); first match wins.
# `proven`: it lost to the original layers nowhere in benchmarks.md's matrices
# (tests/test_table.py); only proven rules fuse a shape nothing can be timed on.
# float32 keeps cuDNN's standard algorithm (within 1e-5 of Keras'; persistent
# ones about 1e-4), float16 uses a persistent one.
RULES: list[tuple[str, Callable[[Regime], bool], Callable[[int], Plan], str, bool]] = [
    (
        "one LSTM/GRU layer on Keras' cuDNN path: per layer",
        lambda r: r.levels == 1 and not r.keras_loop,
        lambda n: PER_LAYER,
        "Keras' own call is one cuDNN call too: fusing gains only from an algorithm whose speed does not carry across batch sizes, so first-batch tuning decides",
        True,
    ),
    (
        "SimpleRNN inference: per layer",
        lambda r: r.kind in ("rnn_tanh", "rnn_relu") and not r.training,
        lambda n: PER_LAYER,
        "Keras XLA-compiles a SimpleRNN model's inference under jit_compile='auto', and the fused plans lost to that in every measured case",
        True,
    ),
    (
        "float16 at a batch of at most 16, or at most 64 unidirectional: "
        "fused, persistent algorithm",
        lambda r: r.dtype == "float16" and r.batch is not None
        and (r.batch <= 16 or (r.batch <= 64 and not r.bidirectional)),
        lambda n: Plan((n,), PERSISTENT),
        "won in training and inference at these batches; bidirectional stacks lost at larger ones",
        True,
    ),
    (
        "float16: fused, persistent algorithm",
        lambda r: r.dtype == "float16",
        lambda n: Plan((n,), PERSISTENT),
        "won in-sample; lost out of sample at large batches, where first-batch tuning decides",
        False,
    ),
    (
        "Keras' generic loop: fused",
        lambda r: r.keras_loop,
        lambda n: FUSED,
        "one cuDNN call against Keras' Python loop won in every measured case",
        True,
    ),
    (
        "float32, units <= 256: fused",
        lambda r: r.dtype == "float32" and r.units <= 256,
        lambda n: FUSED,
        "won in-sample at small batches; lost in part of the user-view matrix",
        False,
    ),
    (
        "float32 bidirectional training, 4 layers or more: split in halves",
        lambda r: r.dtype == "float32" and r.bidirectional and r.levels >= 4 and r.training,
        lambda n: _halves(n),
        "split in halves beat the whole run and the original layers in every measured case",
        True,
    ),
    (
        "float32 bidirectional: split in halves from 4 layers",
        lambda r: r.dtype == "float32" and r.bidirectional,
        lambda n: _halves(n) if n >= 4 else FUSED,
        "won in-sample; lost in one user-view inference case",
        False,
    ),
    (
        "float32, units >= 512, 4 layers: split 2+2",
        lambda r: r.dtype == "float32" and not r.bidirectional and r.levels == 4,
        lambda n: _halves(n),
        "split 2+2 matched or beat the original layers; the whole run and the persistent algorithm did not",
        True,
    ),
    (
        "float32, units >= 512: per layer",
        lambda r: r.dtype == "float32" and not r.bidirectional,
        lambda n: PER_LAYER,
        "fused calls ran within noise of Keras' per-layer cuDNN, or behind it",
        True,
    ),
    (
        "otherwise: fused",
        lambda r: True,
        lambda n: FUSED,
        "other dtypes (bfloat16 on rnnfuse's op); lost in part of the user-view matrix",
        False,
    ),
]


def plan_for_regime(regime: Regime, num_layers: int | None = None, proven_only: bool = False) -> Plan:
    """The plan of the first rule in `RULES` that matches `regime` (with
    `proven_only`, the original layers where that rule is not proven);
    `num_layers`: Keras layers in the run (default: its levels)."""
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


# (name, evidence) of the one rule that picks the wavefront kernel, before any table; proven.
KERNEL_RULE = (
    "half precision, unidirectional, 4 layers or more of 256-512 units, batch 32-128, T >= 500, "
    "unmasked, no absorbed Dropout, the kernel takes the whole stack: the wavefront kernel, "
    "for LSTM training and LSTM/GRU inference",
    "won every measured case of this regime: training through fit on every backend at LSTM "
    "4x512 B64 T1000, about 2x cuDNN's best plan, its gradients checked on the GPU; inference "
    "(torch, kernel alone) 1.5x-18.8x at LSTM/GRU 4x512 and 8x256, B32-B128",
)


def _masked(group) -> bool:
    """Whether some layer of `group` is called with a mask."""
    from rnnfuse.recurrent import called_with_mask

    return any(called_with_mask(view.layer) for view in getattr(group, "views", ()))


def _kernel_regime(group, dtype: str, training: bool, shape: tuple) -> bool:
    """Whether `group` at input `shape` is in `KERNEL_RULE`'s measured regime."""
    batch, steps = (int(d) for d in shape[:2])
    return (group.cell in (("lstm",) if training else ("lstm", "gru"))
            and not group.bidirectional and not group.proj_size
            and str(dtype) in ("float16", "bfloat16") and group.num_layers >= 4
            and 256 <= group.units <= 512 and 32 <= batch <= 128 and steps >= 500
            and not group.absorbed_dropout
            and not _masked(group))


def kernel_plan(group, dtype: str, training: bool, shape: tuple | None) -> Plan | None:
    """`KERNEL_RULE`'s plan for `group` at input `shape` (batch, steps, features),
    or None: out of its regime, or refused whole (`Backend.kernel_reason`).

    >>> from rnnfuse.report import FusionGroup
    >>> kernel_plan(FusionGroup(("a", "b"), "lstm", 512, 2, 512, False), "float16", True,
    ...             (64, 1000, 512)) is None   # two layers: not measured
    True
    """
    if (shape is None or len(shape) < 3 or any(d is None for d in shape[:3])
            or not _kernel_regime(group, dtype, training, shape)):
        return None
    backend = get_backend()
    caps = backend.capabilities
    if "wavefront" not in (caps.training_kernels if training else caps.inference_kernels):
        return None
    if backend.kernel_reason("wavefront", group, tuple(shape), training=training) is not None:
        return None
    return Plan((len(group.layers),), kernel="wavefront")


def static_plan(group, dtype: str, training: bool, batch: int | None = None,
                proven_only: bool = False, shape: tuple | None = None) -> Plan:
    """The plan the static rules give `group` in `dtype` (at `batch`, or input
    `shape` (batch, steps, features), where known; `proven_only`: only a plan
    that lost nowhere): `KERNEL_RULE` (with `shape`), then, where the
    original layers cannot run (`Backend.keras_path_fails`),
    `fused_where_keras_fails`, else the backend's table."""
    kernel = kernel_plan(group, dtype, training, shape)
    if kernel is not None:
        return kernel
    if shape and batch is None:
        batch = shape[0]
    backend = get_backend()
    if backend.keras_path_fails(group, str(dtype)) is not None:
        return fused_where_keras_fails(group, dtype, batch)
    table = TABLES[backend.capabilities.plan_table]
    return table(group, dtype, training, batch, proven_only)


def fused_where_keras_fails(group, dtype: str, batch: int | None) -> Plan:
    """One fused call; in float16 at a batch of at most 64, cuDNN's persistent
    algorithm where the core would run the standard one, 1.7-6x faster
    wherever measured (the tuned JAX matrices' timings).

    >>> from rnnfuse.report import FusionGroup
    >>> g = FusionGroup(("a", "b"), "lstm", 384, 2, 80, True)
    >>> [fused_where_keras_fails(g, "float16", b).name for b in (24, 256, None)]
    ['fused @persistent_static+tc', 'fused', 'fused']
    """
    from rnnfuse.backends.cuda.cudnn_core import prefers_small_h

    masked = _masked(group)
    if (str(dtype) == "float16" and batch is not None and batch <= 64 and not masked
            and not group.proj_size
            and not prefers_small_h(group.cell, group.units, group.proj_size, masked)):
        return Plan((len(group.layers),), PERSISTENT)
    return FUSED


def static_source(group, dtype: str, source: str = "static") -> str:
    """`source` for a static plan of `group`, with the reason where the
    backend fuses it because the original layers cannot run here
    ("static: <why>"), so `inspect` and `OptimizeResult.plans` say it.

    >>> from rnnfuse.report import FusionGroup
    >>> static_source(FusionGroup(("gru",), "gru", 4, 1, 3, False), "float32")
    'static'
    """
    why = get_backend().keras_path_fails(group, str(dtype))
    if why is None:
        return source
    return f"static: {why}" if source == "static" else f"{source}; {why}"


def _tensorflow_table(group, dtype, training, batch=None, proven_only=False) -> Plan:
    regime = regime_of(group, dtype, training, batch)
    return plan_for_regime(regime, len(group.layers), proven_only)


# JAX's rules, from the backend matrix; first match wins. Keras' JAX GRU always runs a lax.scan.
JAX_RULES: list[tuple[str, Callable[[Regime, bool], bool], Plan, str, bool]] = [
    (
        "a masked call: per layer",
        lambda r, masked: masked,
        PER_LAYER,
        "a masked LSTM 2x256 fused timed within 3% of Keras' layers",
        True,
    ),
    (
        "float32, bidirectional: per layer",
        lambda r, masked: r.dtype == "float32" and r.bidirectional,
        PER_LAYER,
        "cuDNN's standard algorithm lost to Keras' layers on both bidirectional stacks timed "
        "against them (BiGRU 5x160 float32 B10: fit 0.69x, predict 0.39x; BiGRU 5x512 float16: "
        "189.7 against 171.8 ms); the fused rules below were measured on unidirectional stacks",
        True,
    ),
    (
        "float32 SimpleRNN or RNN(cell) (Keras' generic lax.scan): fused",
        lambda r, masked: r.dtype == "float32" and r.keras_loop,
        FUSED,
        "one cuDNN call against Keras' lax.scan won in every measured case (SimpleRNN 3x256 B64: 4.7x)",
        True,
    ),
    (
        "float32 GRU of up to 128 units: fused",
        lambda r, masked: r.dtype == "float32" and r.kind == "gru" and r.units <= 128,
        FUSED,
        "one cuDNN call against Keras' lax.scan won wherever measured (GRU 3x64 B256: 3.8x)",
        True,
    ),
    (
        "float32 GRU over 128 units: per layer",
        lambda r, masked: r.dtype == "float32" and r.kind == "gru",
        PER_LAYER,
        "fused lost at GRU 3x416 B7 (fit 0.70x) and GRU 5x160 B43 (fit 0.67x, predict at B172 "
        "0.41x) and won at GRU 3x192 B64 (1.3x): first-batch tuning times it",
        True,
    ),
    (
        "float32 LSTM, units <= 256: fused",
        lambda r, masked: r.dtype == "float32" and r.units <= 256,
        FUSED,
        "won against jaxlib's cuDNN LSTM per layer in every measured case (1.3x-7.2x)",
        True,
    ),
    (
        "half precision where Keras runs a scan: fused",
        lambda r, masked: r.keras_loop or r.kind == "gru",
        FUSED,
        "the standard algorithm lost to Keras' scan where timed (BiGRU 5x512 float16 B32: 189.7 "
        "against 171.8 ms; persistent 86.3); first-batch tuning decides",
        False,
    ),
]


def _jax_table(group, dtype, training, batch=None, proven_only=False) -> Plan:
    """JAX, float32: fused where Keras scans a SimpleRNN or a narrow GRU, or
    an LSTM stack is small; else, or masked, the original layers (`JAX_RULES`).

    >>> from rnnfuse.report import FusionGroup
    >>> _jax_table(FusionGroup(("g0", "g1", "g2"), "gru", 64, 1, 3, False), "float32", True).name
    'fused'
    >>> _jax_table(FusionGroup(("l0", "l1"), "lstm", 1024, 1, 2, False), "float32", True).name
    'per-layer'
    """
    return jax_plan_for_regime(regime_of(group, dtype, training, batch), _masked(group), proven_only)


def jax_plan_for_regime(regime: Regime, masked: bool, proven_only: bool = False) -> Plan:
    """`JAX_RULES`' plan for `regime` and `masked`, as `plan_for_regime` gives `RULES`'.

    >>> jax_plan_for_regime(Regime("gru", 160, 5, True, False, "float32", True, batch=10), False).name
    'per-layer'
    """
    for _name, predicate, plan, _evidence, proven in JAX_RULES:
        if predicate(regime, masked):
            return plan if proven or not proven_only else PER_LAYER
    return PER_LAYER


def _torch_table(group, dtype, training, batch=None, proven_only=False) -> Plan:
    """torch: every run fused; proven only where Keras runs its generic loop
    (or a masked call): on its cuDNN path the core's call lost to Keras'
    per-layer calls on small float32 stacks and in half precision."""
    if _keras_loop(group) or _masked(group):
        return FUSED
    return PER_LAYER if proven_only else FUSED


# The static tables a backend can name (`Capabilities.plan_table`).
TABLES: dict[str, Callable] = {
    "tensorflow": _tensorflow_table,
    "torch": _torch_table,
    "jax": _jax_table,
    "fused": lambda group, dtype, training, batch=None, proven_only=False: FUSED,
    "per_layer": lambda group, dtype, training, batch=None, proven_only=False: PER_LAYER,
}
