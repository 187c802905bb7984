"""JAX backend: LSTM, GRU and SimpleRNN stacks as one call of rnnfuse's
cuDNN core, and LSTM and GRU stacks on rnnfuse's wavefront kernel, both
through XLA FFI.

Plan kernels "cudnn" and "stock" (JAX has no other fused cuDNN call) run
the core (`cudnn_core`): projections, bidirectional, right-padded masks as
lengths, seeded dropout, float32/float16/bfloat16/float64, the plan's algorithm in
both passes. A masked call, or an algorithm cuDNN refuses when traced, runs
the standard algorithm with the reason in the note; a call the core cannot
run raises NotImplementedError and the original layers run. Plan kernel
"wavefront" runs half-precision LSTM and GRU stacks on Hopper
(`kernel_reason`; bidirectional ones: `wavefront_bidirectional`); a call
it refuses runs the core.

Parameters: the core's canonical flat layout (`pack_params`), built from the
live variables inside the traced function so gradients reach them: per
pseudo-layer W = kernel^T and R = recurrent_kernel^T as gate blocks of rows
(a GRU's reordered z, r, h -> r, z, h), an LSTMP's projection^T; then the
input and recurrent biases (an LSTM's and SimpleRNN's Keras bias is the
recurrent one). A level reading a Bidirectional merged by "sum" or "ave"
gets W = [s*W; s*W]^T, s = 1 or 1/2, fed [fwd, bwd]. Not fused under JAX:
an LSTM's go_backwards first layer (`group_reason`).

Example (packing only; the call itself needs a GPU):

    >>> import keras
    >>> from rnnfuse.backends.base import StackSpec
    >>> cell = keras.layers.LSTMCell(4)
    >>> cell.build((None, 3))
    >>> int(pack_params(StackSpec("lstm", 4, ((cell,),))).shape[0])
    144
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import keras
import numpy as np

from rnnfuse.backends.base import GATES, StackCall, StackRun, StackSpec
from rnnfuse.backends.cuda.cudnn_core import prefers_small_h
from rnnfuse.reasons import KernelRun

__all__ = [
    "AheadOfTimeStep",
    "KERNELS",
    "allow_tf32",
    "concrete_bool",
    "device_environment",
    "gradients_of",
    "group_reason",
    "is_available",
    "kernel_reason",
    "mask_is_supported",
    "pack_params",
    "right_padded",
    "run_stack",
    "timed_step",
    "tuned_algorithms",
    "unsupported_reason",
]

# "cudnn" and "stock" are both the core's call: JAX has no other fused cuDNN RNN.
KERNELS = ("cudnn", "stock", "wavefront")


def concrete_bool(value: Any) -> bool | None:
    """`value` as a Python bool, or None for a tracer (no value yet)."""
    if isinstance(value, jax.core.Tracer):
        return None
    return bool(value)


def is_available() -> bool:
    """Whether the fused calls can run here: JAX's default device is a GPU."""
    return jax.default_backend() == "gpu"


def tuned_algorithms() -> tuple:
    """`base.TUNED_ALGORITHMS` where the cuDNN core runs here, else (None,)."""
    from rnnfuse.backends.base import TUNED_ALGORITHMS
    from rnnfuse.backends.jax import cudnn_core

    if not is_available() or cudnn_core.core_reason("float32") is not None:
        return (None,)
    return TUNED_ALGORITHMS


def group_reason(group: Any) -> str | None:
    """Why a fusion group must stay with Keras' layers under JAX, or None.

    Keras' JAX cuDNN LSTM returns a go_backwards layer's sequence in input
    order, its own loop in processing order; rnnfuse follows the loop, so
    fusing such a first layer would change the original model's numbers.
    """
    if group.cell == "lstm" and group.views[0].go_backwards:
        return ("its first layer reads backwards, and Keras' JAX cuDNN LSTM orders "
                "that layer's output differently from its own loop; the layers "
                "run as they are")
    return None


def unsupported_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why neither kernel can run `stack` in `dtype`, or None."""
    from rnnfuse.backends.cuda import library
    from rnnfuse.backends.jax import cudnn_core

    core = cudnn_core.core_reason(str(dtype))
    if core is None:
        return None
    if stack.num_directions == 2:
        from rnnfuse.backends.jax import wavefront_bidirectional as bidir

        kernel = bidir.structure_reason(stack.kind, str(dtype), proj_size=stack.proj_size)
    else:
        summed = any(stack.input_scale(i) is not None for i in range(stack.num_levels))
        kernel = library.stack_reason(stack.kind, str(dtype), proj_size=stack.proj_size,
                                      summed_inputs=summed)
    return None if kernel is None else f"{core}; {kernel}"


def kernel_reason(kernel: str, group: Any, shape: tuple, training: bool = False) -> str | None:
    """Why plan kernel `kernel` cannot run `group`'s calls (with `training`:
    forward and backward) at input `shape` (batch, steps, features), or None."""
    if kernel != "wavefront":
        return f"the JAX backend has no {kernel!r} kernel to time"
    from rnnfuse.backends.jax import wavefront, wavefront_bidirectional

    batch, steps, features = (int(d) for d in shape[:3])
    check = (wavefront_bidirectional.unsupported_reason if group.bidirectional
             else wavefront.unsupported_reason)
    return check(group.cell, group.num_layers, group.units, str(group.dtype), batch, steps,
                 features, training=training, proj_size=group.proj_size)


def mask_is_supported(mask: Any):
    """`right_padded`: the core runs such a mask as sequence lengths."""
    return right_padded(mask)


def right_padded(mask: Any):
    """True when `mask` [B, T] is right-padded and no sequence is empty."""
    mask = jnp.asarray(mask).astype(bool)
    lengths = mask.sum(axis=1)
    steps = jnp.arange(mask.shape[1])[None, :] < lengths[:, None]
    return jnp.logical_and(jnp.all(mask == steps), jnp.all(lengths > 0))


def _value(variable: Any, dtype) -> jax.Array:
    return jnp.asarray(getattr(variable, "value", variable)).astype(dtype)


def _zrh_to_rzh(x: jax.Array, axis: int) -> jax.Array:
    """Keras' z, r, h gate blocks along `axis` -> cuDNN's r, z, h."""
    z, r, h = jnp.split(x, 3, axis=axis)
    return jnp.concatenate([r, z, h], axis=axis)


def _cell_params(kind: str, cell: Any, dtype, input_scale: float | None) -> tuple[list, list]:
    """(weights, biases) of one pseudo-layer, flattened in the canonical order."""
    gates = GATES[kind]
    kernel = _value(cell.kernel, dtype)
    if input_scale is not None:  # [s*W; s*W]: see the module doc
        half = kernel if input_scale == 1.0 else kernel * jnp.asarray(input_scale, dtype)
        kernel = jnp.concatenate([half, half], axis=0)
    recurrent = _value(cell.recurrent_kernel, dtype)
    units = int(recurrent.shape[1]) // gates
    w, r = kernel.T, recurrent.T  # [G*H, n], [G*H, R]: gate blocks of rows
    if cell.use_bias:
        bias = _value(cell.bias, dtype)
    else:
        bias = jnp.zeros((2 if kind == "gru" else 1, gates * units), dtype)
    if kind == "gru":
        w, r = _zrh_to_rzh(w, 0), _zrh_to_rzh(r, 0)
        biases = [_zrh_to_rzh(bias.reshape(2, gates * units), 1).reshape(-1)]
    else:
        biases = [jnp.zeros((gates * units,), dtype), bias.reshape(-1)]
    weights = [w.reshape(-1), r.reshape(-1)]
    projection = getattr(cell, "projection_kernel", None)
    if projection is not None:  # [H, P] -> cuDNN's [P, H]
        weights.append(_value(projection, dtype).T.reshape(-1))
    return weights, biases


def pack_params(stack: StackSpec, dtype="float32") -> jax.Array:
    """The core's canonical flat buffer of `stack` in `dtype` (module doc)."""
    from rnnfuse.backends.base import canonical_pieces

    return jnp.concatenate(canonical_pieces(stack, _cell_params, dtype))


def _states(given: Sequence[Any] | None, stack: StackSpec, batch: int, dtype,
            width: int) -> jax.Array:
    """[levels * directions, B, width] from the first pseudo-layers' states (rest: 0)."""
    zeros = jnp.zeros((batch, width), dtype)
    given = list(given or [])
    given += [None] * (stack.num_pseudo_layers - len(given))
    return jnp.stack([zeros if s is None else jnp.asarray(s).astype(dtype) for s in given])


def _reverse_within_lengths(x: jax.Array, lengths: jax.Array) -> jax.Array:
    steps = x.shape[1]
    t = jnp.arange(steps)[None, :]
    index = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)
    return jnp.take_along_axis(x, index[:, :, None], axis=1)


def allow_tf32() -> bool:
    """Whether float32 calls may use TF32: where JAX's own matmuls may
    (`jax_default_matmul_precision`), as Keras' layers then do."""
    precision = jax.config.jax_default_matmul_precision
    return str(precision or "default").lower() in ("default", "fastest", "bfloat16",
                                                  "tensorfloat32")


def run_stack(sequences: Any, call: StackCall) -> StackRun:
    """Runs `call.stack` over `sequences` [B, T, F] (in the compute dtype)
    in one call of the cuDNN core or, for kernel "wavefront", that kernel.
    It reads initial_h [B, R] (R = proj_size or units), initial_c [B, H], a
    right-padded mask as sequence lengths, and cuDNN's dropout between
    levels seeded by seed + seed2 * 2**31.

    Returns:
        A `StackRun`: outputs [B, T, D*R] with zeros past each length,
        final h [L*D, B, R], final c [L*D, B, H] or None, and the `KernelRun`.

    Raises:
        NotImplementedError: the core cannot run this call; the original layers run.
    """
    if call.kernel not in KERNELS:
        raise NotImplementedError(
            f"the JAX backend runs the kernels {list(KERNELS)}, not {call.kernel!r}")
    if call.kernel == "wavefront":
        return _run_wavefront(sequences, call)
    return _run_core(sequences, call)


def _run_core(sequences, call: StackCall) -> StackRun:
    """`run_stack` on the cuDNN core (see there)."""
    from rnnfuse.backends.cuda.cudnn_core import CoreError
    from rnnfuse.backends.jax import cudnn_core
    from rnnfuse.plan import Algorithm

    stack, mask = call.stack, call.mask
    x = jnp.asarray(sequences)
    dtype = x.dtype.name
    reason = cudnn_core.core_reason(dtype)
    if reason is not None:
        raise NotImplementedError(reason)
    batch, steps, features = (int(d) for d in x.shape)
    if mask is None:
        lengths = jnp.full((batch,), steps, jnp.int32)
    else:
        lengths = jnp.asarray(mask).astype(jnp.int32).sum(axis=1)
    if call.reverse:
        x = jnp.flip(x, 1) if mask is None else _reverse_within_lengths(x, lengths)
    algorithm, note = call.algorithm, None
    if dtype == "float64" and algorithm is not None and not algorithm.is_standard:
        # cuDNN's small-h algorithm has no float64 (PyTorch guards it too).
        algorithm, note = None, "float64 runs the standard algorithm"
    if algorithm is None and dtype != "float64" and prefers_small_h(
            stack.kind, stack.units, stack.proj_size, mask is not None):
        algorithm = Algorithm.parse("persistent_static_small_h")
        note = "PyTorch's choice for this state width: persistent static small-h"
    if mask is not None and algorithm is not None and not algorithm.is_standard:
        # cuDNN's persistent algorithms refuse padded sequence lengths.
        note = "a masked call runs the standard algorithm (padded lengths)"
        algorithm = None
    tf32 = dtype == "float32" and allow_tf32()

    def config_for(algo):
        return cudnn_core.CoreConfig(
            stack.kind, stack.num_levels, stack.units, features,
            directions=stack.num_directions, proj_size=stack.proj_size,
            algorithm=cudnn_core.algorithm_code(algo, dtype, tf32), allow_tf32=tf32,
            dropout=float(call.dropout), seed=int(call.seed[0]) + (int(call.seed[1]) << 31),
            full_lengths=mask is None)

    config = config_for(algorithm)
    try:
        # Ask cuDNN while traced: a running step cannot fall back.
        cudnn_core.reserve_bytes(config, dtype, steps, batch)
    except CoreError as err:
        if algorithm is None or algorithm.is_standard or not err.unsupported:
            raise NotImplementedError(f"the cuDNN core refused this call ({err})") from None
        note = f"cuDNN refused {algorithm.name} for this call ({err}); the standard algorithm runs"
        algorithm = None
        config = config_for(None)
        try:
            cudnn_core.reserve_bytes(config, dtype, steps, batch)
        except CoreError as err2:
            raise NotImplementedError(f"the cuDNN core refused this call ({err2})") from None
    except Exception as err:  # noqa: BLE001 - the core does not load: the layers run
        raise NotImplementedError(f"the cuDNN core is not available ({err})") from None
    lstm = stack.kind == "lstm"
    h0 = _states(call.initial_h, stack, batch, x.dtype, stack.output_size)
    c0 = _states(call.initial_c, stack, batch, x.dtype, stack.units) if lstm else None
    y, hy, cy = cudnn_core.rnn(jnp.swapaxes(x, 0, 1), h0, c0, pack_params(stack, x.dtype),
                               lengths, config=config, training=config.dropout > 0)
    ran = KernelRun(cudnn_core.KERNEL_NAME, (algorithm or Algorithm()).name, note)
    return StackRun(jnp.swapaxes(y, 0, 1), hy, cy, ran)


def _run_wavefront(sequences, call: StackCall) -> StackRun:
    """The wavefront kernel, else the core with the reason in the note, else
    NotImplementedError naming both."""
    import dataclasses

    from rnnfuse.backends.jax import wavefront, wavefront_bidirectional

    run = (wavefront_bidirectional.run_stack if call.stack.num_directions == 2
           else wavefront.run_stack)
    try:
        return run(sequences, call)
    except NotImplementedError as err:
        kernel_err = err
    try:
        run = _run_core(sequences, dataclasses.replace(call, kernel="cudnn", algorithm=None))
    except NotImplementedError as err:
        raise NotImplementedError(f"the wavefront kernel cannot run this call ({kernel_err}), "
                                  f"nor can the cuDNN core ({err})") from None
    return run._replace(kernel=run.kernel.with_note(
        f"the wavefront kernel cannot run this call ({kernel_err}); cuDNN runs it"))


def device_environment() -> dict:
    """The device and library versions that a tuned plan depends on."""
    device = jax.devices()[0]
    return {"device": getattr(device, "device_kind", str(device)), "jax": jax.__version__}


def timed_step(run, x, variables: Sequence[Any], training: bool):
    """A jitted step of `run(x, training)` (+ gradients) for the tuner, the
    variables' values passed as arguments as in a Keras JAX train step."""
    variables = list(variables)
    loss = _square_loss(variables, run, training, jnp.mean)
    fn = jax.jit(jax.value_and_grad(loss) if training else loss)
    return AheadOfTimeStep(fn, ([v.value for v in variables], x), training)


class AheadOfTimeStep:
    """`Timing.timed_step`'s step: `trace()` lowers `fn` (the plan may refuse).

    >>> v = keras.Variable([2.0])
    >>> step = timed_step(lambda x, training: x * v, jnp.ones(1), [v], True)
    >>> step.trace(); step.compile(); float(step())
    4.0
    """

    def __init__(self, fn, args: tuple, training: bool):
        self._fn, self._args, self._training = fn, args, training
        self._lowered = self._compiled = None
        self._lock = threading.Lock()

    def trace(self) -> None:
        if self._lowered is None and self._compiled is None:
            self._lowered = self._fn.lower(*self._args)

    def compile(self) -> None:
        with self._lock:
            if self._compiled is None:
                self.trace()
                self._compiled, self._lowered = self._lowered.compile(), None

    def __call__(self):
        if self._compiled is None:
            self.compile()
        out = self._compiled(*self._args)
        return out[0] if self._training else out


def _square_loss(variables: list, run, training: bool, reduce):
    """(values, inputs) -> `reduce` of `run(inputs, training)`'s squares."""

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = run(inputs, training)
        return sum(reduce(jnp.square(t.astype(jnp.promote_types(t.dtype, jnp.float32))))
                   for t in jax.tree.leaves(y))

    return loss


def gradients_of(calls: Sequence[tuple], variables: Sequence[Any]) -> list[list]:
    """`Timing.gradients_of` in one jitted program, the variables' values
    and the inputs its arguments (so XLA folds no weight in).

    >>> v = keras.Variable([2.0])
    >>> gradients_of([(lambda x, training: x * v, jnp.ones(1), False)], [v])[0][0].tolist()
    [4.0]
    """
    variables = list(variables)
    grads = [jax.grad(_square_loss(variables, run, training, jnp.sum)) for run, _, training in calls]

    def program(values, inputs):
        return [grad(values, x) for grad, x in zip(grads, inputs)]

    out = jax.jit(program)([v.value for v in variables], [x for _, x, _ in calls])
    return [[np.asarray(g, np.float64) for g in each] for each in out]
