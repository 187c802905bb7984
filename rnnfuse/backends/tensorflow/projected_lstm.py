"""ProjectedLSTM's TensorFlow fast path: rnnfuse's cuDNN op, or loops over
time with a hand-written gradient (optionally XLA-compiled).

`run` returns what `keras.layers.RNN.inner_loop` returns for one
`ProjectedLSTM` call, and the path it took:

1. With a GPU, no mask, tanh/sigmoid, rnnfuse's op loaded and no XLA around
   the call: one RnnfuseCudnnRnn call with `proj_size` ("cudnn_op").
2. Otherwise one GEMM for the input projection of all steps, then a
   `tf.while_loop` running the recurrent GEMM, the gates and the
   projection; `call.path` picks the variant ("custom" ones need
   tanh/sigmoid, else "while" runs). Path "<variant>[/u<k>]".

The hand-written backward runs two GEMMs a step (dh @ P^T, dz @ R^T) and
the weight gradients after the loop as two GEMMs over all steps, as cuDNN.

Example:

    >>> resolve_path("while"), resolve_path("auto")  # no GPU here
    ('while', 'custom')
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from rnnfuse.backends.base import (
    PROJECTED_LSTM_PATHS,
    ProjectedLSTMCall,
    StackCall,
    StackSpec,
    tanh_sigmoid,
)

__all__ = ["op_reason", "resolve_path", "run"]

logger = logging.getLogger("rnnfuse")


def _tanh_sigmoid(cell) -> bool:
    from rnnfuse.backends import get_backend

    return tanh_sigmoid(cell, get_backend().activation_functions())


def resolve_path(path: str) -> str:
    """"auto" -> "custom_xla" with a visible GPU where XLA compiles, else
    "custom"; any other variant unchanged."""
    if path not in PROJECTED_LSTM_PATHS:
        raise ValueError(
            f"unknown fast path {path!r}; expected one of "
            f"{', '.join(repr(p) for p in PROJECTED_LSTM_PATHS)}."
        )
    if path == "auto":
        gpu = bool(tf.config.list_logical_devices("GPU"))
        return "custom_xla" if gpu and _xla_works() else "custom"
    return path


def run(sequences, initial_state, mask, call: ProjectedLSTMCall):
    """((last_output, outputs, [h, c]), path) for one ProjectedLSTM call.

    Args:
        sequences: [B, T, F]. initial_state: [h [B, P], c [B, U]].
        mask: [B, T] boolean, or None.
        call: the cell and the layer's flags; `call.path` is not "off"."""
    cell = call.cell
    if mask is None and op_reason(cell) is None:
        result = _op_inner_loop(call, sequences, initial_state)
        return _static_shapes(result, sequences, cell, call.return_sequences), "cudnn_op"
    variant = resolve_path(call.path)
    if variant.startswith("custom") and not _tanh_sigmoid(cell):
        variant = variant.replace("custom", "while")
    unroll = _unroll_factor(call.unroll, sequences.shape[1])
    path = variant + (f"/u{unroll}" if unroll > 1 else "")
    result = _fast_inner_loop(call, sequences, initial_state, mask, variant, unroll)
    return _static_shapes(result, sequences, cell, call.return_sequences), path


@functools.cache  # memo: the probe's answer holds for the process
def _xla_works() -> bool:
    """Whether XLA can compile the fast path's loops here (some TensorFlow
    installs lack libdevice or ptxas): compiles them for a 1x1 problem once."""
    with tf.init_scope():
        try:
            forward, backward = _custom_functions(jit=True)
            xw, small = tf.zeros([2, 1, 4]), tf.zeros([1, 1])
            hs, c, gates, cs = forward(xw, tf.zeros([1, 4]), small, small, small, None, 1)
            backward(hs, c, tf.zeros([1, 4]), small, small, small, None, hs, gates, cs, 1)
            return True
        except (tf.errors.OpError, RuntimeError, ValueError) as err:
            # Informational: the layer recovers by itself.
            logger.warning(
                "ProjectedLSTM: XLA cannot compile here, so the fast path "
                "runs without it ('custom'). XLA said: %s",
                str(err)[:300],
            )
            return False


def _fast_inner_loop(call: ProjectedLSTMCall, sequences, initial_state, mask, variant, unroll):
    """What `keras.layers.RNN.inner_loop` returns, computed on the fast path.

    Returns:
        (last_output [B, P], outputs [B, T, P] (or [B, 1, P] when not
        return_sequences, as the generic loop), [h [B, P], c [B, U]])."""
    cell, go_backwards = call.cell, call.go_backwards
    dtype = sequences.dtype
    x = tf.transpose(call.dropped_out(sequences), [1, 0, 2])  # time-major [T, B, F]
    if go_backwards:
        x = tf.reverse(x, [0])
    kernel = tf.cast(cell.kernel, dtype)
    steps, batch, features = tf.shape(x)[0], tf.shape(x)[1], tf.shape(x)[2]
    xw = tf.matmul(tf.reshape(x, tf.stack([steps * batch, features])), kernel)
    if cell.use_bias:
        xw = xw + tf.cast(cell.bias, dtype)
    xw = tf.reshape(xw, tf.stack([steps, batch, 4 * cell.units]))
    recurrent = tf.cast(cell.recurrent_kernel, dtype)
    projection = tf.cast(cell.projection_kernel, dtype)
    h0 = tf.cast(initial_state[0], dtype)
    c0 = tf.cast(initial_state[1], dtype)
    keep = None
    if mask is not None:
        keep = tf.transpose(tf.cast(mask, tf.bool))  # [T, B]
        if go_backwards:
            keep = tf.reverse(keep, [0])
        keep = keep[:, :, None]
    hs, c_last = _recurrence(
        variant, unroll, xw, recurrent, projection, h0, c0, keep, cell.activation,
        cell.recurrent_activation,
    )
    h_last = hs[-1]
    if keep is None:
        outputs = hs
    else:
        # Generic loop: a masked step outputs zeros (zero_output_for_mask) or
        # the previous output, which is zeros before the first unmasked step.
        if call.zero_output_for_mask:
            shown = keep
        else:
            shown = tf.cumsum(tf.cast(keep, tf.int32), axis=0) > 0
        outputs = tf.where(shown, hs, tf.zeros_like(hs))
    last_output = outputs[-1]
    if call.return_sequences:
        outputs = tf.transpose(outputs, [1, 0, 2])
    else:
        outputs = last_output[:, None, :]
    return last_output, outputs, [h_last, c_last]


def _recurrence(variant, unroll, xw, recurrent, projection, h0, c0, keep, act, rec_act):
    """(hs [T, B, P]: h after each step, c after the last step)."""
    jit = variant.endswith("_xla")
    if variant.startswith("custom"):
        return _custom_recurrence(xw, recurrent, projection, h0, c0, keep, jit, unroll)
    fn = _autodiff_function(act, rec_act, jit)
    return fn(xw, recurrent, projection, h0, c0, keep, unroll)


def _unroll_factor(unroll: int, steps) -> int:
    """`unroll` when it divides the (static) number of steps, else 1."""
    if unroll > 1 and steps is not None and int(steps) % unroll == 0:
        return unroll
    return 1


# Memo cache: (activations, jit, ...) -> the traced loop functions.
_FUNCTIONS: dict = {}


def _autodiff_function(act, rec_act, jit):
    """The loop as a function TensorFlow differentiates. With XLA the loop's
    TensorLists may not cross the XLA boundary, so the gradient is a second
    XLA function that reruns the loop under a tape."""
    key = ("while", act, rec_act, jit)
    if key not in _FUNCTIONS:
        def forward(xw, recurrent, projection, h0, c0, keep, unroll):
            hs, c, _, _ = _forward_loop(
                xw, recurrent, projection, h0, c0, keep, act, rec_act, False, unroll
            )
            return hs, c

        if not jit:
            _FUNCTIONS[key] = tf.function(forward, autograph=False)
            return _FUNCTIONS[key]

        compiled = tf.function(forward, jit_compile=True, autograph=False)

        def backward(d_hs, d_c, xw, recurrent, projection, h0, c0, keep, unroll):
            inputs = (xw, recurrent, projection, h0, c0)
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                hs, c = forward(*inputs, keep, unroll)
            return tape.gradient((hs, c), inputs, output_gradients=(d_hs, d_c))

        backward = tf.function(backward, jit_compile=True, autograph=False)

        def run(xw, recurrent, projection, h0, c0, keep, unroll):
            @tf.custom_gradient
            def inner(xw, recurrent, projection, h0, c0):
                hs, c = compiled(*_detached(xw, recurrent, projection, h0, c0), keep, unroll)

                def grad(d_hs, d_c):
                    d_hs = tf.zeros_like(hs) if d_hs is None else d_hs
                    d_c = tf.zeros_like(c) if d_c is None else d_c
                    return backward(
                        d_hs, d_c, xw, recurrent, projection, h0, c0, keep, unroll
                    )

                return (hs, c), grad

            return inner(xw, recurrent, projection, h0, c0)

        _FUNCTIONS[key] = run
    return _FUNCTIONS[key]


def _custom_functions(jit):
    key = ("custom", jit)
    if key not in _FUNCTIONS:
        def forward(xw, recurrent, projection, h0, c0, keep, unroll):
            return _forward_loop(
                xw, recurrent, projection, h0, c0, keep, tf.tanh, tf.sigmoid, True, unroll
            )

        _FUNCTIONS[key] = (
            tf.function(forward, jit_compile=jit, autograph=False),
            tf.function(_backward_loop, jit_compile=jit, autograph=False),
        )
    return _FUNCTIONS[key]


def _custom_recurrence(xw, recurrent, projection, h0, c0, keep, jit, unroll):
    forward, backward = _custom_functions(jit)

    @tf.custom_gradient
    def run(xw, recurrent, projection, h0, c0):
        hs, c_last, gates, cs = forward(
            *_detached(xw, recurrent, projection, h0, c0), keep, unroll
        )

        def grad(d_hs, d_c_last):
            d_hs = tf.zeros_like(hs) if d_hs is None else d_hs
            d_c_last = tf.zeros_like(c_last) if d_c_last is None else d_c_last
            return backward(
                d_hs, d_c_last, recurrent, projection, h0, c0, keep, hs, gates, cs, unroll
            )

        return (hs, c_last), grad

    return run(xw, recurrent, projection, h0, c0)


def _detached(*tensors):
    """The inputs with their gradient stopped, so a recording tape does not
    make TensorFlow call the inner function's differentiable variant."""
    return [tf.stop_gradient(t) for t in tensors]


def _forward_loop(xw, recurrent, projection, h0, c0, keep, act, rec_act, save, unroll):
    """The recurrence over time, given xw = x @ kernel + bias [T, B, 4U].

    Each loop iteration runs `unroll` time steps (a divisor of T).

    Returns:
        (hs [T, B, P], c after the last step [B, U], and with `save` the
        activated gates (i, f, g, o) [T, B, 4U] and the c states [T, B, U]
        for the hand-written backward pass; else None, None)."""
    steps = tf.shape(xw)[0]
    xs = tf.TensorArray(xw.dtype, size=steps, element_shape=xw.shape[1:]).unstack(xw)
    keeps = None
    if keep is not None:
        keeps = tf.TensorArray(tf.bool, size=steps, element_shape=keep.shape[1:])
        keeps = keeps.unstack(keep)

    def array(like, width):
        shape = tf.TensorShape([like.shape[0], width])
        return tf.TensorArray(like.dtype, size=steps, element_shape=shape)

    units = int(recurrent.shape[1]) // 4
    arrays = (array(h0, int(projection.shape[1])),)
    if save:
        arrays += (array(c0, 4 * units), array(c0, units))

    def step(t, h, c, arrays):
        z = xs.read(t) + tf.matmul(h, recurrent)
        z_i, z_f, z_g, z_o = tf.split(z, 4, axis=-1)
        i, f, o = rec_act(z_i), rec_act(z_f), rec_act(z_o)
        g = act(z_g)
        c_new = f * c + i * g
        h_new = tf.matmul(o * act(c_new), projection)
        if keeps is not None:
            k = keeps.read(t)
            c_new = tf.where(k, c_new, c)
            h_new = tf.where(k, h_new, h)
        out = (arrays[0].write(t, h_new),)
        if save:
            out += (
                arrays[1].write(t, tf.concat([i, f, g, o], axis=-1)),
                arrays[2].write(t, c_new),
            )
        return h_new, c_new, out

    def body(t, h, c, arrays):
        for j in range(unroll):
            h, c, arrays = step(t + j, h, c, arrays)
        return t + unroll, h, c, arrays

    _, _, c_last, arrays = tf.while_loop(
        lambda t, *_: t < steps,
        body,
        (tf.constant(0), h0, c0, arrays),
        maximum_iterations=steps // unroll,
    )
    if save:
        return arrays[0].stack(), c_last, arrays[1].stack(), arrays[2].stack()
    return arrays[0].stack(), c_last, None, None


def _backward_loop(
    d_hs, d_c_last, recurrent, projection, h0, c0, keep, hs, gates, cs, unroll
):
    """Gradients of the tanh/sigmoid recurrence, as cuDNN computes them.

    Per step (backwards): dh_new = (dh + d_hs[t]) (masked), dm = dh_new @ P^T,
    the gate derivatives into dz [B, 4U], and dh_prev = dz @ R^T. After the
    loop: dR = H_prev^T dZ and dP = M^T dH_new over all T*B rows, with
    M = o * tanh(c). At a masked step dh_new, dz are zero and dh, dc pass
    through unchanged.

    Returns:
        (d_xw [T, B, 4U], d_recurrent, d_projection, d_h0, d_c0)."""
    dtype = gates.dtype
    steps = tf.shape(gates)[0]
    c_prev = tf.concat([c0[None], cs[:-1]], axis=0)
    tanh_c = tf.tanh(cs)

    def unstack(x):
        ta = tf.TensorArray(x.dtype, size=steps, element_shape=x.shape[1:])
        return ta.unstack(x)

    d_hs_ta, gates_ta, c_prev_ta, tanh_ta = (
        unstack(d_hs),
        unstack(gates),
        unstack(c_prev),
        unstack(tanh_c),
    )
    keep_ta = unstack(tf.cast(keep, dtype)) if keep is not None else None
    dz_ta = tf.TensorArray(dtype, size=steps, element_shape=gates.shape[1:])
    dh_new_ta = tf.TensorArray(dtype, size=steps, element_shape=hs.shape[1:])

    def step(t, dh, dc, dz_ta, dh_new_ta):
        dh_total = dh + d_hs_ta.read(t)
        if keep_ta is not None:
            m = keep_ta.read(t)
            dh_new, dc_in = dh_total * m, dc * m
        else:
            dh_new, dc_in = dh_total, dc
        dm = tf.matmul(dh_new, projection, transpose_b=True)
        i, f, g, o = tf.split(gates_ta.read(t), 4, axis=-1)
        a = tanh_ta.read(t)
        d_o = dm * a
        dc_new = dc_in + dm * o * (1 - a * a)
        dz = tf.concat(
            [
                dc_new * g * i * (1 - i),
                dc_new * c_prev_ta.read(t) * f * (1 - f),
                dc_new * i * (1 - g * g),
                d_o * o * (1 - o),
            ],
            axis=-1,
        )
        dh_prev = tf.matmul(dz, recurrent, transpose_b=True)
        dc_prev = dc_new * f
        if keep_ta is not None:
            dh_prev = dh_prev + dh_total * (1 - m)
            dc_prev = dc_prev + dc * (1 - m)
        return dh_prev, dc_prev, dz_ta.write(t, dz), dh_new_ta.write(t, dh_new)

    def body(k, dh, dc, dz_ta, dh_new_ta):
        for j in range(unroll):
            dh, dc, dz_ta, dh_new_ta = step(steps - 1 - k - j, dh, dc, dz_ta, dh_new_ta)
        return k + unroll, dh, dc, dz_ta, dh_new_ta

    _, d_h0, d_c0, dz_ta, dh_new_ta = tf.while_loop(
        lambda k, *_: k < steps,
        body,
        (tf.constant(0), tf.zeros_like(h0), d_c_last, dz_ta, dh_new_ta),
        maximum_iterations=steps // unroll,
    )
    dz = dz_ta.stack()
    units = int(recurrent.shape[1]) // 4
    d_recurrent, d_projection = _weight_gradients(
        dz, dh_new_ta.stack(), h0, hs, gates, tanh_c, units)
    return dz, d_recurrent, d_projection, d_h0, d_c0


def _weight_gradients(dz, dh_new, h0, hs, gates, tanh_c, units):
    """(dR, dP): dR = H_prev^T dZ and dP = M^T dH_new over all T*B rows,
    with M = o * tanh(c)."""
    proj = int(hs.shape[-1])
    h_prev = tf.concat([h0[None], hs[:-1]], axis=0)
    d_recurrent = tf.matmul(
        tf.reshape(h_prev, [-1, proj]), tf.reshape(dz, [-1, 4 * units]), transpose_a=True
    )
    gated = gates[..., 3 * units :] * tanh_c
    d_projection = tf.matmul(
        tf.reshape(gated, [-1, units]), tf.reshape(dh_new, [-1, proj]), transpose_a=True
    )
    return d_recurrent, d_projection


def _static_shapes(result, sequences, cell, return_sequences):
    """`result` with the static shapes Keras' own loop gives (a graph-mode
    while loop loses the time dimension; an unrolled layer after this one
    needs it)."""
    last_output, outputs, (h, c) = result
    batch, steps = sequences.shape[0], sequences.shape[1]
    p, u = cell.proj_size, cell.units
    for tensor, shape in (
        (last_output, [batch, p]),
        (outputs, [batch, steps if return_sequences else 1, p]),
        (h, [batch, p]),
        (c, [batch, u]),
    ):
        if hasattr(tensor, "set_shape"):
            tensor.set_shape(shape)
    return last_output, outputs, [h, c]


def op_reason(cell) -> str | None:
    """Why rnnfuse's cuDNN op cannot run this cell, or None: a GPU and the op
    loaded, tanh/sigmoid, float16/bfloat16/float32, and no XLA around the
    call (the op has no XLA kernel)."""
    from rnnfuse.backends import tensorflow as tf_backend

    if not _tanh_sigmoid(cell):
        return "cuDNN computes only tanh and sigmoid activations"
    if not tf_backend.is_available():
        return "no GPU"
    if tf_backend.in_xla_context():
        return "the call is compiled by XLA"
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    if str(cell.compute_dtype) == "float64":
        return "float64"
    if not tf_backend.op_loaded():
        return "rnnfuse's cuDNN op is not loaded"
    return tf_backend.unsupported_reason(stack, cell.compute_dtype)


def _op_inner_loop(call: ProjectedLSTMCall, sequences, initial_state):
    """What `keras.layers.RNN.inner_loop` returns (no mask), from one
    RnnfuseCudnnRnn call with `proj_size` (TensorFlow backend)."""
    from rnnfuse.backends import tensorflow as tf_backend

    cell = call.cell
    x = call.dropped_out(sequences)
    if call.go_backwards:
        x = tf.reverse(x, [1])  # no mask: every row is full length
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    outputs, final_h, final_c, _ = tf_backend.run_stack(
        x, StackCall(stack, initial_h=[initial_state[0]], initial_c=[initial_state[1]])
    )
    return call.inner_loop_result(outputs, final_h[0], final_c[0])

