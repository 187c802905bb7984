"""TensorFlow side of rnnfuse's wavefront kernel (the `RnnfuseWavefront` op).

`run_stack` runs a unidirectional LSTM or GRU stack's inference on the
kernel with `rnnfuse.backends.tensorflow.run_stack`'s arguments and
results, from the same flat buffer (`pack_params`); layer 0's input
projection is one `tf.matmul` before the op. Where the kernel cannot run
the call (`unsupported_reason`) it raises NotImplementedError with the
reason and the caller runs cuDNN.

The op has no gradient: `run_differentiable`, what the backend calls,
gives the call cuDNN's gradient recomputed in the backward pass.
`run_trainable` is the training form with the kernels' own gradient
(`wavefront_training.trainable_forward`); its `KernelRun`'s algorithm says
which backward ran ("backward=stack" or "backward=layer").

Example (on a Hopper GPU):

    >>> run = run_stack(x, StackCall(stack))  # doctest: +SKIP
    >>> run.kernel.name  # doctest: +SKIP
    'RnnfuseWavefront'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import tensorflow as tf

from rnnfuse.backends.base import GATES, StackCall, StackRun, StackSpec
from rnnfuse.reasons import KernelRun

__all__ = ["KERNEL_NAME", "TRAINING_KERNEL_NAME", "forward", "register_gradient",
           "run_differentiable", "run_stack", "run_trainable", "training_reason",
           "unsupported_reason"]

KERNEL_NAME = "RnnfuseWavefront"
TRAINING_KERNEL_NAME = "RnnfuseWavefront forward+backward"


def unsupported_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                       input_size: int, dtype: Any, *, directions: int = 1, proj_size: int = 0,
                       summed_inputs: bool = False, dropout: float = 0.0) -> str | None:
    """Why the wavefront op cannot run this inference call here, or None."""
    from rnnfuse.backends.cuda import library
    from rnnfuse.backends.tensorflow import wavefront_training

    reason = library.stack_reason(kind, tf.as_dtype(dtype).name, directions=directions,
                                  proj_size=proj_size, summed_inputs=summed_inputs,
                                  dropout=dropout)
    if reason is not None:
        return reason
    unavailable = wavefront_training.op_unavailable()
    if unavailable is not None:
        return unavailable
    return library.device_reason(kind, num_layers, units, batch, steps, input_size)


def training_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                    input_size: int, dtype: Any, *, directions: int = 1, proj_size: int = 0,
                    summed_inputs: bool = False, dropout: float = 0.0) -> str | None:
    """Why `run_trainable` cannot run this training call here, or None: the
    forward's `unsupported_reason`, then the backward kernel's."""
    from rnnfuse.backends.cuda import library

    reason = unsupported_reason(kind, num_layers, units, batch, steps, input_size, dtype,
                                directions=directions, proj_size=proj_size,
                                summed_inputs=summed_inputs, dropout=dropout)
    if reason is not None:
        return reason
    return library.backward_reason(kind, units, batch, steps)


def _stack_arguments(stack: StackSpec, batch: int, steps: int, dropout: float) -> tuple:
    """(args, kwargs) of `unsupported_reason` / `training_reason` but dtype."""
    return ((stack.kind, stack.num_levels, stack.units, batch, steps,
             int(stack.cells[0][0].kernel.shape[0])),
            dict(directions=stack.num_directions, proj_size=stack.proj_size,
                 summed_inputs=any(stack.input_scale(i) is not None
                                   for i in range(stack.num_levels)),
                 dropout=dropout))


def stack_unsupported_reason(stack: StackSpec, dtype: Any, batch: int, steps: int,
                             dropout: float = 0.0) -> str | None:
    """`unsupported_reason` for a fused call's `StackSpec`."""
    args, kwargs = _stack_arguments(stack, batch, steps, dropout)
    return unsupported_reason(*args, dtype, **kwargs)


def stack_training_reason(stack: StackSpec, dtype: Any, batch: int, steps: int,
                          dropout: float = 0.0) -> str | None:
    """`training_reason` for a fused call's `StackSpec`."""
    args, kwargs = _stack_arguments(stack, batch, steps, dropout)
    return training_reason(*args, dtype, **kwargs)


def _static_batch_and_steps(sequences: tf.Tensor) -> tuple[int, int]:
    """sequences' [B, T] (NotImplementedError where either is unknown)."""
    batch, steps = sequences.shape[0], sequences.shape[1]
    if batch is None or steps is None:
        raise NotImplementedError("the wavefront kernel needs a static batch and length")
    return int(batch), int(steps)


def _kernel_input(sequences: tf.Tensor, call: StackCall, reason_of):
    """(batch, x [T, B, F], lengths) of a call that `reason_of` (one of the
    stack reasons above) accepts; NotImplementedError with its reason."""
    batch, steps = _static_batch_and_steps(sequences)
    reason = reason_of(call.stack, sequences.dtype, batch, steps, call.dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    return (batch, *_time_major(sequences, call.mask, call.reverse))


def _time_major(sequences: tf.Tensor, mask: Any, reverse: bool):
    """(x [T, B, F], lengths int32 [B] or None): the kernel's input, the
    first level reading each sequence reversed within its length."""
    x = tf.transpose(sequences, [1, 0, 2])
    if mask is None:
        return (tf.reverse(x, axis=[0]) if reverse else x), None
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    if reverse:
        x = tf.reverse_sequence(x, lengths, seq_axis=0, batch_axis=1)
    return x, lengths


def run_stack(sequences: tf.Tensor, call: StackCall) -> StackRun:
    """`rnnfuse.backends.tensorflow.run_stack` on the wavefront op, inference
    only; `seed`, `algorithm`, `kernel` and `training` are not read.

    Raises:
        NotImplementedError: the op cannot run this call (the reason)."""
    from rnnfuse.backends import tensorflow as tf_backend

    stack, dtype = call.stack, sequences.dtype
    batch, x, lengths = _kernel_input(sequences, call, stack_unsupported_reason)
    y, h, c = forward(
        x, tf_backend.pack_params(stack, dtype),
        tf_backend._states(call.initial_h, stack, batch, dtype),
        tf_backend._states(call.initial_c, stack, batch, dtype) if stack.kind == "lstm" else None,
        lengths, kind=stack.kind)
    return StackRun(tf.transpose(y, [1, 0, 2]), h, c, KernelRun(KERNEL_NAME))


def forward(x: tf.Tensor, params: tf.Tensor, h0: tf.Tensor, c0: Any, lengths: Any, *,
            kind: str):
    """One `RnnfuseWavefront` launch over x [T, B, I] (time-major): (y, hy,
    cy, None for a GRU)."""
    from rnnfuse.backends.tensorflow import op_build, wavefront_training

    units = int(h0.shape[-1])
    xproj = wavefront_training.input_projection(x, params, GATES[kind] * units)
    lstm = kind == "lstm"
    y, h, c = op_build.load_wavefront_op().rnnfuse_wavefront(
        xproj=xproj, params=params, input_h=h0,
        input_c=c0 if lstm else tf.zeros([0], x.dtype),
        sequence_lengths=wavefront_training.lengths_input(lengths), rnn_mode=kind,
        input_size=int(x.shape[-1]),
        kernel_variant=wavefront_training.kernel_variants().FORWARD_VARIANT)
    return y, h, (c if lstm else None)


def run_trainable(sequences: tf.Tensor, call: StackCall) -> StackRun:
    """`run_stack` for training: the kernels' forward and backward, the
    gradient reaching every variable the call read (through `pack_params`).

    Raises:
        NotImplementedError: the kernels cannot run this call
            (`training_reason`); the caller runs cuDNN."""
    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.tensorflow import wavefront_training

    stack = call.stack
    sequences = tf.convert_to_tensor(sequences)
    dtype = sequences.dtype
    batch, x, lengths = _kernel_input(sequences, call, stack_training_reason)
    h0 = tf_backend._states(call.initial_h, stack, batch, dtype)
    choice = wavefront_training.backward_choice(x, h0, kind=stack.kind)
    c0 = tf_backend._states(call.initial_c, stack, batch, dtype) if stack.kind == "lstm" else None
    y, hy, cy = wavefront_training.trainable_forward(
        x, tf_backend.pack_params(stack, dtype), h0, c0, lengths, backward=choice.backward,
        kind=stack.kind)
    return StackRun(tf.transpose(y, [1, 0, 2]), hy, cy,
                    KernelRun(TRAINING_KERNEL_NAME, f"backward={choice.backward}"))


def run_differentiable(sequences: tf.Tensor, call: StackCall, run=None) -> StackRun:
    """`run` (default `run_stack`) with cuDNN's gradient: the same call on cuDNN (standard
    algorithm) recomputed from the saved inputs when a gradient is asked for
    (`tf.recompute_grad`'s pattern), so a tape around an inference call gets
    the gradient Keras' own layers give.

    Raises:
        NotImplementedError: the op cannot run this call (the reason)."""
    from rnnfuse.backends import tensorflow as tf_backend

    h, c = list(call.initial_h or []), list(call.initial_c or [])
    lstm = call.stack.kind == "lstm"
    ran = []

    def unpack(flat):
        return flat[0], list(flat[1:1 + len(h)]) or None, list(flat[1 + len(h):]) or None

    @tf.custom_gradient
    def wavefront(*flat):
        x, hs, cs = unpack(flat)
        out = (run or run_stack)(x, dataclasses.replace(call, initial_h=hs, initial_c=cs))
        ran.append(out.kernel)

        def grad(*upstream, variables=None):
            variables = list(variables or [])
            with tf.GradientTape() as tape:
                tape.watch(flat)
                again = tf_backend.run_stack(x, dataclasses.replace(
                    call, initial_h=hs, initial_c=cs, dropout=0.0, seed=(0, 0), algorithm=None,
                    kernel="cudnn", training=False))
                targets = _tensors(again, lstm)
            upstream = [tf.zeros_like(t) if g is None else tf.cast(g, t.dtype)
                        for t, g in zip(targets, upstream)]
            grads = tape.gradient(targets, list(flat) + variables, output_gradients=upstream)
            return grads[:len(flat)], grads[len(flat):]

        return _tensors(out, lstm), grad

    out = wavefront(tf.convert_to_tensor(sequences), *(tf.convert_to_tensor(s) for s in h + c))
    return StackRun(out[0], out[1], out[2] if lstm else None, ran[0])


def _tensors(run: StackRun, lstm: bool) -> list:
    """A run's tensors: outputs, final h (and final c for an LSTM)."""
    return [run.outputs, run.final_h] + ([run.final_c] if lstm else [])


def _no_gradient(op, *grads):
    raise ValueError(
        "RnnfuseWavefront is an inference kernel and has no gradient of its own. Fix: call "
        "it through wavefront_op.run_differentiable (what FusedRNN does), whose gradient is "
        "cuDNN's, or train with a cuDNN plan"
    )


def _no_training_gradient(op, *grads):
    raise ValueError(
        f"{getattr(op, 'type', 'this op')} has no gradient of its own: it is half of the "
        "wavefront kernel's training path. Fix: call it through wavefront_op.run_trainable (or "
        "wavefront_training.trainable_forward), whose gradient runs the backward kernel"
    )


@functools.cache  # memo: TensorFlow's gradient registry is process-wide
def register_gradient() -> None:
    """Registers the error-raising gradients of the wavefront ops (once)."""
    for name, fn in ((KERNEL_NAME, _no_gradient), ("RnnfuseWavefrontSaving", _no_training_gradient),
                     ("RnnfuseWavefrontBackward", _no_training_gradient),
                     ("RnnfuseWavefrontBackwardStack", _no_training_gradient)):
        try:
            tf.RegisterGradient(name)(fn)
        except KeyError:  # already registered (module reloaded)
            pass


register_gradient()
