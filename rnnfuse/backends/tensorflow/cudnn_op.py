"""Python side of rnnfuse's own cuDNN RNN op (csrc/rnnfuse_cudnn_rnn.cc, a
thin TensorFlow wrapper over the cuDNN core, cuda/csrc/cudnn_rnn_core.h).

`run_op` calls `RnnfuseCudnnRnn` on time-major data with `pack_params`'s
flat buffer; its gradient runs `RnnfuseCudnnRnnBackprop` with the same
attributes and the forward's `algorithm` input, so both passes run one
algorithm. The algorithm is an int32 input (`algorithm_code`), not an
attribute, so one traced graph can run every algorithm (the tuner's
`timed_steps`). Arguments are checked here, naming the argument; what
cuDNN refuses comes back as a `tf.errors.OpError`.

Example (with a GPU and the op built):

    >>> module = op_build.load_op()  # doctest: +SKIP
    >>> y, h, c = run_op(module, x, h0, c0, params, lengths, kind="lstm",
    ...                  num_layers=2, num_directions=1, units=8,
    ...                  input_size=3)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from rnnfuse.backends.base import GATES
from rnnfuse.plan import ALGORITHM_NAMES, Algorithm

__all__ = [
    "OP_DTYPES",
    "AlgorithmInput",
    "algorithm_code",
    "call_op",
    "decode_algorithm_code",
    "flat_size",
    "math_type_for",
    "op_unsupported_reason",
    "register_gradient",
    "run_op",
]

OP_DTYPES = ("float16", "bfloat16", "float32")
_KINDS = tuple(GATES)
# The attributes both ops share (the gradient copies them from the forward).
SHARED_ATTRS = (
    "rnn_mode",
    "direction",
    "num_layers",
    "num_units",
    "proj_size",
    "input_size",
    "dropout",
    "seed",
)
# The op's math types, in the order of the code's low two bits.
_MATHS = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")


def flat_size(kind: str, num_layers: int, num_directions: int, units: int,
              input_size: int, proj_size: int = 0) -> int:
    """Elements of the canonical flat buffer (see the C++ source's header)."""
    g, h, r = GATES[kind], units, proj_size or units
    total = 0
    for p in range(num_layers * num_directions):
        n = input_size if p < num_directions else num_directions * r
        total += g * h * n + g * h * r + proj_size * h + 2 * g * h
    return total


def op_unsupported_reason(dtype: Any, dropout: float = 0.0) -> str | None:
    """Why the op cannot run this call (then CudnnRNNV3 runs), or None."""
    name = tf.as_dtype(dtype).name
    if name not in OP_DTYPES:
        return f"rnnfuse's cuDNN op runs float16, bfloat16 and float32, not {name}"
    if not 0.0 <= dropout < 1.0:
        return f"rnnfuse's cuDNN op runs between-layer dropout below 1, not {dropout:g}"
    return None


def math_type_for(algorithm: Algorithm, dtype: Any) -> str:
    """The cuDNN math type for `algorithm` in `dtype`: "fma" for float32
    with TF32 off (IEEE float32, as Keras' own call), tensor ops for half
    types unless asked otherwise."""
    name = tf.as_dtype(dtype).name
    if name == "float32" and not tf.config.experimental.tensor_float_32_execution_enabled():
        return "fma"
    if name in ("float16", "bfloat16") and algorithm.math == "default":
        return "tensor_op"
    return algorithm.math


def algorithm_code(algorithm: Algorithm | None, dtype: Any) -> int:
    """The op's `algorithm` input for `algorithm` in `dtype`: 4 * algo +
    math, the math as `math_type_for` picks it (see the C++ header).

    >>> algorithm_code(Algorithm.parse("persistent_dynamic+tc"), "float16")
    9
    >>> decode_algorithm_code(algorithm_code(None, "bfloat16"))
    ('standard', 'tensor_op')"""
    algorithm = algorithm or Algorithm()
    return 4 * algorithm.algo + _MATHS.index(math_type_for(algorithm, dtype))


def decode_algorithm_code(code: int) -> tuple[str, str]:
    """(cuDNN algorithm name, math type) of an `algorithm_code`."""
    code = int(code)
    return ALGORITHM_NAMES[code // 4], _MATHS[code % 4]


class AlgorithmInput:
    """The op's `algorithm` input as a variable: a step traced once runs the
    algorithm `set` chose last, so plans that differ only in it share that
    trace (the online race switches by assigning). An int32 scalar on the
    host, which the op's HostMemory input reads without a device copy.

    >>> chosen = AlgorithmInput()
    >>> chosen.set(Algorithm.parse("persistent_static"), "float16")
    >>> decode_algorithm_code(int(chosen.tensor()))
    ('persistent_static', 'tensor_op')
    """

    def __init__(self):
        with tf.init_scope(), tf.device("/CPU:0"):
            self.variable = tf.Variable(algorithm_code(None, "float32"), dtype=tf.int32,
                                        trainable=False, name="rnnfuse_cudnn_algorithm")

    def set(self, algorithm: Algorithm | None, dtype: Any) -> None:
        """Later runs of steps that read this input run `algorithm` in `dtype`."""
        self.variable.assign(algorithm_code(algorithm, dtype))

    def tensor(self):
        """The value for `StackCall.algorithm` (read when the step runs)."""
        return self.variable.read_value()


def _module():
    from rnnfuse.backends.tensorflow import op_build

    module = op_build.load_op()
    if module is None:
        raise NotImplementedError(f"rnnfuse's cuDNN op is not loaded: {op_build.load_failure()}")
    return module


def call_op(module, **kwargs):
    """`RnnfuseCudnnRnn` (one module-level name so tests can spy on it)."""
    return module.rnnfuse_cudnn_rnn(**kwargs)


def run_op(
    module,
    x,
    h,
    c,
    params,
    lengths,
    *,
    kind: str,
    num_layers: int,
    num_directions: int,
    units: int,
    input_size: int,
    proj_size: int = 0,
    algorithm: Algorithm | None = None,
    dropout: float = 0.0,
    seed: int = 0,
    is_training: bool = True,
    code: Any = None,
):
    """One `RnnfuseCudnnRnn` call; returns (outputs [T, B, D*R], h, c).

    Args:
        module: the loaded op module (`op_build.load_op()`).
        x: time-major input [T, B, input_size].
        h: initial h [L*D, B, R] (R = proj_size or units).
        c: initial c [L*D, B, units] for an LSTM, else an empty tensor.
        params: canonical flat parameters.
        lengths: int32 [B] sequence lengths, each in [1, T].
        dropout: cuDNN's dropout before every level but the first (with
            `is_training`), seeded once per (GPU, dropout, seed).
        code: an int32 scalar tensor passed as the op's `algorithm` input
            instead of `algorithm_code(algorithm, dtype)`.

    Raises:
        ValueError: an argument the op would reject, named."""
    dtype = _checked_dtype(x, h, c, params, kind, num_layers, num_directions, units,
                           input_size, proj_size, dropout)
    if code is None:
        code = tf.constant(algorithm_code(algorithm, dtype), tf.int32)
    outputs, final_h, final_c, _ = call_op(
        module,
        input=x,
        input_h=h,
        input_c=c,
        params=params,
        sequence_lengths=tf.cast(lengths, tf.int32),
        algorithm=code,
        rnn_mode=kind,
        direction="bidirectional" if num_directions == 2 else "unidirectional",
        num_layers=int(num_layers),
        num_units=int(units),
        proj_size=int(proj_size),
        input_size=int(input_size),
        dropout=float(dropout),
        seed=int(seed),
        is_training=bool(is_training),
    )
    return outputs, final_h, final_c


def _checked_dtype(x, h, c, params, kind, num_layers, num_directions, units, input_size,
                   proj_size, dropout) -> tf.DType:
    """`run_op`'s argument checks; returns the input's dtype.

    Raises:
        ValueError: an argument the op would reject, named."""
    if kind not in _KINDS:
        raise ValueError(f"run_op: kind must be one of {_KINDS}; received {kind!r}")
    if num_directions not in (1, 2):
        raise ValueError(f"run_op: num_directions must be 1 or 2; received {num_directions}")
    if proj_size and (kind != "lstm" or not 0 < proj_size < units):
        raise ValueError(
            f"run_op: proj_size={proj_size} needs kind='lstm' and 0 < proj_size < units "
            f"({units}); received kind={kind!r}"
        )
    dtype = tf.as_dtype(x.dtype)
    reason = op_unsupported_reason(dtype, dropout)
    if reason is not None:
        raise ValueError(f"run_op: {reason}")
    for name, t in (("h", h), ("c", c), ("params", params)):
        if tf.as_dtype(t.dtype) != dtype:
            raise ValueError(
                f"run_op: {name} has dtype {tf.as_dtype(t.dtype).name}; the input is {dtype.name}"
            )
    if x.shape.rank is not None and x.shape.rank != 3:
        raise ValueError(f"run_op: x must be [time, batch, features]; received shape {x.shape}")
    if x.shape.rank == 3 and x.shape[-1] is not None and x.shape[-1] != input_size:
        raise ValueError(
            f"run_op: x has {x.shape[-1]} features; input_size is {input_size}"
        )
    expected = flat_size(kind, num_layers, num_directions, units, input_size, proj_size)
    if params.shape.rank == 1 and params.shape[0] is not None and params.shape[0] != expected:
        raise ValueError(
            f"run_op: params has {params.shape[0]} elements; this stack needs {expected}"
        )
    return dtype


def _gradient(op, d_output, d_h, d_c, _d_reserve):
    """RnnfuseCudnnRnn's gradient: the backprop op with the same attributes."""
    if not op.get_attr("is_training"):
        raise ValueError(
            "RnnfuseCudnnRnn ran with is_training=False (no reserve space); "
            "it has no gradient. Fix: call it with is_training=True"
        )
    x, h, c, params, lengths, algorithm = op.inputs
    output, out_h, out_c, reserve = op.outputs
    d_output = tf.zeros_like(output) if d_output is None else d_output
    d_h = tf.zeros_like(out_h) if d_h is None else d_h
    d_c = tf.zeros_like(out_c) if d_c is None else d_c
    attrs = {name: op.get_attr(name) for name in SHARED_ATTRS}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    dx, dh, dc, dparams = _module().rnnfuse_cudnn_rnn_backprop(
        input=x,
        input_h=h,
        input_c=c,
        params=params,
        sequence_lengths=lengths,
        output=output,
        output_backprop=d_output,
        output_h_backprop=d_h,
        output_c_backprop=d_c,
        reserve_space=reserve,
        algorithm=algorithm,
        **attrs,
    )
    return dx, dh, dc, dparams, None, None


@functools.cache  # memo: TensorFlow's gradient registry is process-wide
def register_gradient() -> None:
    """Registers `_gradient` for RnnfuseCudnnRnn (once per process)."""
    try:
        tf.RegisterGradient("RnnfuseCudnnRnn")(_gradient)
    except KeyError:  # already registered (module reloaded)
        pass


# Gradients are registered by op type name, so this holds before the library
# is loaded (op_build loads it; this module calls it, not the other way).
register_gradient()
