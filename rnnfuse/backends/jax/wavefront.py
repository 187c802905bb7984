"""JAX binding of rnnfuse's wavefront kernel (csrc/wavefront.cuh) through
XLA FFI handlers (csrc/jax_wavefront_*.cc), called with `jax.ffi.ffi_call`
so Keras' jitted steps run it with no host callback.

`forward(x, params, h0, c0, lengths, kind=...)` runs a float16 or bfloat16
stack: layer 0's input projection as one matmul, then the kernel. It is a
`jax.custom_vjp`: under `jax.grad` the saving forward runs, then the
backward recurrence (`backward` "stack": all LSTM layers in one launch;
"layer": one a layer) and the GEMMs for dx, dW and the biases. x [T, B, I]
time-major; params the canonical flat buffer (per layer W_ih [G*H, n] and
W_hh [G*H, H] row-major, then per layer b_ih and b_hh [G*H], PyTorch's gate
orders; `pack_canonical`); h0, c0 [L, B, H]; lengths int32 [B] or None.

The plan is checked when the step is traced: a traced step cannot fall
back, so a launch the driver still refuses fails the step.
`unsupported_reason` gives the checks `run_stack` raises as
NotImplementedError.

Example (on a Hopper GPU):

    >>> y, hy, cy = forward(x, params, h0, c0, None, kind="lstm")  # doctest: +SKIP
    >>> jax.grad(lambda p: forward(x, p, h0, c0, None, kind="lstm")[0].sum())(params)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KERNEL_NAME", "TARGETS", "backward_choice", "ffi_call", "forward",
           "pack_canonical", "register", "run_stack", "unsupported_reason",
           "backward_stack_workspace_bytes", "backward_layer_workspace_bytes",
           "workspace_bytes"]

TARGETS = ("rnnfuse_wf_ffi_forward", "rnnfuse_wf_ffi_forward_saving",
           "rnnfuse_wf_ffi_backward_stack", "rnnfuse_wf_ffi_backward_layer")
# The `KernelRun` name of a call on the kernel.
KERNEL_NAME = "rnnfuse wavefront (XLA FFI)"
_GATES = {"lstm": 4, "gru": 3}

# Workspace sizes as wavefront_host.cc computes them (the build test checks):
# kFlagStride (256) 32-bit flag words a layer, 256-byte aligned; the stack
# backward's kMaxLayers (8) strides + 1 word; the layer backward's 1024 CTAs + 1.
_FLAG_STRIDE, _MAX_LAYERS, _BWD_MAX_CTAS = 256, 8, 1024


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


def workspace_bytes(num_layers: int, units: int, batch: int, steps: int,
                    elem_bytes: int = 2) -> int:
    """rnnfuse_wf_workspace_bytes: the flags, then L-1 sequences."""
    return (_align(num_layers * _FLAG_STRIDE * 4)
            + (num_layers - 1) * steps * batch * units * elem_bytes)


def backward_stack_workspace_bytes(num_layers: int, units: int, batch: int, steps: int) -> int:
    """rnnfuse_wf_backward_stack_workspace_bytes: flags, then float32 dy hand-offs."""
    return (_align((_MAX_LAYERS * _FLAG_STRIDE + 1) * 4)
            + max(num_layers - 1, 0) * steps * batch * units * 4)


def backward_layer_workspace_bytes() -> int:
    """rnnfuse_wf_backward_workspace_bytes: one flag a CTA and the timed-out word."""
    return _align((_BWD_MAX_CTAS + 1) * 4)


# -- registration ----------------------------------------------------------------------

_LOCK = threading.Lock()
_REGISTERED: dict[str, str | None] = {}  # "targets" -> None, or why they are not


def register() -> str | None:
    """Builds and registers the CUDA handlers once a process; None, or why
    the kernel cannot run under JAX here."""
    from rnnfuse.backends.jax import ffi_build

    return ffi_build.load_and_register(_REGISTERED, _LOCK, "the wavefront kernel",
                                       ffi_build.build_ffi_library, TARGETS)


def ffi_call(target: str, results, *operands, **attributes):
    """`jax.ffi.ffi_call`, as one name the CPU tests can replace."""
    return jax.ffi.ffi_call(target, results)(*operands, **attributes)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def _empty(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _lengths(lengths) -> jax.Array:
    return _empty(jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)


def _call_forward(xproj, params, h0, c0, lengths, *, kind: str, input_size: int, save: bool,
                  variant: int = 0):
    """The forward target on projected inputs: (y, hy, cy or None) and, with
    `save`, the saved (hseq [L-1, T, B, H], gates, cseq)."""
    steps, batch, _ = xproj.shape
    num_layers, _, units = h0.shape
    dt = xproj.dtype
    lstm = kind == "lstm"
    elem = jnp.dtype(dt).itemsize
    words = workspace_bytes(num_layers, units, batch, steps, elem) // elem
    results = [_sds((steps, batch, units), dt), _sds(h0.shape, dt),
               _sds(h0.shape if lstm else (0,), dt), _sds((words,), dt)]
    if save:
        results += [_sds((num_layers, steps, batch, 4 * units), jnp.float32),
                    _sds((num_layers, steps, batch, units), jnp.float32)]
    out = ffi_call(TARGETS[1] if save else TARGETS[0], results, xproj, params, h0,
                   c0 if lstm else _empty(dt), lengths, gru=np.int32(not lstm),
                   input_size=np.int32(input_size), variant=np.int32(variant))
    y, hy, cy = out[0], out[1], (out[2] if lstm else None)
    if not save:
        return y, hy, cy
    # The layers' sequences below the top sit at the workspace's end.
    seq = (num_layers - 1) * steps * batch * units
    hseq = out[3][words - seq:].reshape(num_layers - 1, steps, batch, units)
    return y, hy, cy, (hseq, out[4], out[5])


def _call_backward_stack(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths,
                         variant: int = 0):
    """The stack backward target: (dgates [L, T, B, 4H], dh0, dc0 [L, B, H] float32)."""
    num_layers, steps, batch, units = cseq.shape
    nbytes = backward_stack_workspace_bytes(num_layers, units, batch, steps)
    results = [_sds(gates.shape, dy.dtype), _sds(c0.shape, jnp.float32),
               _sds(c0.shape, jnp.float32), _sds((nbytes,), jnp.uint8)]
    dgates, dh0, dc0, _ = ffi_call(TARGETS[2], results, params, gates, cseq, c0, dy, dhy, dcy,
                                   lengths, input_size=np.int32(input_size),
                                   variant=np.int32(variant))
    return dgates, dh0, dc0


def _call_backward_layer(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, kind: str):
    """The layer backward target: (dgates [T, B, 4H], dh0 [B, H] float32,
    dc0 [B, H] float32 or None for a GRU)."""
    lstm = kind == "lstm"
    dt = dy.dtype
    state = dhy.shape
    results = [_sds(gates.shape, dt), _sds(state, jnp.float32),
               _sds(state if lstm else (0,), jnp.float32),
               _sds((backward_layer_workspace_bytes(),), jnp.uint8)]
    dgates, dh0, dc0, _ = ffi_call(TARGETS[3], results, w_hh, gates, cseq,
                                   c0 if lstm else _empty(dt), dy, dhy,
                                   dcy if lstm else _empty(dt), lengths, gru=np.int32(not lstm))
    return dgates, dh0, (dc0 if lstm else None)


def _matmul(a, b, dtype):
    """a @ b accumulated in float32, rounded to `dtype` (the GEMMs' rule)."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _layer_views(params, num_layers: int, units: int, input_size: int, gates: int):
    """Per layer (w_ih [G*H, n], w_hh [G*H, H]) of the canonical buffer, and
    where the biases start."""
    gh, off, views = gates * units, 0, []
    for layer in range(num_layers):
        n = input_size if layer == 0 else units
        views.append((params[off: off + gh * n].reshape(gh, n),
                      params[off + gh * n: off + gh * (n + units)].reshape(gh, units)))
        off += gh * (n + units)
    return views, off


def _project(x, params, gh: int):
    """Layer 0's x W_ih^T [T, B, gh] (no bias) in x's dtype."""
    steps, batch, input_size = x.shape
    w_ih0 = params[: gh * input_size].reshape(gh, input_size)
    return _matmul(x.reshape(steps * batch, input_size), w_ih0.T, x.dtype).reshape(
        steps, batch, gh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _stack(x, params, h0, c0, lengths, kind, backward):
    input_size, units = x.shape[2], h0.shape[2]
    return _call_forward(_project(x, params, _GATES[kind] * units), params, h0, c0, lengths,
                         kind=kind, input_size=input_size, save=False,
                         variant=_library().FORWARD_VARIANT)


def _stack_fwd(x, params, h0, c0, lengths, kind, backward):
    input_size, units = x.shape[2], h0.shape[2]
    y, hy, cy, saved = _call_forward(_project(x, params, _GATES[kind] * units), params, h0, c0,
                                     lengths, kind=kind, input_size=input_size, save=True,
                                     variant=_library().FORWARD_VARIANT)
    return (y, hy, cy), (x, params, h0, c0, lengths, y, saved)


def _stack_bwd(kind, backward, residuals, cotangents):
    x, params, h0, c0, lengths, y, saved = residuals
    dy, dhy, dcy = cotangents
    dt = x.dtype
    dy, dhy = dy.astype(dt), dhy.astype(dt)
    dcy = dcy.astype(dt) if kind == "lstm" else None
    dx, dparams, dh0, dc0 = _stack_gradients(kind, backward, params, x, h0, c0, lengths, y,
                                             saved, dy, dhy, dcy)
    return dx, dparams, dh0, (dc0 if kind == "lstm" else None), None


_stack.defvjp(_stack_fwd, _stack_bwd)


def _stack_gradients(kind, backward, params, x, h0, c0, lengths, y, saved, dy, dhy, dcy):
    """(dx, dparams, dh0, dc0 or None) from the saving forward's tensors:
    the backward recurrences ("layer": dy^l = dgates^{l+1} W_ih^{l+1} between
    launches), then dW_ih^l = dgates^T x^l, dW_hh^l = dgates^T [h0, h_0..h_{T-2}],
    db = sum of dgates (a GRU's input side (dr, dz, dn_x), recurrent side
    (dr, dz, dn_h): wavefront.cuh, "The GRU backward")."""
    hseq, gates, cseq = saved
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    dt = x.dtype
    lstm = kind == "lstm"
    views, _ = _layer_views(params, num_layers, units, input_size, _GATES[kind])
    if backward == "stack":
        dgates, dh0, dc0 = _call_backward_stack(params, input_size, gates, cseq, c0, dy, dhy,
                                                dcy, lengths,
                                                variant=_library().STACK_BACKWARD_VARIANT)
        per_layer = [dgates[layer] for layer in range(num_layers)]
    else:
        per_layer, dh0s, dc0s = [None] * num_layers, [None] * num_layers, [None] * num_layers
        grad = dy
        for layer in reversed(range(num_layers)):
            w_ih, w_hh = views[layer]
            dg, dh0s[layer], dc0s[layer] = _call_backward_layer(
                w_hh, gates[layer], cseq[layer], c0[layer] if lstm else None, grad, dhy[layer],
                dcy[layer] if lstm else None, lengths, kind=kind)
            per_layer[layer] = dg
            if layer > 0:
                grad = _matmul(_input_side(dg, units, lstm).reshape(steps * batch, -1), w_ih,
                               dt).reshape(steps, batch, units)
        dh0 = jnp.stack(dh0s)
        dc0 = jnp.stack(dc0s) if lstm else None
    mats, biases = [], []
    for layer, dg in enumerate(per_layer):
        inp = x if layer == 0 else hseq[layer - 1]
        out = y if layer == num_layers - 1 else hseq[layer]
        h_prev = jnp.concatenate([h0[layer:layer + 1], out[:-1]]).reshape(steps * batch, units)
        d_in = _input_side(dg, units, lstm).reshape(steps * batch, -1)
        d_rec = _recurrent_side(dg, units, lstm).reshape(steps * batch, -1)
        mats += [_matmul(d_in.T, inp.reshape(steps * batch, -1), dt).reshape(-1),
                 _matmul(d_rec.T, h_prev, dt).reshape(-1)]
        biases += [d_in.sum(0, dtype=jnp.float32).astype(dt),
                   d_rec.sum(0, dtype=jnp.float32).astype(dt)]
    w_ih0 = views[0][0]
    d_in0 = _input_side(per_layer[0], units, lstm).reshape(steps * batch, -1)
    dx = _matmul(d_in0, w_ih0, dt).reshape(steps, batch, input_size)
    return (dx, jnp.concatenate(mats + biases), dh0.astype(dt),
            dc0.astype(dt) if lstm else None)


def _input_side(dgates, units: int, lstm: bool):
    """The gate gradients the input projection sees: an LSTM's four, a
    GRU's (dr, dz, dn_x)."""
    return dgates if lstm else dgates[..., :3 * units]


def _recurrent_side(dgates, units: int, lstm: bool):
    """... and the recurrent one: an LSTM's four, a GRU's (dr, dz, dn_h)."""
    if lstm:
        return dgates
    return jnp.concatenate([dgates[..., :2 * units], dgates[..., 3 * units:]], axis=-1)


def forward(x, params, h0, c0, lengths, *, kind: str, backward: str = "layer"):
    """The stack on the kernel, differentiable (`backward` "stack", LSTM
    only, or "layer"): (y [T, B, H], hy [L, B, H], cy [L, B, H] or None).

    Raises:
        ValueError: an unknown kind or backward, an LSTM without c0, or a
            GRU with backward "stack".
    """
    if kind not in _GATES:
        raise ValueError(f"forward: kind must be one of {tuple(_GATES)}; received {kind!r}")
    if backward not in ("stack", "layer"):
        raise ValueError(f"forward: backward must be 'stack' or 'layer'; received {backward!r}")
    if kind == "lstm" and c0 is None:
        raise ValueError("forward: an LSTM needs c0 [L, B, H]")
    if kind == "gru" and backward == "stack":
        raise ValueError("forward: the reverse-wavefront backward runs LSTM stacks only; a GRU "
                         "runs backward='layer'")
    if kind == "gru":
        c0 = _empty(x.dtype)
    return _stack(x, params, h0, c0, _lengths(lengths), kind, backward)


def _zrh_to_rzn(w, units: int):
    """Keras' GRU gate blocks (z, r, h) along axis 0 -> PyTorch's (r, z, n)."""
    return jnp.concatenate([w[units:2 * units], w[:units], w[2 * units:]], axis=0)


def pack_canonical(stack, dtype) -> jax.Array:
    """The canonical flat buffer of a unidirectional `stack` in `dtype`, read
    from the live variables inside the trace so gradients reach them (an
    LSTM's b_hh is 0; a GRU's reset_after bias rows are b_ih and b_hh)."""
    kind, units = stack.kind, stack.units
    rows = _GATES[kind] * units
    mats, biases = [], []
    for (cell,) in stack.cells:
        value = lambda v: jnp.asarray(getattr(v, "value", v)).astype(dtype)  # noqa: E731
        w_ih, w_hh = value(cell.kernel).T, value(cell.recurrent_kernel).T
        if cell.use_bias:
            bias = value(cell.bias)
        else:
            bias = jnp.zeros((2, rows) if kind == "gru" else (rows,), dtype)
        if kind == "gru":
            w_ih, w_hh = _zrh_to_rzn(w_ih, units), _zrh_to_rzn(w_hh, units)
            bias = bias.reshape(2, rows)
            b_ih, b_hh = _zrh_to_rzn(bias[0], units), _zrh_to_rzn(bias[1], units)
        else:
            b_ih, b_hh = bias.reshape(rows), jnp.zeros((rows,), dtype)
        mats += [w_ih.reshape(-1), w_hh.reshape(-1)]
        biases += [b_ih, b_hh]
    return jnp.concatenate(mats + biases)


def _library():
    from rnnfuse.backends.cuda import library

    return library


# A Keras distribution replicates a step over GPUs of one kind: ask the first.
_ORDINAL = 0


def unsupported_reason(kind: str, num_layers: int, units: int, dtype: str, batch: int,
                       steps: int, input_size: int, *, training: bool = False,
                       **structure) -> str | None:
    """Why the kernel cannot run this stack's calls here (structure, FFI
    library, forward plan, and with `training` the backward plan), or None."""
    library = _library()
    reason = library.stack_reason(kind, str(dtype), **structure) or register()
    if reason is None:
        reason = library.device_reason(kind, num_layers, units, int(batch), int(steps),
                                       int(input_size), _ORDINAL)
    if reason is None and training:
        reason = library.backward_reason(kind, units, int(batch), int(steps), _ORDINAL)
    return reason


def backward_choice(kind: str, num_layers: int, units: int, batch: int, steps: int):
    """The backward a training call runs: "auto" (a GRU's is per layer)."""
    library = _library()
    unavailable = None if kind == "lstm" else "a GRU runs the per-layer backward"
    return library.choose_backward("auto", kind, num_layers, units, batch, steps, _ORDINAL,
                                   unavailable=unavailable)


def _states(given: Sequence[Any] | None, stack, batch: int, dtype) -> jax.Array:
    zeros = jnp.zeros((batch, stack.units), dtype)
    given = list(given or []) + [None] * stack.num_pseudo_layers
    return jnp.stack([zeros if s is None else jnp.asarray(s).astype(dtype)
                      for s in given[:stack.num_pseudo_layers]])


def run_stack(sequences, call) -> Any:
    """The JAX backend's `run_stack` on the kernel: a `StackRun` (outputs
    [B, T, H] zeros past each length, final h and c [L, B, H]). A training
    call also needs the backward plan; the call's seed and algorithm are not read.

    Raises:
        NotImplementedError: the kernels cannot run this call (the reason).
    """
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    stack, mask, training = call.stack, call.mask, call.training
    x = jnp.asarray(sequences)
    batch, steps, input_size = (int(d) for d in x.shape)
    summed = any(stack.input_scale(i) is not None for i in range(stack.num_levels))
    reason = unsupported_reason(stack.kind, stack.num_levels, stack.units, x.dtype.name, batch,
                                steps, input_size, training=training,
                                directions=stack.num_directions, proj_size=stack.proj_size,
                                summed_inputs=summed, dropout=call.dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    lengths = None
    if mask is not None:
        lengths = jnp.asarray(mask).astype(jnp.int32).sum(axis=1)
    if call.reverse:
        if mask is not None:
            raise NotImplementedError("the wavefront kernel's JAX call reverses unmasked "
                                      "sequences only")
        x = jnp.flip(x, 1)
    choice = backward_choice(stack.kind, stack.num_levels, stack.units, batch, steps)
    y, hy, cy = forward(jnp.swapaxes(x, 0, 1), pack_canonical(stack, x.dtype),
                        _states(call.initial_h, stack, batch, x.dtype),
                        _states(call.initial_c, stack, batch, x.dtype) if stack.kind == "lstm"
                        else None, lengths, kind=stack.kind, backward=choice.backward)
    return StackRun(jnp.swapaxes(y, 0, 1), hy, cy,
                    KernelRun(KERNEL_NAME, f"backward={choice.backward}" if training else ""))
