"""Bidirectional stacks on the wavefront kernel under JAX: per layer, each
direction a one-layer `wavefront.forward` (its custom_vjp the gradient),
direction 1 over the input reversed within lengths and its output reversed
back, concatenated. `BIDIRECTIONAL` switches it off.

    >>> y, hy, cy = forward(x, params, h0, c0, None, kind="lstm")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from rnnfuse.backends import directions
from rnnfuse.backends.jax import wavefront

__all__ = ["ALGORITHM", "BIDIRECTIONAL", "BIDIRECTIONAL_OFF", "forward", "pack_directions",
           "reverse_within_lengths", "run_stack", "structure_reason", "unsupported_reason"]

BIDIRECTIONAL = True
BIDIRECTIONAL_OFF = ("bidirectional layers on the wavefront kernel are switched off under JAX "
                     "(rnnfuse.backends.jax.wavefront_bidirectional.BIDIRECTIONAL)")
ALGORITHM = "bidirectional: a call a direction"


def reverse_within_lengths(x, lengths) -> jax.Array:
    """x [T, B, ...] with each row's first len steps reversed, its padding kept.

    >>> x = jnp.arange(4.0).reshape(4, 1).repeat(2, axis=1)
    >>> reverse_within_lengths(x, jnp.array([4, 2])).T.tolist()
    [[3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 2.0, 3.0]]"""
    if lengths is None:
        return jnp.flip(x, 0)
    t = jnp.arange(x.shape[0])[:, None]
    lens = jnp.asarray(lengths, jnp.int32)[None, :]
    index = jnp.where(t < lens, lens - 1 - t, t)
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=0)


def forward(x, params: Sequence[Any], h0, c0, lengths, *, kind: str, backward: str = "layer"):
    """`directions.compose` on `wavefront.forward`, differentiable."""
    def one_layer(src, flat, h0_k, c0_k):
        return wavefront.forward(src, flat, h0_k, c0_k, lengths, kind=kind, backward=backward)

    return directions.compose(x, params, h0, c0, one_layer=one_layer,
                              reverse=lambda t: reverse_within_lengths(t, lengths),
                              concat=lambda parts, axis: jnp.concatenate(parts, axis))


def pack_directions(stack, dtype) -> list:
    """A one-layer canonical buffer per pseudo layer (merges: `StackSpec.input_scale`)."""
    from rnnfuse.backends.jax import _cell_params

    out = []
    for level, cells in enumerate(stack.cells):
        for cell in cells:
            weights, biases = _cell_params(stack.kind, cell, dtype, stack.input_scale(level))
            out.append(jnp.concatenate(weights + biases))
    return out


def structure_reason(kind: str, dtype: str, *, proj_size: int = 0,
                     dropout: float = 0.0) -> str | None:
    """What the composition never runs, whatever the shape, or None."""
    from rnnfuse.backends.cuda import library

    reason = library.stack_reason(kind, str(dtype), proj_size=proj_size, dropout=dropout)
    return reason or (None if BIDIRECTIONAL else BIDIRECTIONAL_OFF)


def unsupported_reason(kind: str, num_layers: int, units: int, dtype: str, batch: int,
                       steps: int, input_size: int, *, training: bool = False,
                       proj_size: int = 0, dropout: float = 0.0) -> str | None:
    """Why the composition cannot run here (each layer's one-layer plans), or None."""
    from rnnfuse.backends.cuda import library

    reason = structure_reason(kind, dtype, proj_size=proj_size, dropout=dropout)
    reason = reason or wavefront.register()
    return reason or library.directions_composed_reason(
        kind, units, batch, steps, input_size, training=training, ordinal=wavefront._ORDINAL)


def run_stack(sequences, call) -> Any:
    """`wavefront.run_stack` for a bidirectional stack (outputs [B, T, 2H]).

    Raises:
        NotImplementedError: the composition cannot run this call (the reason)."""
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    stack = call.stack
    if call.reverse:
        raise NotImplementedError("a bidirectional stack whose first layer reads reversed "
                                  "sequences runs cuDNN")
    x = jnp.asarray(sequences)
    batch, steps, input_size = (int(d) for d in x.shape)
    reason = unsupported_reason(stack.kind, stack.num_levels, stack.units, x.dtype.name, batch,
                                steps, input_size, training=call.training,
                                proj_size=stack.proj_size, dropout=call.dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    lengths = None
    if call.mask is not None:
        lengths = jnp.asarray(call.mask).astype(jnp.int32).sum(axis=1)
    choice = wavefront.backward_choice(stack.kind, 1, stack.units, batch, steps)
    lstm = stack.kind == "lstm"
    y, hy, cy = forward(jnp.swapaxes(x, 0, 1), pack_directions(stack, x.dtype),
                        wavefront._states(call.initial_h, stack, batch, x.dtype),
                        wavefront._states(call.initial_c, stack, batch, x.dtype) if lstm
                        else None, lengths, kind=stack.kind, backward=choice.backward)
    algorithm = f"{ALGORITHM}, backward={choice.backward}" if call.training else ALGORITHM
    return StackRun(jnp.swapaxes(y, 0, 1), hy, cy, KernelRun(wavefront.KERNEL_NAME, algorithm))
