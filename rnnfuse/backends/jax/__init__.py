"""JAX backend: an LSTM stack as one `jax.experimental.rnn.lstm` call, and
LSTM and GRU stacks on rnnfuse's wavefront kernel through XLA FFI.

Plan kernel "wavefront" (`wavefront`: the kernel's FFI handlers, called
with `jax.ffi.ffi_call` inside Keras' jitted steps, with a
`jax.custom_vjp` whose backward pass runs the backward kernel) runs
unidirectional float16 and bfloat16 LSTM and GRU stacks on a Hopper GPU;
`kernel_reason` says where it cannot, and a call it refuses runs the
"cudnn" kernel (jax.experimental.rnn), else the original layers, with the
reason. The rest of this docstring is the "cudnn" kernel's.

Keras' JAX backend (3.15) already runs each unmasked float32 `LSTM` layer
on the GPU as one single-layer `jax.experimental.rnn.lstm` call (cuDNN).
This backend runs a whole stack of LSTM levels as one call with
num_layers = L. It is the only RNN jax.experimental.rnn has: GRU and
SimpleRNN stacks, and other dtypes than float32, stay on Keras' path
(`unsupported_reason`), and it has no CPU lowering (`is_available` needs a
GPU).

One multi-layer call wins against Keras' per-layer calls at large batch
and width and loses a little at small batch (docs/benchmarks.md, "JAX").
So the static plan under JAX keeps Keras' layers (`rnnfuse.tuning.table.static_plan`),
and `optimize(model, tune=batch)` times both and fuses where it is faster.

Weight blob (jax.experimental.rnn's `_get_params_shapes_in_lstm`, cuDNN's
canonical layout): for each pseudo-layer p = (level 0, fwd), (level 0,
bwd), (level 1, fwd), ...: W_ih [4H, n] then W_hh [4H, H], row-major; then
for each pseudo-layer b_ih [4H], b_hh [4H]. Keras' gate order i, f, c, o is
cuDNN's; W_ih = kernel^T, W_hh = recurrent_kernel^T, b_ih = Keras' bias,
b_hh = 0. The blob is built inside the traced function from the live
variables on every call, so gradients reach them. A level that reads a
Bidirectional merged by "sum" or "ave" (`StackSpec.input_scale`) gets
W_ih = [s*W; s*W]^T, s = 1 or 1/2: the call feeds it [fwd, bwd], and
[fwd, bwd] [s*W; s*W] = s*(fwd + bwd) W.

Not fused under JAX (the original layers run, exactly): masked calls
(`mask_is_supported` is False: wrong gradients from the cuDNN call with
ragged lengths), an LSTM's go_backwards first layer (`group_reason`),
SimpleRNN; float16/bfloat16 and GRU stacks only on the "wavefront" plan,
where its kernel accepts them. Between-level dropout has no seed in
jax.experimental.rnn, so the planner does not absorb Dropout layers under
JAX.

Example (packing only; the call itself needs a GPU):

    >>> import keras
    >>> from rnnfuse.backends.base import StackSpec
    >>> cell = keras.layers.LSTMCell(4)
    >>> cell.build((None, 3))
    >>> int(pack_params(StackSpec("lstm", 4, ((cell,),))).shape[0])
    144
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import keras

from rnnfuse.backends.base import StackCall, StackRun, StackSpec
from rnnfuse.reasons import KernelRun

__all__ = [
    "KERNELS",
    "concrete_bool",
    "device_environment",
    "group_reason",
    "is_available",
    "jax_lstm",
    "kernel_reason",
    "mask_is_supported",
    "pack_params",
    "run_stack",
    "timed_step",
    "unsupported_reason",
]

# The plan kernels (`rnnfuse.plan.KERNELS`) this backend runs: "cudnn" and
# "stock" are both jax.experimental.rnn's cuDNN call; "wavefront" is
# rnnfuse's kernel (`wavefront`).
KERNELS = ("cudnn", "stock", "wavefront")


def concrete_bool(value: Any) -> bool | None:
    """`value` (a boolean scalar) as a Python bool, or None inside a trace
    (a tracer has no value yet)."""
    if isinstance(value, jax.core.Tracer):
        return None
    return bool(value)


def is_available() -> bool:
    """Whether jax.experimental.rnn can run here: JAX's default device is a GPU."""
    return jax.default_backend() == "gpu"


def _kind_reason(kind: str) -> str | None:
    if kind != "lstm":
        return (
            f"jax.experimental.rnn runs only LSTMs, not {kind}; Keras' JAX "
            "layers run as they are"
        )
    return None


def group_reason(group: Any) -> str | None:
    """Why a fusion group must stay with Keras' layers under JAX, or None.

    GRU runs are kept for the wavefront kernel (whose plan, chosen by the
    tuner or set, runs them; the "cudnn" kernel refuses them at the call).
    Besides SimpleRNN runs: an LSTM's go_backwards first layer. Keras 3.15's JAX
    cuDNN LSTM returns a go_backwards layer's sequence flipped back to input
    order, while its own loop (and the TensorFlow and torch backends)
    return it in processing order (bench/diag_jax_states.py). rnnfuse's call follows the loop,
    so fusing would change the numbers of the original model.
    """
    if group.cell == "gru":
        return None
    reason = _kind_reason(group.cell)
    if reason is None and group.views[0].go_backwards:
        reason = (
            "its first layer reads backwards, and Keras' JAX cuDNN LSTM orders "
            "that layer's output differently from its own loop; the layers "
            "run as they are"
        )
    return reason


def unsupported_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why neither of this backend's kernels can run `stack` in `dtype`, or
    None (the call's own checks say which kernel runs it)."""
    from rnnfuse.backends.cuda import library

    cudnn = _cudnn_reason(stack, dtype)
    if cudnn is None:
        return None
    summed = any(stack.input_scale(i) is not None for i in range(stack.num_levels))
    kernel = library.stack_reason(stack.kind, str(dtype), directions=stack.num_directions,
                                  proj_size=stack.proj_size, summed_inputs=summed)
    return None if kernel is None else f"{cudnn}; {kernel}"


def kernel_reason(kernel: str, group: Any, shape: tuple, training: bool = False) -> str | None:
    """Why plan kernel `kernel` cannot run `group`'s (a `FusionGroup`)
    inference calls (with `training`: its training calls, forward and
    backward) at input `shape` (batch, steps, features) here, or None
    (`JaxBackend.kernel_reason`: the wavefront kernel's checks)."""
    if kernel != "wavefront":
        return f"the JAX backend has no {kernel!r} kernel to time"
    from rnnfuse.backends.jax import wavefront

    batch, steps, features = (int(d) for d in shape[:3])
    return wavefront.unsupported_reason(
        group.cell, group.num_layers, group.units, str(group.dtype), batch, steps, features,
        training=training, directions=2 if group.bidirectional else 1,
        proj_size=group.proj_size)


def _cudnn_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why jax.experimental.rnn cannot run `stack` in `dtype`, or None."""
    reason = _kind_reason(stack.kind)
    if reason is not None:
        return reason
    if str(dtype) != "float32":
        return f"jax.experimental.rnn runs float32 only, not {dtype}"
    if stack.proj_size:
        return "jax.experimental.rnn has no LSTM projections"
    return None


def mask_is_supported(mask: Any):
    """Always False: masked calls run Keras' layers (exactly).

    `run_stack` turns a right-padded mask into `seq_lengths`, which matches
    Keras' loop through jax.experimental.rnn's reference on the CPU and in
    the forward pass on the GPU, but the cuDNN call's gradients with
    ragged lengths are wrong (bench/diag_jax_states.py), so masked calls
    are not fused.
    """
    del mask
    return jnp.asarray(False)


def right_padded(mask: Any):
    """True when `mask` [B, T] is right-padded and no sequence is empty
    (what `mask_is_supported` would check if masked calls were fused)."""
    mask = jnp.asarray(mask).astype(bool)
    lengths = mask.sum(axis=1)
    steps = jnp.arange(mask.shape[1])[None, :] < lengths[:, None]
    return jnp.logical_and(jnp.all(mask == steps), jnp.all(lengths > 0))


def _value(variable: Any) -> jax.Array:
    return jnp.asarray(getattr(variable, "value", variable), jnp.float32)


def pack_params(stack: StackSpec) -> jax.Array:
    """The flat weight blob of `stack`, from its live variables."""
    weights, biases = [], []
    for i, level in enumerate(stack.cells):
        scale = stack.input_scale(i)
        for cell in level:
            kernel = _value(cell.kernel)
            if scale is not None:  # [s*W; s*W]: see the module doc
                half = kernel if scale == 1.0 else kernel * scale
                kernel = jnp.concatenate([half, half], axis=0)
            weights += [kernel.T.ravel(), _value(cell.recurrent_kernel).T.ravel()]
            bias = _value(cell.bias) if cell.use_bias else jnp.zeros((4 * stack.units,), jnp.float32)
            biases += [bias, jnp.zeros_like(bias)]
    return jnp.concatenate(weights + biases)


def jax_lstm(*args, **kwargs):
    """`jax.experimental.rnn.lstm`; one module-level name so tests can spy on it."""
    from jax.experimental import rnn

    return rnn.lstm(*args, **kwargs)


def _states(given: Sequence[Any] | None, stack: StackSpec, batch: int) -> jax.Array:
    """[levels * directions, B, H] from the first pseudo-layers' states (rest: 0)."""
    zeros = jnp.zeros((batch, stack.units), jnp.float32)
    given = list(given or [])
    given += [None] * (stack.num_pseudo_layers - len(given))
    return jnp.stack([zeros if s is None else jnp.asarray(s, jnp.float32) for s in given])


def _reverse_within_lengths(x: jax.Array, lengths: jax.Array) -> jax.Array:
    steps = x.shape[1]
    t = jnp.arange(steps)[None, :]
    index = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)
    return jnp.take_along_axis(x, index[:, :, None], axis=1)


def run_stack(sequences: Any, call: StackCall) -> StackRun:
    """Runs the LSTM `call.stack` over `sequences` [B, T, F] in one call.

    The call's `seed`, `algorithm` and `training` are not read, its
    `dropout` must be 0 (see module doc), and its `kernel` "cudnn" or
    "stock" (the same call here), or "wavefront" (`wavefront.run_stack`;
    where it cannot run the call, "cudnn" with the reason in the
    `KernelRun`'s note).

    Returns:
        A `StackRun`: outputs [B, T, D*H] with zeros past each length,
        final h [L*D, B, H], final c [L*D, B, H], and the `KernelRun`.
    """
    if call.kernel not in KERNELS:
        raise NotImplementedError(
            f"the JAX backend runs the kernels {list(KERNELS)}, not {call.kernel!r}")
    if call.kernel == "wavefront":
        return _run_wavefront(sequences, call)
    reason = _cudnn_reason(call.stack, jnp.asarray(sequences).dtype.name)
    if reason is not None:
        raise NotImplementedError(reason)
    if call.dropout:
        raise NotImplementedError("jax.experimental.rnn has no seeded dropout")
    stack, mask = call.stack, call.mask
    x = jnp.asarray(sequences, jnp.float32)
    batch, steps = x.shape[0], x.shape[1]
    if mask is None:
        lengths = jnp.full((batch,), steps, jnp.int32)
    else:
        lengths = jnp.asarray(mask).astype(jnp.int32).sum(axis=1)
    if call.reverse:
        x = jnp.flip(x, 1) if mask is None else _reverse_within_lengths(x, lengths)
    y, h, c = jax_lstm(
        x,
        _states(call.initial_h, stack, batch),
        _states(call.initial_c, stack, batch),
        pack_params(stack),
        lengths,
        input_size=x.shape[-1],
        hidden_size=stack.units,
        num_layers=stack.num_levels,
        dropout=0.0,
        bidirectional=stack.num_directions == 2,
    )
    if mask is not None:
        y = jnp.where(jnp.arange(steps)[None, :, None] < lengths[:, None, None], y, 0.0)
    return StackRun(y, h, c, KernelRun("jax.experimental.rnn.lstm"))


def _run_wavefront(sequences, call: StackCall) -> StackRun:
    """A plan's call on the wavefront kernel; where it cannot run the call,
    jax.experimental.rnn with the reason in the `KernelRun`'s note; where
    neither can, NotImplementedError naming both (the layers then run)."""
    import dataclasses

    from rnnfuse.backends.jax import wavefront

    try:
        return wavefront.run_stack(sequences, call)
    except NotImplementedError as err:
        kernel_err = err
    try:
        run = run_stack(sequences, dataclasses.replace(call, kernel="cudnn"))
    except NotImplementedError as err:
        raise NotImplementedError(f"the wavefront kernel cannot run this call ({kernel_err}), "
                                  f"nor can jax.experimental.rnn ({err})") from None
    return run._replace(kernel=run.kernel.with_note(
        f"the wavefront kernel cannot run this call ({kernel_err}); cuDNN runs it"))


def device_environment() -> dict:
    """The device and library versions that a tuned plan depends on."""
    device = jax.devices()[0]
    return {"device": getattr(device, "device_kind", str(device)), "jax": jax.__version__}


def timed_step(run, x, variables: Sequence[Any], training: bool):
    """A jitted step of `run(x, training)` (+ gradients) for the tuner.

    The variables' values are the jitted function's arguments (through a
    `keras.StatelessScope`), as in a Keras JAX train step.
    """
    variables = list(variables)

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = run(inputs, training)
        return sum(jnp.mean(jnp.square(t.astype(jnp.float32))) for t in jax.tree.leaves(y))

    fn = jax.jit(jax.value_and_grad(loss) if training else loss)
    values = [v.value for v in variables]

    def step():
        out = fn(values, x)
        return out[0] if training else out

    return step
