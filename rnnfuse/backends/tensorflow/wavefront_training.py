"""Training an LSTM or GRU stack on rnnfuse's wavefront kernels in TensorFlow:
the twin of the torch binding's training path (torch/wavefront.py), over
the ops of csrc/rnnfuse_wavefront_op.cc.

`trainable_forward(x, params, h0, c0, lengths, backward="auto")` is the
forward (`forward_saving`: layer 0's projection as one matmul, then the
kernel saving every layer's gates and c) with the kernels' gradient
(`tf.custom_gradient`): `backward_stack_wavefront` (every layer's
recurrence in ONE launch, LSTM only) where the stack backward's plan
accepts the stack, else `backward_stack` (per layer `backward_layer`),
then dx, dW and the biases as GEMMs.

Inputs are time-major: x [T, B, I] float16 or bfloat16 (float64 with the
references); params the canonical flat buffer (`pack_params`: per layer
W_ih [4H, n] and W_hh [4H, H] row-major, then per layer b_ih, b_hh [4H]);
h0, c0 [L, B, H]; lengths int32 [B] or None. The `reference_*` functions
are the kernels in plain TensorFlow, for the CPU tests.

Example (on a Hopper GPU):

    >>> with tf.GradientTape() as tape:  # doctest: +SKIP
    ...     tape.watch(params)
    ...     y, hy, cy = trainable_forward(x, params, h0, c0)
    ...     loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
    >>> dparams = tape.gradient(loss, params)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

__all__ = ["backward_choice", "backward_layer", "backward_stack", "backward_stack_kernel",
           "backward_stack_wavefront", "forward_saving", "recurrence_reference",
           "reference_forward", "reference_forward_saving", "stack_recurrence_reference",
           "trainable_forward"]


def kernel_variants():
    """The module naming the kernels' default variants (`cuda.library`)."""
    from rnnfuse.backends.cuda import library

    return library


def _op():
    """The loaded wavefront op module (NotImplementedError naming why not)."""
    from rnnfuse.backends.tensorflow import op_build

    why = op_unavailable()
    if why is not None:
        raise NotImplementedError(why)
    return op_build.load_wavefront_op()


def lengths_input(lengths: Any) -> tf.Tensor:
    """The ops' sequence_lengths: int32 [B], or [0] for every sequence T long."""
    return tf.zeros([0], tf.int32) if lengths is None else tf.cast(lengths, tf.int32)


def input_projection(x: tf.Tensor, params: tf.Tensor, gh: int) -> tf.Tensor:
    """Layer 0's x W_ih^T [T, B, gh] (no bias) as one matmul in x's dtype."""
    steps, batch, input_size = (int(d) for d in x.shape)
    w_ih0 = tf.reshape(params[: gh * input_size], [gh, input_size])
    return tf.reshape(tf.matmul(tf.reshape(x, [-1, input_size]), w_ih0, transpose_b=True),
                      [steps, batch, gh])


def _accumulation(dtype: tf.DType) -> tf.DType:
    return tf.float64 if dtype == tf.float64 else tf.float32


def _dims(x: tf.Tensor, h0: tf.Tensor) -> tuple[int, int, int, int, int]:
    """(steps, batch, input_size, num_layers, units), all static."""
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    dims = (steps, batch, input_size, num_layers, units)
    if any(d is None for d in dims):
        raise ValueError(f"the wavefront training path needs static shapes; received x "
                         f"{x.shape} and h0 {h0.shape}")
    return tuple(int(d) for d in dims)


def _layer_views(params: tf.Tensor, num_layers: int, units: int, input_size: int,
                 gates: int = 4) -> list:
    """Per layer (w_ih [G*H, n], w_hh [G*H, H]) slices of the canonical buffer
    (G = `gates`: 4 for an LSTM, 3 for a GRU)."""
    gh, off, views = gates * units, 0, []
    for l in range(num_layers):
        n = input_size if l == 0 else units
        w_ih = tf.reshape(params[off: off + gh * n], [gh, n])
        w_hh = tf.reshape(params[off + gh * n: off + gh * (n + units)], [gh, units])
        views.append((w_ih, w_hh))
        off += gh * (n + units)
    return views


def _biases(params: tf.Tensor, num_layers: int, units: int, input_size: int,
            gates: int = 4) -> list:
    """Per layer (b_ih, b_hh) [G*H] slices of the canonical buffer."""
    gh = gates * units
    start = sum(gh * ((input_size if l == 0 else units) + units) for l in range(num_layers))
    return [(params[start + 2 * gh * l: start + 2 * gh * l + gh],
             params[start + 2 * gh * l + gh: start + 2 * gh * (l + 1)])
            for l in range(num_layers)]


def forward_saving(x: tf.Tensor, params: tf.Tensor, h0: tf.Tensor, c0: tf.Tensor | None,
                   lengths: Any, *, kind: str = "lstm"):
    """A stack's forward on the kernel, saving what `backward_stack` reads:
    (y [T, B, H], hy, cy [L, B, H], saved) as torch's `forward_training`
    (a GRU's cy is [0]).

    Raises:
        NotImplementedError: the op is not loaded.
        tf.errors.UnimplementedError: the kernel cannot run this stack."""
    _, _, input_size, _, units = _dims(x, h0)
    xproj = input_projection(x, params, (3 if kind == "gru" else 4) * units)
    y, hy, cy, hseq, gates, cseq = _op().rnnfuse_wavefront_saving(
        xproj=xproj, params=params, input_h=h0,
        input_c=tf.zeros([0], x.dtype) if kind == "gru" else c0,
        sequence_lengths=lengths_input(lengths), input_size=input_size,
        kernel_variant=kernel_variants().FORWARD_VARIANT, rnn_mode=kind)
    return y, hy, cy, (hseq, gates, cseq)


def backward_layer(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, kind: str = "lstm"):
    """The backward recurrence of one LSTM or GRU layer on the kernel;
    arguments and results as torch's `backward_layer`.
    `recurrence_reference` is the same in TensorFlow."""
    if kind == "gru":
        empty = tf.zeros([0], dy.dtype)
        dgates, dh0, _ = _op().rnnfuse_wavefront_backward(
            w_hh=w_hh, gates=gates, cseq=cseq, c0=empty, dy=dy, dhy=dhy, dcy=empty,
            sequence_lengths=lengths_input(lengths), rnn_mode="gru")
        return dgates, dh0, None
    dgates, dh0, dc0 = _op().rnnfuse_wavefront_backward(
        w_hh=w_hh, gates=gates, cseq=cseq, c0=c0, dy=dy, dhy=dhy, dcy=dcy,
        sequence_lengths=lengths_input(lengths))
    return dgates, dh0, dc0


def backward_stack_kernel(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths, *,
                          check: bool = False, variant: int | None = None):
    """Every layer's backward recurrence of an LSTM stack in ONE launch of
    `RnnfuseWavefrontBackwardStack`, as torch's `backward_stack_kernel`.
    `check`: the op waits and fails if a wait timed out (a bug).

    Raises:
        NotImplementedError: the op is not loaded.
        tf.errors.UnimplementedError: the stack backward's plan refuses it."""
    dgates, dh0, dc0 = _op().rnnfuse_wavefront_backward_stack(
        params=params, gates=gates, cseq=cseq, c0=c0, dy=dy, dhy=dhy, dcy=dcy,
        sequence_lengths=lengths_input(lengths), input_size=int(input_size), check=check,
        kernel_variant=kernel_variants().STACK_BACKWARD_VARIANT if variant is None else int(variant))
    return dgates, dh0, dc0


def _upstream(dtype, y, h0, c0, dy, dhy, dcy):
    """The backward's incoming gradients: zeros where None, else in `dtype`."""
    dy = tf.zeros_like(y) if dy is None else tf.cast(dy, dtype)
    dhy = tf.zeros_like(h0) if dhy is None else tf.cast(dhy, dtype)
    dcy = tf.zeros_like(c0) if dcy is None else tf.cast(dcy, dtype)
    return dy, dhy, dcy


def _weight_gradients(dgates, l, x, h0, y, hseq):
    """Layer l's (dW_ih and dW_hh flattened, db twice) and dg [T*B, 4H] from
    its dgates: dW_ih = dg^T x^l, dW_hh = dg^T [h0, h_0..h_{T-2}], db the
    sum of dg in the accumulation dtype."""
    steps, batch, _, num_layers, units = _dims(x, h0)
    dtype = x.dtype
    inp = x if l == 0 else hseq[l - 1]
    out = y if l == num_layers - 1 else hseq[l]
    dg = tf.reshape(tf.cast(dgates, dtype), [steps * batch, 4 * units])
    h_prev = tf.reshape(tf.concat([h0[l:l + 1], out[:-1]], 0), [steps * batch, units])
    d_w_ih = tf.matmul(dg, tf.reshape(inp, [steps * batch, int(inp.shape[-1])]),
                       transpose_a=True)
    d_w_hh = tf.matmul(dg, h_prev, transpose_a=True)
    d_b = tf.cast(tf.reduce_sum(tf.cast(dg, _accumulation(dtype)), axis=0), dtype)
    return (tf.concat([tf.reshape(d_w_ih, [-1]), tf.reshape(d_w_hh, [-1])], 0),
            tf.concat([d_b, d_b], 0), dg)


def backward_stack(params, x, h0, c0, lengths, y, saved, dy, dhy, dcy, *,
                   recurrence: Callable | None = None, kind: str = "lstm"):
    """The gradients of a stack's forward, layer by layer from the top: the
    recurrence (`recurrence`, default `backward_layer`), the rest as GEMMs
    (dx^l = dgates^l W_ih^l). Returns (dx, dparams, dh0, dc0) in x's dtype;
    dy, dhy, dcy may be None. A GRU: `_gru_backward_stack`."""
    recurrence = recurrence or backward_layer
    if kind == "gru":
        return _gru_backward_stack(params, x, h0, lengths, y, saved, dy, dhy,
                                   recurrence=recurrence)
    hseq, gates, cseq = saved
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    dtype = x.dtype
    views = _layer_views(params, num_layers, units, input_size)
    dy, dhy, dcy = _upstream(dtype, y, h0, c0, dy, dhy, dcy)
    mats, biases = [None] * num_layers, [None] * num_layers
    dh0, dc0 = [None] * num_layers, [None] * num_layers
    grad = dy  # of layer l's output sequence
    for l in reversed(range(num_layers)):
        w_ih, w_hh = views[l]
        dgates, dh0_l, dc0_l = recurrence(w_hh, gates[l], cseq[l], c0[l], grad, dhy[l], dcy[l],
                                          lengths)
        dh0[l], dc0[l] = tf.cast(dh0_l, dtype), tf.cast(dc0_l, dtype)
        mats[l], biases[l], dg = _weight_gradients(dgates, l, x, h0, y, hseq)
        grad = tf.reshape(tf.matmul(dg, w_ih), [steps, batch, int(w_ih.shape[1])])
    return grad, tf.concat(mats + biases, 0), tf.stack(dh0), tf.stack(dc0)


def _gru_backward_stack(params, x, h0, lengths, y, saved, dy, dhy, *, recurrence: Callable):
    """`backward_stack` of a GRU stack: dgates = (dr, dz, dn_x, dn_h), the
    input side's (dr, dz, dn_x), the recurrent side's (dr, dz, dn_h)."""
    hseq, gates, hprev = saved
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    dtype, acc = x.dtype, _accumulation(x.dtype)
    views = _layer_views(params, num_layers, units, input_size, gates=3)
    dy = tf.zeros_like(y) if dy is None else tf.cast(dy, dtype)
    dhy = tf.zeros_like(h0) if dhy is None else tf.cast(dhy, dtype)
    mats, biases, dh0 = [None] * num_layers, [None] * num_layers, [None] * num_layers
    grad = dy  # of layer l's output sequence
    for l in reversed(range(num_layers)):
        w_ih, w_hh = views[l]
        dgates, dh0_l, _ = recurrence(w_hh, gates[l], hprev[l], None, grad, dhy[l], None,
                                      lengths, kind="gru")
        dh0[l] = tf.cast(dh0_l, dtype)
        inp = x if l == 0 else hseq[l - 1]
        out = y if l == num_layers - 1 else hseq[l]
        dg = tf.reshape(tf.cast(dgates, dtype), [steps * batch, 4 * units])
        d_in = dg[:, :3 * units]
        d_rec = tf.concat([dg[:, :2 * units], dg[:, 3 * units:]], 1)
        h_prev = tf.reshape(tf.concat([h0[l:l + 1], out[:-1]], 0), [steps * batch, units])
        d_w_ih = tf.matmul(d_in, tf.reshape(inp, [steps * batch, int(inp.shape[-1])]),
                           transpose_a=True)
        d_w_hh = tf.matmul(d_rec, h_prev, transpose_a=True)
        mats[l] = tf.concat([tf.reshape(d_w_ih, [-1]), tf.reshape(d_w_hh, [-1])], 0)
        biases[l] = tf.concat([tf.cast(tf.reduce_sum(tf.cast(d, acc), axis=0), dtype)
                               for d in (d_in, d_rec)], 0)
        grad = tf.reshape(tf.matmul(d_in, w_ih), [steps, batch, int(w_ih.shape[1])])
    return grad, tf.concat(mats + biases, 0), tf.stack(dh0), None


def backward_stack_wavefront(params, x, h0, c0, lengths, y, saved, dy, dhy, dcy, *,
                             recurrence: Callable | None = None):
    """`backward_stack` with every layer's recurrence in ONE launch
    (`recurrence`, default `backward_stack_kernel`), then the GEMMs."""
    recurrence = recurrence or backward_stack_kernel
    hseq, gates, cseq = saved
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    dtype = x.dtype
    dy, dhy, dcy = _upstream(dtype, y, h0, c0, dy, dhy, dcy)
    dgates, dh0, dc0 = recurrence(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths)
    mats, biases, dgs = zip(*(_weight_gradients(dgates[l], l, x, h0, y, hseq)
                              for l in range(num_layers)))
    w_ih0 = _layer_views(params, num_layers, units, input_size)[0][0]
    dx = tf.reshape(tf.matmul(dgs[0], w_ih0), [steps, batch, input_size])
    return (dx, tf.concat(list(mats) + list(biases), 0), tf.cast(dh0, dtype),
            tf.cast(dc0, dtype))


def backward_choice(x, h0, backward: str = "auto", *, kind: str = "lstm"):
    """The backward `trainable_forward` runs (`library.choose_backward` on
    GPU 0; "layer" without the op, and for a GRU).

    Raises:
        ValueError: an unknown `backward`, or a shape that is not static."""
    from rnnfuse.backends.cuda import library

    library.check_backward(backward, "trainable_forward: backward")
    steps, batch, _, num_layers, units = _dims(x, h0)
    unavailable = None
    if backward == "auto":
        unavailable = op_unavailable()
    return library.choose_backward(backward, kind, num_layers, units, batch, steps,
                                   unavailable=unavailable)


def op_unavailable() -> str | None:
    """Why the wavefront ops cannot run here (not loaded: no GPU, no build), or None."""
    from rnnfuse.backends.tensorflow import op_build

    if op_build.load_wavefront_op() is None:
        return f"rnnfuse's wavefront op is not loaded: {op_build.wavefront_load_failure()}"
    return None


def trainable_forward(x, params, h0, c0, lengths=None, *, saving: Callable | None = None,
                      recurrence: Callable | None = None, backward: str = "auto",
                      kind: str = "lstm"):
    """An LSTM or GRU stack on the kernel with the kernel's gradient.

    Returns (y, hy, cy) as `forward_saving`, differentiable with respect to
    x, params, h0 and c0. `backward`: "auto" (the one-launch backward where
    `library.backward_stack_reason` accepts the stack, else "layer"),
    "layer" or "stack" (LSTM only). `saving` and `recurrence` replace the
    forward kernel and the backward's recurrence (the CPU tests' references).

    Raises:
        ValueError: an LSTM's c0 is None, a shape is not static, an unknown
            `backward`, or a GRU's "stack"."""
    if kind not in ("lstm", "gru"):
        raise ValueError(f"trainable_forward: kind must be 'lstm' or 'gru'; received {kind!r}")
    if kind == "gru":
        return _trainable_gru(x, params, h0, lengths, saving=saving, recurrence=recurrence,
                              backward=backward)
    if c0 is None:
        raise ValueError("trainable_forward: an LSTM needs c0 ([L, B, H]); received None")
    x, params, h0, c0 = (tf.convert_to_tensor(t) for t in (x, params, h0, c0))
    choice = backward_choice(x, h0, backward)
    stack_backward = backward_stack_wavefront if choice.backward == "stack" else backward_stack
    saving = saving or forward_saving
    lens = None if lengths is None else tf.cast(lengths, tf.int32)

    @tf.custom_gradient
    def lstm(x, params, h0, c0):
        y, hy, cy, saved = saving(x, params, h0, c0, lens)

        def grad(dy, dhy, dcy):
            return stack_backward(params, x, h0, c0, lens, y, saved, dy, dhy, dcy,
                                  recurrence=recurrence)

        return (y, hy, cy), grad

    y, hy, cy = lstm(x, params, h0, c0)
    return y, hy, cy


def _trainable_gru(x, params, h0, lengths, *, saving, recurrence, backward):
    """`trainable_forward` of a GRU stack: (y, hy, None)."""
    x, params, h0 = (tf.convert_to_tensor(t) for t in (x, params, h0))
    choice = backward_choice(x, h0, backward, kind="gru")
    if choice.backward == "stack":
        raise ValueError("trainable_forward: backward='stack' (the reverse-wavefront backward) "
                         "runs LSTM stacks only; a GRU runs backward='layer' or 'auto'")
    saving = saving or forward_saving
    lens = None if lengths is None else tf.cast(lengths, tf.int32)

    @tf.custom_gradient
    def gru(x, params, h0):
        y, hy, _, saved = saving(x, params, h0, None, lens, kind="gru")

        def grad(dy, dhy):
            dx, dparams, dh0, _ = backward_stack(params, x, h0, None, lens, y, saved, dy, dhy,
                                                 None, recurrence=recurrence, kind="gru")
            return dx, dparams, dh0

        return (y, hy), grad

    y, hy = gru(x, params, h0)
    return y, hy, None


# -- the two kernels, and the stack, in plain TensorFlow ------------------------------------


def _alive(steps: int, batch: int, lengths: Any):
    """(lengths int32 [B], alive bool [T, B]: t < length)."""
    lens = (tf.fill([batch], steps) if lengths is None else tf.cast(lengths, tf.int32))
    return lens, tf.range(steps)[:, None] < lens[None, :]


def reference_forward_saving(x, params, h0, c0, lengths, *, kind: str = "lstm"):
    """`forward_saving` step by step (float32 arithmetic, float64 for
    float64): h rounded to x's dtype between steps, 0 at t >= length."""
    if kind == "gru":
        return _gru_reference_forward_saving(x, params, h0, lengths)
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    acc, dtype = _accumulation(x.dtype), x.dtype
    lens, alive = _alive(steps, batch, lengths)
    views = _layer_views(params, num_layers, units, input_size)
    biases = _biases(params, num_layers, units, input_size)
    gates_all, cseq_all, seqs, hy, cy = [], [], [], [], []
    inp = x
    for l, (w_ih, w_hh) in enumerate(views):
        b = tf.cast(biases[l][0], acc) + tf.cast(biases[l][1], acc)
        n = int(inp.shape[-1])
        xp = tf.reshape(tf.matmul(tf.reshape(tf.cast(inp, acc), [-1, n]), tf.cast(w_ih, acc),
                                  transpose_b=True), [steps, batch, 4 * units]) + b
        h, c = h0[l], tf.cast(c0[l], acc)
        hy_l, cy_l = tf.zeros_like(h0[l]), tf.zeros_like(c0[l])
        outs, gates, cseq = [], [], []
        for t in range(steps):
            pre = xp[t] + tf.matmul(tf.cast(h, acc), tf.cast(w_hh, acc), transpose_b=True)
            a_i, a_f, a_g, a_o = tf.split(pre, 4, axis=1)
            i, f, g, o = tf.sigmoid(a_i), tf.sigmoid(a_f), tf.tanh(a_g), tf.sigmoid(a_o)
            c = f * c + i * g
            h_new = tf.cast(o * tf.tanh(c), dtype)
            gates.append(tf.concat([i, f, g, o], axis=1))
            cseq.append(c)
            h = tf.where(alive[t][:, None], h_new, tf.zeros_like(h_new))
            outs.append(h)
            last = (t == lens - 1)[:, None]
            hy_l = tf.where(last, h_new, hy_l)
            cy_l = tf.where(last, tf.cast(c, dtype), cy_l)
        inp = tf.stack(outs)
        seqs.append(inp)
        gates_all.append(tf.stack(gates))
        cseq_all.append(tf.stack(cseq))
        hy.append(hy_l)
        cy.append(cy_l)
    hseq = (tf.stack(seqs[:-1]) if num_layers > 1
            else tf.zeros([0, steps, batch, units], dtype))
    return (seqs[-1], tf.stack(hy), tf.stack(cy),
            (hseq, tf.cast(tf.stack(gates_all), acc), tf.cast(tf.stack(cseq_all), acc)))


def _gru_reference_forward_saving(x, params, h0, lengths):
    """`reference_forward_saving` of a GRU stack: (y, hy, [0], (hseq, gates, hprev))."""
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    acc, dtype = _accumulation(x.dtype), x.dtype
    lens, alive = _alive(steps, batch, lengths)
    views = _layer_views(params, num_layers, units, input_size, gates=3)
    biases = _biases(params, num_layers, units, input_size, gates=3)
    gates_all, hprev_all, seqs, hy = [], [], [], []
    inp = x
    for l, (w_ih, w_hh) in enumerate(views):
        b_ih, b_hh = tf.cast(biases[l][0], acc), tf.cast(biases[l][1], acc)
        n_in = int(inp.shape[-1])
        xp = tf.reshape(tf.matmul(tf.reshape(tf.cast(inp, acc), [-1, n_in]), tf.cast(w_ih, acc),
                                  transpose_b=True), [steps, batch, 3 * units]) + b_ih
        h = h0[l]
        hy_l = tf.zeros_like(h0[l])
        outs, gates, hprev = [], [], []
        for t in range(steps):
            hh = tf.matmul(tf.cast(h, acc), tf.cast(w_hh, acc), transpose_b=True) + b_hh
            xr, xz, xn = tf.split(xp[t], 3, axis=1)
            hr, hz, hn = tf.split(hh, 3, axis=1)
            r, z = tf.sigmoid(xr + hr), tf.sigmoid(xz + hz)
            n = tf.tanh(xn + r * hn)
            h_new = tf.cast((1 - z) * n + z * tf.cast(h, acc), dtype)
            gates.append(tf.concat([r, z, n, hn], axis=1))
            hprev.append(tf.cast(h, acc))
            h = tf.where(alive[t][:, None], h_new, tf.zeros_like(h_new))
            outs.append(h)
            hy_l = tf.where((t == lens - 1)[:, None], h_new, hy_l)
        inp = tf.stack(outs)
        seqs.append(inp)
        gates_all.append(tf.stack(gates))
        hprev_all.append(tf.stack(hprev))
        hy.append(hy_l)
    hseq = (tf.stack(seqs[:-1]) if num_layers > 1
            else tf.zeros([0, steps, batch, units], dtype))
    return (seqs[-1], tf.stack(hy), tf.zeros([0], dtype),
            (hseq, tf.stack(gates_all), tf.stack(hprev_all)))


def recurrence_reference(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, dtype=None,
                         kind: str = "lstm"):
    """`backward_layer` step by step (dgates rounded to the element type as
    the kernel stores them); `dtype`: the element type where dy is not in it."""
    if kind == "gru":
        return _gru_recurrence_reference(w_hh, gates, cseq, dy, dhy, lengths, dtype=dtype)
    steps, dtype, acc, lens, alive, zeros = _reference_start(dy, lengths, dtype)
    w = tf.cast(w_hh, acc)
    carry, rec = zeros, zeros
    dgates = [None] * steps
    for t in reversed(range(steps)):
        live = alive[t][:, None]
        last = (t == lens - 1)[:, None]
        dh = rec + tf.cast(dy[t], acc) + tf.where(last, tf.cast(dhy, acc), zeros)
        dc = tf.where(last, tf.cast(dcy, acc), carry)
        i, f, g, o = tf.split(tf.cast(gates[t], acc), 4, axis=1)
        c_prev = tf.cast(cseq[t - 1] if t > 0 else c0, acc)
        tc = tf.tanh(tf.cast(cseq[t], acc))
        dc = dc + dh * o * (1 - tc * tc)
        da = tf.concat([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                        dh * tc * o * (1 - o)], axis=1)
        da = tf.cast(tf.where(live, da, tf.zeros_like(da)), dtype)
        carry = tf.where(live, dc * f, zeros)
        dgates[t] = da
        rec = tf.matmul(tf.cast(da, acc), w)
    return tf.stack(dgates), rec, carry


def _reference_start(dy, lengths, dtype):
    """A reference backward's start over dy [T, B, H]: (T, element dtype,
    accumulation dtype, lengths, alive [T, B], zeros [B, H] accumulated)."""
    steps, batch, units = (int(d) for d in dy.shape)
    dtype = dy.dtype if dtype is None else tf.as_dtype(dtype)
    acc = _accumulation(dtype)
    lens, alive = _alive(steps, batch, lengths)
    return steps, dtype, acc, lens, alive, tf.zeros([batch, units], acc)


def _gru_recurrence_reference(w_hh, gates, hprev, dy, dhy, lengths, *, dtype=None):
    """`recurrence_reference` of a GRU layer: (dgates = (dr, dz, dn_x, dn_h),
    dh0 in the accumulation dtype, None)."""
    steps, dtype, acc, lens, alive, zeros = _reference_start(dy, lengths, dtype)
    w_r, w_z, w_n = tf.split(tf.cast(w_hh, acc), 3, axis=0)
    w = tf.concat([w_r, w_z, tf.zeros_like(w_n), w_n], 0)  # rows of (dr, dz, dn_x, dn_h)
    carry, rec = zeros, zeros
    dgates = [None] * steps
    for t in reversed(range(steps)):
        live = alive[t][:, None]
        last = (t == lens - 1)[:, None]
        dh = rec + tf.cast(dy[t], acc) + carry + tf.where(last, tf.cast(dhy, acc), zeros)
        r, z, n, hn = tf.split(tf.cast(gates[t], acc), 4, axis=1)
        dnx = dh * (1 - z) * (1 - n * n)
        da = tf.concat([dnx * hn * r * (1 - r), dh * (tf.cast(hprev[t], acc) - n) * z * (1 - z),
                        dnx, dnx * r], axis=1)
        da = tf.cast(tf.where(live, da, tf.zeros_like(da)), dtype)
        carry = tf.where(live, dh * z, zeros)
        dgates[t] = da
        rec = tf.matmul(tf.cast(da, acc), w)
    return tf.stack(dgates), rec + carry, None


def stack_recurrence_reference(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths):
    """`backward_stack_kernel` in TensorFlow: per layer from the top,
    `recurrence_reference` with dy^l kept in the accumulation dtype."""
    num_layers, steps, batch, units = (int(d) for d in cseq.shape)
    acc = _accumulation(dy.dtype)
    views = _layer_views(params, num_layers, units, int(input_size))
    dgates, dh0, dc0 = [None] * num_layers, [None] * num_layers, [None] * num_layers
    grad = dy
    for l in reversed(range(num_layers)):
        dgates[l], dh0[l], dc0[l] = recurrence_reference(
            views[l][1], gates[l], cseq[l], c0[l], grad, dhy[l], dcy[l], lengths, dtype=dy.dtype)
        if l > 0:
            grad = tf.reshape(tf.matmul(tf.reshape(tf.cast(dgates[l], acc), [-1, 4 * units]),
                                        tf.cast(views[l][0], acc)), [steps, batch, units])
    return tf.stack(dgates), tf.stack(dh0), tf.stack(dc0)


def reference_forward(x, params, h0, c0, lengths=None, *, kind: str = "lstm"):
    """The stack in float64 with cuDNN's rules for lengths, in plain ops (a
    `tf.scan` a layer) so a tape gives reference gradients; returns (y, hy,
    cy) (a GRU's cy None)."""
    if kind == "gru":
        return _gru_reference_forward(x, params, h0, lengths)
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    f64 = tf.float64
    _, alive = _alive(steps, batch, lengths)
    params = tf.cast(params, f64)
    views = _layer_views(params, num_layers, units, input_size)
    biases = _biases(params, num_layers, units, input_size)
    inp = tf.cast(x, f64)
    hy, cy = [], []
    for l, (w_ih, w_hh) in enumerate(views):
        n = int(inp.shape[-1])
        xp = tf.reshape(tf.matmul(tf.reshape(inp, [-1, n]), w_ih, transpose_b=True),
                        [steps, batch, 4 * units]) + biases[l][0]

        def step(state, elems, w_hh=w_hh, b_hh=biases[l][1]):
            h, c, _ = state
            xp_t, live = elems
            pre = xp_t + tf.matmul(h, w_hh, transpose_b=True) + b_hh
            a_i, a_f, a_g, a_o = tf.split(pre, 4, axis=1)
            c_new = tf.sigmoid(a_f) * c + tf.sigmoid(a_i) * tf.tanh(a_g)
            h_new = tf.sigmoid(a_o) * tf.tanh(c_new)
            live = live[:, None]
            return (tf.where(live, h_new, h), tf.where(live, c_new, c),
                    tf.where(live, h_new, tf.zeros_like(h_new)))

        h0_l, c0_l = tf.cast(h0[l], f64), tf.cast(c0[l], f64)
        hs, cs, inp = tf.scan(step, (xp, alive), initializer=(h0_l, c0_l, tf.zeros_like(h0_l)))
        hy.append(hs[-1])
        cy.append(cs[-1])
    return inp, tf.stack(hy), tf.stack(cy)


def _gru_reference_forward(x, params, h0, lengths):
    """`reference_forward` of a GRU stack (reset_after): (y, hy, None)."""
    steps, batch, input_size, num_layers, units = _dims(x, h0)
    f64 = tf.float64
    _, alive = _alive(steps, batch, lengths)
    params = tf.cast(params, f64)
    views = _layer_views(params, num_layers, units, input_size, gates=3)
    biases = _biases(params, num_layers, units, input_size, gates=3)
    inp = tf.cast(x, f64)
    hy = []
    for l, (w_ih, w_hh) in enumerate(views):
        n = int(inp.shape[-1])
        xp = tf.reshape(tf.matmul(tf.reshape(inp, [-1, n]), w_ih, transpose_b=True),
                        [steps, batch, 3 * units]) + biases[l][0]

        def step(state, elems, w_hh=w_hh, b_hh=biases[l][1]):
            h, _ = state
            xp_t, live = elems
            xr, xz, xn = tf.split(xp_t, 3, axis=1)
            hr, hz, hn = tf.split(tf.matmul(h, w_hh, transpose_b=True) + b_hh, 3, axis=1)
            r, z = tf.sigmoid(xr + hr), tf.sigmoid(xz + hz)
            h_new = (1 - z) * tf.tanh(xn + r * hn) + z * h
            live = live[:, None]
            return tf.where(live, h_new, h), tf.where(live, h_new, tf.zeros_like(h_new))

        h0_l = tf.cast(h0[l], f64)
        hs, inp = tf.scan(step, (xp, alive), initializer=(h0_l, tf.zeros_like(h0_l)))
        hy.append(hs[-1])
    return inp, tf.stack(hy), None
