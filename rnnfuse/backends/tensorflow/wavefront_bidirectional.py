"""Bidirectional stacks on the wavefront ops under TensorFlow: per layer,
each direction a one-layer call (`wavefront_op.forward`; training:
`wavefront_training.trainable_forward`, the kernels' gradient), direction
1 over the input reversed within lengths and its output reversed back,
concatenated. `BIDIRECTIONAL` switches it off.

    >>> y, hy, cy = forward(x, params, h0, c0, None, kind="lstm")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from rnnfuse.backends import directions
from rnnfuse.backends.tensorflow import wavefront_op, wavefront_training

__all__ = ["ALGORITHM", "BIDIRECTIONAL", "BIDIRECTIONAL_OFF", "forward", "pack_directions",
           "reverse_within_lengths", "run_differentiable", "run_stack", "run_trainable",
           "structure_reason", "unsupported_reason"]

BIDIRECTIONAL = True
BIDIRECTIONAL_OFF = ("bidirectional layers on the wavefront kernel are switched off under "
                     "TensorFlow (rnnfuse.backends.tensorflow.wavefront_bidirectional."
                     "BIDIRECTIONAL)")
ALGORITHM = "bidirectional: a call a direction"


def reverse_within_lengths(x, lengths) -> tf.Tensor:
    """x [T, B, ...] with each row's first len steps reversed, its padding kept.

    >>> x = tf.tile(tf.range(4.0)[:, None], [1, 2])
    >>> tf.transpose(reverse_within_lengths(x, tf.constant([4, 2]))).numpy().tolist()
    [[3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 2.0, 3.0]]"""
    if lengths is None:
        return tf.reverse(x, axis=[0])
    return tf.reverse_sequence(x, tf.cast(lengths, tf.int32), seq_axis=0, batch_axis=1)


def forward(x, params: Sequence[Any], h0, c0, lengths, *, kind: str, training: bool = False,
            backward: str = "layer"):
    """`directions.compose` on the wavefront ops (`training`: the kernels' gradient)."""
    def one_layer(src, flat, h0_k, c0_k):
        if training:
            return wavefront_training.trainable_forward(src, flat, h0_k, c0_k, lengths,
                                                        backward=backward, kind=kind)
        return wavefront_op.forward(src, flat, h0_k, c0_k, lengths, kind=kind)

    return directions.compose(x, params, h0, c0, one_layer=one_layer,
                              reverse=lambda t: reverse_within_lengths(t, lengths),
                              concat=lambda parts, axis: tf.concat(parts, axis))


def pack_directions(stack, dtype) -> list:
    """A one-layer canonical buffer per pseudo layer (merges: `StackSpec.input_scale`)."""
    from rnnfuse.backends.tensorflow import _cell_params

    out = []
    for level, cells in enumerate(stack.cells):
        for cell in cells:
            weights, biases = _cell_params(stack.kind, cell, dtype, stack.input_scale(level))
            out.append(tf.concat(weights + biases, 0))
    return out


def structure_reason(kind: str, dtype: Any, *, proj_size: int = 0,
                     dropout: float = 0.0) -> str | None:
    """What the composition never runs, whatever the shape, or None."""
    from rnnfuse.backends.cuda import library

    reason = library.stack_reason(kind, tf.as_dtype(dtype).name, proj_size=proj_size,
                                  dropout=dropout)
    return reason or (None if BIDIRECTIONAL else BIDIRECTIONAL_OFF)


def unsupported_reason(kind: str, num_layers: int, units: int, dtype: Any, batch: int,
                       steps: int, input_size: int, *, training: bool = False,
                       proj_size: int = 0, dropout: float = 0.0) -> str | None:
    """Why the composition cannot run here (each layer's one-layer plans), or None."""
    from rnnfuse.backends.cuda import library

    reason = structure_reason(kind, dtype, proj_size=proj_size, dropout=dropout)
    reason = reason or wavefront_training.op_unavailable()
    return reason or library.directions_composed_reason(kind, units, batch, steps, input_size,
                                                        training=training)


def _run(sequences, call, training: bool):
    """(y [B, T, 2H], hy, cy, backward) of `call` on the composition.

    Raises:
        NotImplementedError: the composition cannot run this call (the reason)."""
    from rnnfuse.backends import tensorflow as tf_backend

    stack = call.stack
    if call.reverse:
        raise NotImplementedError("a bidirectional stack whose first layer reads reversed "
                                  "sequences runs cuDNN")
    sequences = tf.convert_to_tensor(sequences)
    dtype = sequences.dtype
    batch, steps = wavefront_op._static_batch_and_steps(sequences)
    reason = unsupported_reason(stack.kind, stack.num_levels, stack.units, dtype, batch, steps,
                                int(sequences.shape[-1]), training=training,
                                proj_size=stack.proj_size, dropout=call.dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    x, lengths = wavefront_op._time_major(sequences, call.mask, False)
    h0 = tf_backend._states(call.initial_h, stack, batch, dtype)
    c0 = tf_backend._states(call.initial_c, stack, batch, dtype) if stack.kind == "lstm" else None
    backward = "layer"
    if training:
        backward = wavefront_training.backward_choice(x, h0[:1], kind=stack.kind).backward
    y, hy, cy = forward(x, pack_directions(stack, dtype), h0, c0, lengths, kind=stack.kind,
                        training=training, backward=backward)
    return tf.transpose(y, [1, 0, 2]), hy, cy, backward


def run_stack(sequences, call) -> Any:
    """`wavefront_op.run_stack` for a bidirectional stack (outputs [B, T, 2H])."""
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    y, hy, cy, _ = _run(sequences, call, training=False)
    return StackRun(y, hy, cy, KernelRun(wavefront_op.KERNEL_NAME, ALGORITHM))


def run_differentiable(sequences, call) -> Any:
    """`run_stack` with cuDNN's gradient (`wavefront_op.run_differentiable`)."""
    return wavefront_op.run_differentiable(sequences, call, run=run_stack)


def run_trainable(sequences, call) -> Any:
    """`wavefront_op.run_trainable` for a bidirectional stack."""
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    y, hy, cy, backward = _run(sequences, call, training=True)
    return StackRun(y, hy, cy, KernelRun(wavefront_op.TRAINING_KERNEL_NAME,
                                         f"{ALGORITHM}, backward={backward}"))
