"""A reference of cuDNN's multi-layer RNN that reads a flat params buffer.

Written once against a NumPy-like namespace `xp`: with `numpy` it is the
plain reference the packing tests use; with `tf.experimental.numpy` it is
differentiable and stands in for `tf.raw_ops.CudnnRNNV3` on the CPU
(`emulated_cudnn_rnn`), so the whole fused path of `FusedRNN` (masks,
states, reversal, output assembly, gradients) runs in CI without a GPU.

Buffer layout read here (cuDNN's canonical layout, see
rnnfuse/backends/tensorflow.py): all weight matrices, pseudo-layer by
pseudo-layer (level-major, forward before backward), each gate's matrix
[H, n] row-major, input matrices before recurrent ones; then all biases in
the same order, input biases before recurrent ones. Gate orders: lstm
(i, f, c, o), gru (r, z, h), rnn (one). An LSTM with a projection (LSTMP,
h P wide, c H wide) has its [P, H] projection matrix after its recurrent
matrices (rnnfuse's canonical layout, csrc/cudnn_rnn_core.h), and its h is
that matrix times o * tanh(c).

cuDNN's equations (per direction, per time step, for t < length):

    lstm: i, f, o = sigmoid(W x + bW + R h + bR); g = tanh(...)
          c' = f * c + i * g; h' = o * tanh(c')
    gru:  r, z = sigmoid(W x + bW + R h + bR)
          n = tanh(W_h x + bW_h + r * (R_h h + bR_h)); h' = (1 - z) n + z h
    rnn:  h' = tanh|relu(W x + bW + R h + bR)

Past a sequence's length the state is held and the output is zero; the
backward direction reads each sequence reversed within its length.
"""

from __future__ import annotations

import numpy as np

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def unpack(xp, params, mode, input_size, units, num_layers, num_dirs, proj_size=0):
    """Per pseudo-layer dicts of gate matrices, biases (and projection "P")."""
    gates, h = GATES[mode], units
    out_width = proj_size or units
    offset = 0
    layers = []

    def take(n, shape):
        nonlocal offset
        piece = xp.reshape(params[offset : offset + n], shape)
        offset += n
        return piece

    for level in range(num_layers):
        n = input_size if level == 0 else out_width * num_dirs
        for _ in range(num_dirs):
            w = [take(h * n, (h, n)) for _ in range(gates)]
            r = [take(h * out_width, (h, out_width)) for _ in range(gates)]
            layer = {"W": w, "R": r}
            if proj_size:
                layer["P"] = take(proj_size * h, (proj_size, h))
            layers.append(layer)
    for p in layers:
        p["bW"] = [take(h, (h,)) for _ in range(gates)]
        p["bR"] = [take(h, (h,)) for _ in range(gates)]
    total = int(params.shape[0])
    if offset != total:
        raise ValueError(f"buffer has {total} values, layout reads {offset}")
    return layers


def _sigmoid(xp, z):
    return 1.0 / (1.0 + xp.exp(-z))


def _step(xp, mode, x, h, c, p):
    def lin(g):
        return (
            xp.matmul(x, xp.transpose(p["W"][g]))
            + p["bW"][g]
            + xp.matmul(h, xp.transpose(p["R"][g]))
            + p["bR"][g]
        )

    if mode == "lstm":
        i, f, g, o = (
            _sigmoid(xp, lin(0)),
            _sigmoid(xp, lin(1)),
            xp.tanh(lin(2)),
            _sigmoid(xp, lin(3)),
        )
        c = f * c + i * g
        h = o * xp.tanh(c)
        if "P" in p:
            h = xp.matmul(h, xp.transpose(p["P"]))
        return h, c
    if mode == "gru":
        r, z = _sigmoid(xp, lin(0)), _sigmoid(xp, lin(1))
        n = xp.tanh(
            xp.matmul(x, xp.transpose(p["W"][2]))
            + p["bW"][2]
            + r * (xp.matmul(h, xp.transpose(p["R"][2])) + p["bR"][2])
        )
        return (1.0 - z) * n + z * h, c
    if mode == "rnn_tanh":
        return xp.tanh(lin(0)), c
    return xp.maximum(lin(0), 0.0), c


def _reverse_sequence(xp, x, lengths):
    steps = x.shape[0]
    lengths = xp.reshape(lengths, (1, -1))
    t = xp.reshape(xp.arange(steps, dtype=lengths.dtype), (-1, 1))
    idx = xp.where(t < lengths, lengths - 1 - t, t)
    idx = xp.broadcast_to(idx[:, :, None], x.shape)
    return xp.take_along_axis(x, idx, axis=0)


def _run_direction(xp, mode, x, h, c, p, lengths, reverse):
    if reverse:
        x = _reverse_sequence(xp, x, lengths)
    outs = []
    for t in range(x.shape[0]):
        valid = xp.reshape(t < lengths, (-1, 1))
        h_new, c_new = _step(xp, mode, x[t], h, c, p)
        outs.append(xp.where(valid, h_new, xp.zeros_like(h_new)))
        h = xp.where(valid, h_new, h)
        if c is not None:
            c = xp.where(valid, c_new, c)
    out = xp.stack(outs)
    if reverse:
        out = _reverse_sequence(xp, out, lengths)
    return out, h, c


def cudnn_rnn(xp, x, h0, c0, params, lengths, mode, bidirectional):
    """Multi-layer cuDNN RNN on time-major `x` [T, B, F].

    Args:
        h0, c0: [L * D, B, R] and [L * D, B, H] (c0 None unless lstm; R = P
            for a projected LSTM, else H).
        lengths: [B] sequence lengths.

    Returns:
        (outputs [T, B, D * H], h_n [L * D, B, H], c_n or None).
    """
    dirs = 2 if bidirectional else 1
    num_layers = h0.shape[0] // dirs
    units = c0.shape[-1] if mode == "lstm" else h0.shape[-1]
    proj = h0.shape[-1] if h0.shape[-1] != units else 0
    layers = unpack(xp, params, mode, x.shape[-1], units, num_layers, dirs, proj)
    inp, hs, cs = x, [], []
    for level in range(num_layers):
        outs = []
        for d in range(dirs):
            k = level * dirs + d
            c_k = c0[k] if mode == "lstm" else None
            out, h, c = _run_direction(
                xp, mode, inp, h0[k], c_k, layers[k], lengths, reverse=d == 1
            )
            outs.append(out)
            hs.append(h)
            cs.append(c)
        inp = xp.concatenate(outs, axis=-1) if dirs == 2 else outs[0]
    c_n = xp.stack(cs) if mode == "lstm" else None
    return inp, xp.stack(hs), c_n


def numpy_cudnn_rnn(x, h0, c0, params, lengths, mode, bidirectional=False):
    """`cudnn_rnn` in float64 NumPy."""
    as64 = lambda a: None if a is None else np.asarray(a, np.float64)
    return cudnn_rnn(
        np,
        as64(x),
        as64(h0),
        as64(c0),
        as64(params),
        np.asarray(lengths),
        mode,
        bidirectional,
    )


def emulated_cudnn_rnn(
    *,
    input,
    input_h,
    input_c,
    params,
    sequence_lengths,
    rnn_mode,
    direction,
    time_major,
    **_ignored,
):
    """Drop-in for `tf.raw_ops.CudnnRNNV3` (time-major only), on any device."""
    import tensorflow as tf
    import tensorflow.experimental.numpy as tnp

    if not time_major:
        raise NotImplementedError("the emulator reads time-major input only")
    c0 = input_c if rnn_mode == "lstm" else None
    out, h, c = cudnn_rnn(
        tnp,
        input,
        input_h,
        c0,
        params,
        tf.cast(sequence_lengths, tf.int32),
        rnn_mode,
        direction == "bidirectional",
    )
    if c is None:
        c = tf.zeros_like(h)
    return out, h, c, tf.zeros([0], input.dtype), tf.zeros([0], tf.int8)
