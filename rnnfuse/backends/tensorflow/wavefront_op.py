"""TensorFlow side of rnnfuse's wavefront kernel (the `RnnfuseWavefront` op).

`run_stack` runs a fused unidirectional LSTM or GRU stack's inference on
the kernel (rnnfuse/backends/cuda/csrc/wavefront.cuh: every layer's weights
on chip, the layers as a wavefront), with the arguments and results of
`rnnfuse.backends.tensorflow.run_stack`, from the same canonical flat
buffer (`pack_params`). Layer 0's input projection x W_ih^T is one
`tf.matmul` in the compute dtype before the op; the biases are added in the
kernel, in float32.

It raises NotImplementedError, naming the reason, where the kernel cannot
run the call (`unsupported_reason`: not float16/bfloat16, a projection,
bidirectional or summed inputs, dropout, a shape over the on-chip limits,
no op, no Hopper GPU); the caller then runs cuDNN. The op has no gradient:
it is an inference kernel (`predict`, `evaluate`, `training=False`), and a
gradient through it is an error that says so.

Example (on an H200, inside a tf.function or eagerly):

    >>> y, h, c = run_stack(x, stack=stack)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from rnnfuse.backends.base import GATES, StackSpec

__all__ = ["KERNEL_NAME", "register_gradient", "run_stack", "unsupported_reason"]

KERNEL_NAME = "RnnfuseWavefront"
_DTYPES = ("float16", "bfloat16")


def _limits() -> dict | str:
    """The first GPU's {sms, smem, major, minor}, or why there is none."""
    from rnnfuse.backends.cuda import library

    try:
        return library.load().device(0)
    except Exception as exc:  # no nvcc, no driver: cuDNN runs
        return f"the wavefront kernel is not available: {exc}"


def unsupported_reason(stack: StackSpec, dtype: Any, batch: int, steps: int,
                       dropout: float = 0.0) -> str | None:
    """Why the wavefront op cannot run this inference call, or None."""
    name = tf.as_dtype(dtype).name
    if stack.kind not in ("lstm", "gru"):
        return f"the wavefront kernel runs LSTM and GRU stacks, not {stack.kind}"
    if name not in _DTYPES:
        return f"the wavefront kernel runs float16 and bfloat16, not {name}"
    if stack.num_directions != 1 or stack.proj_size:
        return "the wavefront kernel runs unidirectional stacks without projections"
    if any(stack.input_scale(i) is not None for i in range(stack.num_levels)):
        return "the wavefront kernel reads each layer's output, not summed directions"
    if dropout:
        return "the wavefront kernel runs inference only (no dropout)"
    from rnnfuse.backends.tensorflow import op_build

    if op_build.load_wavefront_op() is None:
        return f"rnnfuse's wavefront op is not loaded: {op_build.wavefront_load_failure()}"
    limits = _limits()
    if isinstance(limits, str):
        return limits
    if limits["major"] != 9:
        return (f"the wavefront kernel runs on compute capability 9.0 (Hopper), not "
                f"{limits['major']}.{limits['minor']}")
    from rnnfuse.backends.cuda import library

    input_size = int(stack.cells[0][0].kernel.shape[0])
    plan = library.load().plan(stack.kind, stack.num_levels, stack.units, int(batch),
                               int(steps), input_size, sms=limits["sms"], smem=limits["smem"])
    return plan if isinstance(plan, str) else None


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
    algorithm: Any = None,
):
    """`rnnfuse.backends.tensorflow.run_stack` on the wavefront op (inference).

    `seed` and `algorithm` are accepted for the same signature and unused.

    Raises:
        NotImplementedError: the op cannot run this call (the reason).
    """
    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.tensorflow import op_build

    del seed, algorithm
    dtype = sequences.dtype
    batch, steps = sequences.shape[0], sequences.shape[1]
    if batch is None or steps is None:
        raise NotImplementedError("the wavefront kernel needs a static batch and length")
    reason = unsupported_reason(stack, dtype, batch, steps, dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    x = tf.transpose(sequences, [1, 0, 2])  # [T, B, F]
    if mask is not None:
        lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
        if reverse:
            x = tf.reverse_sequence(x, lengths, seq_axis=0, batch_axis=1)
    else:
        lengths = tf.zeros([0], tf.int32)
        if reverse:
            x = tf.reverse(x, axis=[0])
    params = tf_backend.pack_params(stack, dtype)
    gh, input_size = GATES[stack.kind] * stack.units, int(x.shape[-1])
    w_ih0 = tf.reshape(params[: gh * input_size], [gh, input_size])
    xproj = tf.reshape(tf.matmul(tf.reshape(x, [-1, input_size]), w_ih0, transpose_b=True),
                       [steps, batch, gh])
    lstm = stack.kind == "lstm"
    outputs, h, c = op_build.load_wavefront_op().rnnfuse_wavefront(
        xproj=xproj,
        params=params,
        input_h=tf_backend._states(initial_h, stack, batch, dtype),
        input_c=tf_backend._states(initial_c, stack, batch, dtype) if lstm else tf.zeros([0], dtype),
        sequence_lengths=lengths,
        rnn_mode=stack.kind,
        input_size=input_size,
    )
    tf_backend._LAST.update(kernel=KERNEL_NAME, algorithm=None, reason=None)
    return tf.transpose(outputs, [1, 0, 2]), h, (c if lstm else None)


def _no_gradient(op, *grads):
    raise ValueError(
        "RnnfuseWavefront is an inference kernel and has no gradient. Fix: train with the "
        "cuDNN plan (the tuner picks the wavefront kernel for inference calls only)"
    )


def register_gradient() -> None:
    """Registers the error-raising gradient of RnnfuseWavefront (once)."""
    if getattr(register_gradient, "done", False):
        return
    try:
        tf.RegisterGradient(KERNEL_NAME)(_no_gradient)
    except KeyError:  # already registered (module reloaded)
        pass
    register_gradient.done = True


register_gradient()
