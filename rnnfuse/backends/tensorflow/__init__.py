"""TensorFlow backend: a whole stack as one `tf.raw_ops.CudnnRNNV3` call.

The flat parameter buffer is built on every call from the original Keras
variables, so gradients reach them. Layout (cuDNN's canonical order; with it
a fused 3-layer LSTM and GRU and a 2-layer bidirectional stack reproduced
Keras' per-layer cuDNN output with max abs diff 0.0 on the H200):

    flat = W(p0) ++ W(p1) ++ ... ++ B(p0) ++ B(p1) ++ ...

over the pseudo-layers p = (level 0, fwd), (level 0, bwd), (level 1, fwd),
... : every weight matrix first, then every bias. For one pseudo-layer with
input width `n` (input_size at level 0, units * directions above) and
`H = units`:

- lstm: W = [W_i, W_f, W_c, W_o, R_i, R_f, R_c, R_o], each gate's matrix
  transposed to [H, n] (R: [H, H]) and flattened row-major, which is exactly
  `reshape(transpose(kernel), [-1])`. B = [0] * 4H (cuDNN's input biases,
  unused by Keras) ++ Keras' bias (i, f, c, o).
- gru (reset_after=True): Keras gate order (z, r, h) becomes cuDNN's
  (r, z, h) in W, R and in both rows of Keras' (2, 3H) bias, which are
  cuDNN's input and recurrent biases.
- rnn_tanh / rnn_relu: W = [W, R]; B = [0] * H ++ Keras' bias.

Sizes: weights G*H*(n + H), biases 2*G*H per pseudo-layer, G = 4, 3, 1.
`use_bias=False` gives zero biases.

Multi-layer states are passed time-major ([levels * directions, B, H]):
TensorFlow does not transpose batch-major multi-layer states for cuDNN.
`CudnnRNNCanonicalToParams` is not used: it aborted the process with a
CHECK failure on flat per-gate weights.

Example (on a machine with a GPU):

    >>> import keras
    >>> from rnnfuse.backends.base import StackSpec
    >>> cells = ((keras.layers.GRUCell(4),),)
    >>> cells[0][0].build((None, 3))
    >>> int(pack_params(StackSpec("gru", 4, cells), "float32").shape[0])
    108
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from rnnfuse.backends.base import GATES, StackSpec
from rnnfuse.tuning.algorithms import (
    Algorithm,
    algorithm_env,
    begin_graph_algorithm,
    end_graph_algorithm,
)
from rnnfuse.tuning.plans import CANDIDATE_ALGORITHMS

__all__ = [
    "TUNED_ALGORITHMS",
    "device_environment",
    "in_xla_context",
    "is_available",
    "mask_is_supported",
    "pack_params",
    "run_stack",
    "timed_step",
    "unsupported_reason",
]

SUPPORTED_DTYPES = ("float16", "float32", "float64")

# The cuDNN algorithms the tuner tries for fused pieces (None: the default).
TUNED_ALGORITHMS = CANDIDATE_ALGORITHMS


def is_available() -> bool:
    """Whether CudnnRNNV3 can run here: a CUDA build and a visible GPU."""
    return bool(tf.config.list_logical_devices("GPU")) and tf.test.is_built_with_cuda()


def device_environment() -> dict:
    """The GPU and library versions that a tuned plan depends on."""
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    build = tf.sysconfig.get_build_info()
    return {
        # "cpu": nothing real to time on (the emulated kernel in tests).
        "device": details.get("device_name", "gpu") if gpus else "cpu",
        "tensorflow": tf.__version__,
        "cudnn": str(build.get("cudnn_version", "?")),
    }


def timed_step(run, x, variables: Sequence[Any], training: bool, jit: bool = False):
    """A compiled step of `run(x, training)` (+ gradients) for the tuner.

    `jit`: compile it with XLA (how Keras runs a model whose layers all
    support XLA under jit_compile="auto"). Returns a callable giving a
    scalar tensor (converting it to NumPy waits for the device).
    """

    @tf.function(jit_compile=bool(jit))
    def step():
        if not training:
            y = run(x, False)
            return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y)])
        with tf.GradientTape() as tape:
            y = run(x, True)
            loss = tf.add_n(
                [tf.reduce_mean(tf.square(tf.cast(t, tf.float32))) for t in tf.nest.flatten(y)]
            )
        grads = tape.gradient(loss, list(variables))
        return loss + tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) * 0.0 for g in grads])

    return step


def unsupported_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why this backend cannot run `stack` in `dtype`, or None."""
    if str(dtype) not in SUPPORTED_DTYPES:
        return (
            f"TensorFlow's cuDNN RNN runs float16, float32 and float64, not {dtype}; "
            "the original layers run instead"
        )
    if stack.proj_size:
        return (
            "TensorFlow 2.21's CudnnRNNV3 rejects every real LSTM projection "
            "shape on cuDNN 9"
        )
    return None


def mask_is_supported(mask: Any) -> tf.Tensor:
    """True when `mask` [B, T] is right-padded and no sequence is empty."""
    mask = tf.cast(mask, tf.bool)
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    right_padded = tf.sequence_mask(lengths, maxlen=tf.shape(mask)[1])
    return tf.logical_and(
        tf.reduce_all(tf.equal(mask, right_padded)),
        tf.reduce_all(lengths > 0),
    )


def _cell_params(kind: str, cell: Any, dtype: str) -> tuple[list, list]:
    """(weights, biases) of one pseudo-layer, flattened in cuDNN order."""
    kernel = tf.cast(cell.kernel, dtype)
    recurrent = tf.cast(cell.recurrent_kernel, dtype)
    units = int(recurrent.shape[0])
    gates = GATES[kind]
    w = tf.transpose(kernel)  # [G*H, n]: gate blocks of rows
    r = tf.transpose(recurrent)  # [G*H, H]
    if cell.use_bias:
        bias = tf.cast(cell.bias, dtype)
    else:
        rows = 2 if kind == "gru" else 1
        bias = tf.zeros([rows, gates * units], dtype)
    if kind == "gru":
        w, r = _zrh_to_rzh(w, units), _zrh_to_rzh(r, units)
        bias = tf.reshape(bias, [2, 3 * units])
        b_in = _zrh_to_rzh(bias[0], units)
        b_rec = _zrh_to_rzh(bias[1], units)
    else:
        b_in = tf.zeros([gates * units], dtype)
        b_rec = tf.reshape(bias, [-1])
    return [tf.reshape(w, [-1]), tf.reshape(r, [-1])], [b_in, b_rec]


def _zrh_to_rzh(x: tf.Tensor, units: int) -> tf.Tensor:
    """Swap the first two gate blocks (Keras z, r -> cuDNN r, z) on axis 0."""
    return tf.concat([x[units : 2 * units], x[:units], x[2 * units :]], axis=0)


def pack_params(stack: StackSpec, dtype: str) -> tf.Tensor:
    """The flat cuDNN parameter buffer of `stack`, from its live variables."""
    weights, biases = [], []
    for level in stack.cells:
        for cell in level:
            w, b = _cell_params(stack.kind, cell, dtype)
            weights += w
            biases += b
    return tf.concat(weights + biases, axis=0)


def _states(
    given: Sequence[Any] | None, stack: StackSpec, batch: tf.Tensor, dtype
) -> tf.Tensor:
    """[levels * directions, B, H] from per-pseudo-layer states (None: 0)."""
    zeros = tf.zeros(tf.stack([batch, stack.units]), dtype)
    given = list(given or [])
    given += [None] * (stack.num_pseudo_layers - len(given))
    return tf.stack([zeros if s is None else tf.cast(s, dtype) for s in given])


def in_xla_context() -> bool:
    """Whether the current trace is being compiled by XLA (jit_compile=True)."""
    from tensorflow.python.ops import control_flow_util

    return bool(
        control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    )


def cudnn_rnn(**kwargs):
    """`tf.raw_ops.CudnnRNNV3`; one module-level name so tests can spy on it."""
    return tf.raw_ops.CudnnRNNV3(**kwargs)


def run_stack(
    sequences: tf.Tensor,
    *,
    stack: StackSpec,
    initial_h: Sequence[Any] | None = None,
    initial_c: Sequence[Any] | None = None,
    mask: Any = None,
    reverse: bool = False,
    dropout: float = 0.0,
    seed: tuple[int, int] = (0, 0),
    algorithm: Algorithm | None = None,
):
    """Runs `stack` over `sequences` [B, T, F] in one cuDNN call.

    Args:
        sequences: batch-major input, already in the compute dtype.
        stack: the levels and cells to run.
        initial_h, initial_c: per pseudo-layer initial states [B, H] (or
            None for zeros), in cuDNN order (level-major, fwd before bwd).
        mask: optional right-padded boolean mask [B, T]: sequence lengths.
        reverse: the first level reads each sequence reversed; outputs stay
            in processing order (as a Keras go_backwards layer returns them).
        dropout: cuDNN's dropout between levels (training only).
        seed: (seed, seed2) for that dropout.
        algorithm: the cuDNN algorithm of the forward kernel (None: the
            default); see `_call_with_algorithm`.

    Returns:
        (outputs [B, T, D*H] with zeros past each sequence's length,
         final h [L*D, B, H], final c [L*D, B, H] or None).
    """
    dtype = sequences.dtype
    x = tf.transpose(sequences, [1, 0, 2])  # time-major [T, B, F]
    steps, batch = tf.shape(x)[0], tf.shape(x)[1]
    if mask is not None:
        lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    else:
        lengths = tf.fill(tf.expand_dims(batch, 0), steps)
    if reverse:
        x = tf.reverse_sequence(x, lengths, seq_axis=0, batch_axis=1)
    lstm = stack.kind == "lstm"
    tensors = dict(
        input=x,
        input_h=_states(initial_h, stack, batch, dtype),
        input_c=_states(initial_c, stack, batch, dtype) if lstm else tf.constant(0, dtype),
        params=pack_params(stack, dtype),
        sequence_lengths=lengths,
    )
    attrs = dict(
        rnn_mode=stack.kind,
        input_mode="linear_input",
        direction="bidirectional" if stack.num_directions == 2 else "unidirectional",
        dropout=float(dropout),
        seed=int(seed[0]),
        seed2=int(seed[1]),
        is_training=True,
        time_major=True,
    )
    if algorithm is None:
        outputs, h, c = cudnn_rnn(**tensors, **attrs)[:3]
    else:
        if not dropout:
            attrs["seed2"] = algorithm.kernel_tag
        outputs, h, c = _call_with_algorithm(algorithm, tensors, attrs)
    return tf.transpose(outputs, [1, 0, 2]), h, (c if lstm else None)


def allowed_algorithm(algorithm: Algorithm, dtype) -> Algorithm:
    """`algorithm` without tensor ops where TensorFlow forbids them.

    TensorFlow rejects tensor-op math ("Algo requests disallowed tensor op
    evaluation") for float64, and for float32 when TF32 is turned off
    (`tf.config.experimental.enable_tensor_float_32_execution(False)`).
    """
    dtype = tf.as_dtype(dtype)
    forbidden = dtype == tf.float64 or (
        dtype == tf.float32
        and not tf.config.experimental.tensor_float_32_execution_enabled()
    )
    if algorithm.tensor_ops and forbidden:
        return Algorithm(algorithm.algo, tensor_ops=False)
    return algorithm


def _call_with_algorithm(algorithm: Algorithm, tensors: dict, attrs: dict):
    """`cudnn_rnn` whose forward kernel is built under `algorithm`.

    TensorFlow reads the algorithm variables when it constructs a
    CudnnRNNV3 kernel. Eagerly, the variables are set around the call (the
    algorithm's own `seed2` keeps the kernel cache from reusing another
    algorithm's kernel). In a graph, every kernel of a function is built
    when the function is first run, so the call goes into an inner function
    that is not inlined and is instantiated when it first runs; a
    `py_function` sets the variables just before it and another restores
    them just after (automatic control dependencies keep that order). If
    the op fails in between, the next rnnfuse call restores them
    (`rnnfuse.tuning.algorithms.restore_pending`).
    """
    names = list(tensors)
    algorithm = allowed_algorithm(algorithm, tensors["input"].dtype)

    def call(*values):
        return tuple(cudnn_rnn(**dict(zip(names, values)), **attrs)[:3])

    if tf.executing_eagerly():
        with algorithm_env(algorithm):
            return call(*tensors.values())

    def enter():
        begin_graph_algorithm(algorithm)
        return 0

    def leave():
        end_graph_algorithm()
        return 0

    inner = tf.function(
        call, autograph=False, experimental_attributes={"_noinline": True}
    )
    token = tf.py_function(enter, [], tf.int32)
    with tf.control_dependencies([token]):
        values = [tf.identity(t) for t in tensors.values()]
    outputs = inner(*values)
    with tf.control_dependencies(list(outputs)):
        done = tf.py_function(leave, [], tf.int32)
    with tf.control_dependencies([done]):
        return tuple(tf.identity(t) for t in outputs)
