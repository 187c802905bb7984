"""TensorFlow backend: a whole stack as one cuDNN call.

Kernels: rnnfuse's op `RnnfuseCudnnRnn` (`cudnn_op`, loaded on first GPU
use): the plan's algorithm in both passes, projections, bfloat16, dropout;
`tf.raw_ops.CudnnRNNV3` without the op and for "stock" (standard algorithm
only); `wavefront_op` for "wavefront". `StackRun.kernel` says which ran.

The flat buffer is built on every call from the Keras variables, so
gradients reach them, in cuDNN's canonical order:

    flat = W(p0) ++ W(p1) ++ ... ++ B(p0) ++ B(p1) ++ ...

over pseudo-layers (level 0, fwd), (level 0, bwd), (level 1, fwd), ... .
For input width `n` (input_size at level 0, R * directions above), H = units:

- lstm: W = [W_i, W_f, W_c, W_o, R_i, R_f, R_c, R_o], each [H, n] (R: [H, H])
  flattened row-major; B = [0] * 4H ++ Keras' bias (i, f, c, o).
- gru (reset_after=True): Keras' (z, r, h) -> cuDNN's (r, z, h) in W, R and
  both rows of Keras' (2, 3H) bias (cuDNN's input and recurrent biases).
- rnn_tanh / rnn_relu: W = [W, R]; B = [0] * H ++ Keras' bias.
- lstm with projection P (rnnfuse's op only): R_i..R_o are [H, P], then
  M_proj [P, H]; B as for lstm.

Sizes: weights G*H*(n + R) + P*H, biases 2*G*H per pseudo-layer, G = 4, 3,
1, R = P or H (P = 0 without projection). A level reading a Bidirectional
merged by "sum" or "ave" packs its kernel as [s*W; s*W], s = 1 or 1/2.
States are [levels * directions, B, H]. `CudnnRNNCanonicalToParams` is not
used: it aborts the process on flat per-gate weights.

Example (on a machine with a GPU):

    >>> import keras
    >>> from rnnfuse.backends.base import StackSpec
    >>> cells = ((keras.layers.GRUCell(4),),)
    >>> cells[0][0].build((None, 3))
    >>> int(pack_params(StackSpec("gru", 4, cells), "float32").shape[0])
    108
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Sequence

import keras
import tensorflow as tf

from rnnfuse.backends.base import TUNED_ALGORITHMS as OP_TUNED_ALGORITHMS
from rnnfuse.backends.base import (GATES, StackCall, StackRun, StackSpec,
                                   canonical_pieces, run_or_fall_back)
from rnnfuse.backends.tensorflow import cudnn_op, op_build
from rnnfuse.plan import Algorithm
from rnnfuse.reasons import KernelRun

__all__ = [
    "KERNELS",
    "concrete_bool",
    "device_environment",
    "in_xla_context",
    "is_available",
    "kernel_reason",
    "mask_is_supported",
    "pack_params",
    "run_stack",
    "timed_step",
    "timed_steps",
    "tuned_algorithms",
    "unsupported_reason",
]

SUPPORTED_DTYPES = ("float16", "float32", "float64")
KERNELS = ("cudnn", "stock", "wavefront")
logger = logging.getLogger("rnnfuse")



def tuned_algorithms() -> tuple:
    """OP_TUNED_ALGORITHMS with rnnfuse's op loaded, else the standard only."""
    return OP_TUNED_ALGORITHMS if op_loaded() else (None,)


def op_loaded() -> bool:
    """Whether rnnfuse's own cuDNN op is loaded (builds it on first use);
    `RNNFUSE_DISABLE_OP=1` keeps it off."""
    return is_available() and not op_build.disabled() and op_build.load_op() is not None


def is_available() -> bool:
    """Whether CudnnRNNV3 can run here: a CUDA build and a visible GPU."""
    return bool(tf.config.list_logical_devices("GPU")) and tf.test.is_built_with_cuda()


def device_environment() -> dict:
    """The GPU and library versions a tuned plan depends on (memoized: read
    on every `fit`/`predict`)."""
    gpus = tf.config.list_physical_devices("GPU")
    return {
        "device": _gpu_name(gpus[0]) if gpus else "cpu",
        "tensorflow": tf.__version__,
        "cudnn": _cudnn_version(),
    }


@functools.lru_cache(maxsize=None)
def _gpu_name(gpu: Any) -> str:
    """The name of `gpu`, a `tf.config.PhysicalDevice` ("NVIDIA ...")."""
    return tf.config.experimental.get_device_details(gpu).get("device_name", "gpu")


@functools.lru_cache(maxsize=None)
def _cudnn_version() -> str:
    """The cuDNN version this TensorFlow was built with ("9", "?")."""
    return str(tf.sysconfig.get_build_info().get("cudnn_version", "?"))


def _step_body(run, x, variables, training):
    """The traced body of a tuner step: forward (+ gradients); a scalar."""
    if not training:
        y = run(x, False)
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y)])
    y = run(x, True)
    loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(t, tf.float32))) for t in tf.nest.flatten(y)])
    grads = graph_gradients(loss, variables)
    return loss + tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) * 0.0 for g in grads])


def graph_gradients(loss, variables: Sequence[Any]) -> list:
    """`tf.gradients` of `loss` for Keras or TensorFlow `variables` inside a
    `tf.function`; zeros for a variable the loss does not read. Not a tape:
    the tuner may time inside a user's traced step through `tf.init_scope`,
    which stops every tape on the thread.

    >>> import keras
    >>> v = keras.Variable(3.0)
    >>> [float(g) for g in tf.function(lambda: graph_gradients(v * v, [v]))()]
    [6.0]"""
    handles = [getattr(v, "value", v) if isinstance(v, keras.Variable) else v for v in variables]
    return tf.gradients(loss, handles, unconnected_gradients=tf.UnconnectedGradients.ZERO)


def timed_step(run, x, variables: Sequence[Any], training: bool, jit: bool = False):
    """A compiled step of `run(x, training)` (+ gradients) for the tuner,
    giving a scalar; `jit`: with XLA. No AutoGraph, so the graph is `fit`'s."""

    @tf.function(jit_compile=bool(jit), autograph=False)
    def step():
        return _step_body(run, x, variables, training)

    return _with_trace(lambda: step(), step.get_concrete_function)


def _with_trace(call, trace):
    """`call` with a `trace()` that traces its `tf.function` without running it
    (the tuner traces and makes first calls on different threads).

    >>> f = tf.function(lambda: tf.constant(1.0))
    >>> step = _with_trace(lambda: f(), f.get_concrete_function)
    >>> _ = step.trace(); float(step()), f.experimental_get_tracing_count()
    (1.0, 1)"""
    call.trace = trace
    return call


def timed_steps(make_run, x, variables: Sequence[Any], training: bool,
                algorithms: Sequence[Any], dtype: Any) -> dict | None:
    """{algorithm: step} as `timed_step` gives them, all on ONE traced
    function whose int32 input (`cudnn_op.algorithm_code`) the fused calls
    hand to the op; None (`make_run` not called) where the op is not loaded."""
    if not op_loaded():
        return None
    run = make_run()

    @tf.function(autograph=False)
    def step(code):
        return _step_body(lambda x, t: run(x, t, algorithm=code), x, variables, training)

    codes = {
        a: tf.constant(cudnn_op.algorithm_code(None if a is None else Algorithm.parse(a), dtype),
                       tf.int32)
        for a in algorithms
    }
    return {
        a: _with_trace(lambda c=c: step(c), lambda c=c: step.get_concrete_function(c))
        for a, c in codes.items()
    }


def unsupported_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why this backend cannot run `stack` in `dtype`, or None. bfloat16 and
    projections need rnnfuse's op: CudnnRNNV3 upcasts the one, rejects the other."""
    dtype = str(dtype)
    needs_op = dtype == "bfloat16" or stack.proj_size
    if needs_op and dtype in cudnn_op.OP_DTYPES:
        if op_loaded():
            return None
        why = (
            "RNNFUSE_DISABLE_OP is set" if op_build.disabled() else op_build.load_failure() or "no GPU visible"
        )
        what = "bfloat16" if dtype == "bfloat16" else "an LSTM projection"
        return (
            f"{what} needs rnnfuse's cuDNN op, which is not loaded ({why}); "
            "the original layers run instead"
        )
    if dtype not in SUPPORTED_DTYPES:
        return (
            f"TensorFlow's cuDNN RNN runs float16, bfloat16 (rnnfuse's op), float32 "
            f"and float64, not {dtype}; the original layers run instead"
        )
    return None


def kernel_reason(kernel: str, group: Any, shape: tuple, training: bool = False) -> str | None:
    """Why plan kernel `kernel` cannot run `group`'s inference (with
    `training`: training) calls at input `shape` here, or None (the
    wavefront ops' checks; bidirectional: `wavefront_bidirectional`)."""
    if kernel != "wavefront":
        return f"the TensorFlow backend has no {kernel!r} kernel to time"
    from rnnfuse.backends.tensorflow import wavefront_bidirectional, wavefront_op

    batch, steps, features = (int(d) for d in shape[:3])
    if group.bidirectional:
        return wavefront_bidirectional.unsupported_reason(
            group.cell, group.num_layers, group.units, group.dtype, batch, steps, features,
            training=training, proj_size=group.proj_size)
    check = wavefront_op.training_reason if training else wavefront_op.unsupported_reason
    return check(group.cell, group.num_layers, group.units, batch, steps, features, group.dtype,
                 proj_size=group.proj_size)


def mask_is_supported(mask: Any) -> tf.Tensor:
    """True when `mask` [B, T] is right-padded and no sequence is empty."""
    mask = tf.cast(mask, tf.bool)
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    right_padded = tf.sequence_mask(lengths, maxlen=tf.shape(mask)[1])
    return tf.logical_and(
        tf.reduce_all(tf.equal(mask, right_padded)),
        tf.reduce_all(lengths > 0),
    )


# Keras' own message (keras/src/backend/tensorflow/rnn.py, `_assert_valid_mask`).
MASK_NOT_SUPPORTED = (
    "You are passing a RNN mask that does not correspond to right-padded sequences, "
    "while using cuDNN, which is not supported. With cuDNN, RNN masks can only be used "
    "for right-padding, e.g. `[[True, True, False, False]]` would be a valid mask, but "
    "any mask that isn't just contiguous `True`'s on the left and contiguous `False`'s "
    "on the right would be invalid. You can pass `use_cudnn=False` to your RNN layer to "
    "stop using cuDNN (this may be slower)."
)


def assert_mask_supported(supported: tf.Tensor) -> None:
    """Fails the traced step at run time where `supported` is False, as
    Keras' traced cuDNN LSTM/GRU do.

    >>> f = tf.function(lambda m: (assert_mask_supported(mask_is_supported(m)), 0)[1])
    >>> int(f(tf.constant([[True, False]])))
    0
    >>> f(tf.constant([[False, True]]))
    Traceback (most recent call last):
    ...
    tensorflow.python.framework.errors_impl.InvalidArgumentError: ..."""
    tf.debugging.Assert(supported, [MASK_NOT_SUPPORTED])


def _cell_params(kind: str, cell: Any, dtype: str, input_scale: float | None = None) -> tuple[list, list]:
    """(weights, biases) of one pseudo-layer in cuDNN order; `input_scale`
    packs the input kernel doubled, [s*W; s*W]."""
    kernel = tf.cast(cell.kernel, dtype)
    if input_scale is not None:
        half = kernel if input_scale == 1.0 else kernel * tf.constant(input_scale, dtype)
        kernel = tf.concat([half, half], axis=0)  # [2n, G*H]
    recurrent = tf.cast(cell.recurrent_kernel, dtype)
    units = int(recurrent.shape[1]) // GATES[kind]
    gates = GATES[kind]
    w = tf.transpose(kernel)  # [G*H, n]: gate blocks of rows
    r = tf.transpose(recurrent)  # [G*H, H]
    if cell.use_bias:
        bias = tf.cast(cell.bias, dtype)
    else:
        rows = 2 if kind == "gru" else 1
        bias = tf.zeros([rows, gates * units], dtype)
    if kind == "gru":
        # One split and one concat per tensor: op count is most of the trace time.
        w, r = _zrh_to_rzh(w, axis=0), _zrh_to_rzh(r, axis=0)
        # [b_in; b_rec] as one swap: [2, 3H] -> flat b_in then b_rec.
        biases = [tf.reshape(_zrh_to_rzh(tf.reshape(bias, [2, gates * units]), axis=1), [-1])]
    else:
        biases = [tf.zeros([gates * units], dtype), tf.reshape(bias, [-1])]
    weights = [tf.reshape(w, [-1]), tf.reshape(r, [-1])]
    projection = getattr(cell, "projection_kernel", None)
    if projection is not None:  # [H, P] -> cuDNN's [P, H]
        weights.append(tf.reshape(tf.transpose(tf.cast(projection, dtype)), [-1]))
    return weights, biases


def _zrh_to_rzh(x: tf.Tensor, axis: int) -> tf.Tensor:
    """Swap the first two of three gate blocks along `axis` (Keras z, r, h
    -> cuDNN r, z, h).

    >>> _zrh_to_rzh(tf.constant([1, 2, 3, 4, 5, 6]), axis=0).numpy().tolist()
    [3, 4, 1, 2, 5, 6]"""
    z, r, h = tf.split(x, 3, axis=axis)
    return tf.concat([r, z, h], axis=axis)


def pack_params(stack: StackSpec, dtype: str) -> tf.Tensor:
    """The flat cuDNN parameter buffer of `stack`, from its live variables."""
    return tf.concat(canonical_pieces(stack, _cell_params, dtype), axis=0)


def _states(
    given: Sequence[Any] | None, stack: StackSpec, batch: tf.Tensor, dtype, width: int = 0
) -> tf.Tensor:
    """[levels * directions, B, H] from per-pseudo-layer states (None: 0)."""
    zeros = tf.zeros(tf.stack([batch, width or stack.units]), dtype)
    given = list(given or [])
    given += [None] * (stack.num_pseudo_layers - len(given))
    return tf.stack([zeros if s is None else tf.cast(s, dtype) for s in given])


def concrete_bool(value: Any) -> bool | None:
    """`value` as a Python bool where known now (eager, or a traced constant), else None."""
    known = tf.get_static_value(value)
    return None if known is None else bool(known)


def in_xla_context() -> bool:
    """Whether the current trace is being compiled by XLA (jit_compile=True)."""
    from tensorflow.python.ops import control_flow_util

    return bool(
        control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    )


def cudnn_rnn(**kwargs):
    """`tf.raw_ops.CudnnRNNV3`, as one name tests can spy on."""
    return tf.raw_ops.CudnnRNNV3(**kwargs)


def run_stack(sequences: tf.Tensor, call: StackCall) -> StackRun:
    """Runs `call.stack` over `sequences` [B, T, F] in one cuDNN call.

    How TensorFlow reads the `StackCall`'s fields:
        seed: CudnnRNNV3's two seeds, or seed + seed2 * 2**31 as the op's one.
        algorithm: an `Algorithm` (None: standard), or an int32 scalar tensor
            (`timed_steps`) passed as the op's algorithm input. CudnnRNNV3 and
            a masked call run the standard algorithm; the result says so.
        kernel: "cudnn" (rnnfuse's op where loaded, else CudnnRNNV3), "stock"
            (CudnnRNNV3 only) or "wavefront" (`wavefront_op`, with `training`
            its trainable form; "cudnn" where it cannot run the call).

    Returns:
        A `StackRun`: outputs [B, T, D*R] with zeros past each length, final
        h [L*D, B, R], final c [L*D, B, H] or None, and the `KernelRun`."""
    if call.kernel not in KERNELS:
        raise NotImplementedError(
            f"the TensorFlow backend runs the kernels {list(KERNELS)}, not {call.kernel!r}"
        )
    if call.kernel == "wavefront":
        return _run_wavefront(sequences, call)
    x, batch, lengths = _time_major(sequences, call)
    algorithm, runtime, note = _algorithm_for(call)
    if call.kernel == "stock":
        module, reason = None, "the plan's kernel is 'stock' (no rnnfuse op in the graph)"
    else:
        module, reason = _op_for(sequences.dtype, call.dropout)
    if module is not None:
        return _run_on_op(module, call, x, batch, lengths, algorithm, runtime, note)
    return _run_on_cudnn_rnn_v3(call, x, batch, lengths, algorithm, runtime, note, reason)


def _run_wavefront(sequences: tf.Tensor, call: StackCall) -> StackRun:
    """The "wavefront" kernel, or "cudnn" on the standard algorithm where
    it cannot run the call."""
    from rnnfuse.backends.tensorflow import wavefront_bidirectional, wavefront_op

    module = wavefront_bidirectional if call.stack.num_directions == 2 else wavefront_op
    run = module.run_trainable if call.training else module.run_differentiable
    return run_or_fall_back(
        lambda: run(sequences, call),
        lambda: run_stack(sequences, dataclasses.replace(
            call, algorithm=None, kernel="cudnn", training=False)),
        "the wavefront kernel",
    )


def _time_major(sequences: tf.Tensor, call: StackCall):
    """(x [T, B, F], batch, lengths [B]), reversed within lengths if `call.reverse`."""
    x = tf.transpose(sequences, [1, 0, 2])
    steps, batch = tf.shape(x)[0], tf.shape(x)[1]
    if call.mask is not None:
        lengths = tf.reduce_sum(tf.cast(call.mask, tf.int32), axis=1)
    else:
        lengths = tf.fill(tf.expand_dims(batch, 0), steps)
    if call.reverse:
        x = tf.reverse_sequence(x, lengths, seq_axis=0, batch_axis=1)
    return x, batch, lengths


def _algorithm_for(call: StackCall):
    """(algorithm, runtime tensor or None, note); a masked call runs the
    standard algorithm (persistent ones refuse padded lengths)."""
    algorithm = call.algorithm
    runtime = algorithm is not None and not isinstance(algorithm, Algorithm)
    if call.mask is not None and (
            runtime or (algorithm is not None and not algorithm.is_standard)):
        return None, False, "a masked call runs the standard algorithm (padded lengths)"
    return algorithm, runtime, None


def _run_on_op(module, call, x, batch, lengths, algorithm, runtime, note) -> StackRun:
    """`run_stack` on rnnfuse's cuDNN op (`cudnn_op.run_op`)."""
    stack, dtype = call.stack, x.dtype
    lstm = stack.kind == "lstm"
    outputs, h, c = cudnn_op.run_op(
        module,
        x,
        _states(call.initial_h, stack, batch, dtype, width=stack.output_size),
        _states(call.initial_c, stack, batch, dtype) if lstm else tf.zeros([0], dtype),
        pack_params(stack, dtype),
        lengths,
        kind=stack.kind,
        num_layers=stack.num_levels,
        num_directions=stack.num_directions,
        units=stack.units,
        input_size=int(stack.cells[0][0].kernel.shape[0]),
        proj_size=stack.proj_size,
        algorithm=None if runtime else algorithm,
        dropout=call.dropout,
        seed=int(call.seed[0]) + (int(call.seed[1]) << 31),
        code=algorithm if runtime else None,
    )
    name = "runtime" if runtime else (algorithm or Algorithm()).name
    ran = KernelRun("RnnfuseCudnnRnn", name, note)
    return StackRun(tf.transpose(outputs, [1, 0, 2]), h, (c if lstm else None), ran)


def _run_on_cudnn_rnn_v3(call, x, batch, lengths, algorithm, runtime, note, reason) -> StackRun:
    """`run_stack` on `tf.raw_ops.CudnnRNNV3` (standard algorithm only);
    `reason` says why rnnfuse's op does not run it."""
    stack, dtype = call.stack, x.dtype
    lstm = stack.kind == "lstm"
    if stack.proj_size or tf.as_dtype(dtype) == tf.bfloat16:
        raise NotImplementedError(
            f"this stack needs rnnfuse's cuDNN op, which cannot run it: {reason}"
        )
    if runtime or (algorithm is not None and not algorithm.is_standard):
        asked = "the step's" if runtime else f"the {algorithm.name}"
        reason = f"{reason}; {asked} algorithm asked for runs as standard"
        logger.info("rnnfuse: CudnnRNNV3 fallback: %s", reason)
    ran = KernelRun("CudnnRNNV3", "standard", reason if note is None else f"{reason}; {note}")
    tensors = dict(
        input=x,
        input_h=_states(call.initial_h, stack, batch, dtype),
        input_c=_states(call.initial_c, stack, batch, dtype) if lstm else tf.constant(0, dtype),
        params=pack_params(stack, dtype),
        sequence_lengths=lengths,
    )
    attrs = dict(
        rnn_mode=stack.kind,
        input_mode="linear_input",
        direction="bidirectional" if stack.num_directions == 2 else "unidirectional",
        dropout=float(call.dropout),
        seed=int(call.seed[0]),
        seed2=int(call.seed[1]),
        is_training=True,
        time_major=True,
    )
    outputs, h, c = cudnn_rnn(**tensors, **attrs)[:3]
    return StackRun(tf.transpose(outputs, [1, 0, 2]), h, (c if lstm else None), ran)


def _op_for(dtype, dropout: float):
    """(op module, None) when rnnfuse's op runs this call, else (None, reason)."""
    reason = cudnn_op.op_unsupported_reason(dtype, dropout)
    if reason is not None:
        return None, reason
    if op_build.disabled():
        return None, "rnnfuse's cuDNN op is turned off (RNNFUSE_DISABLE_OP)"
    module = op_build.load_op() if is_available() else None
    if module is None:
        return None, f"rnnfuse's cuDNN op is not loaded: {op_build.load_failure() or 'no GPU'}"
    return module, None
