"""Keras' generic loop over the LSTMP step (an LSTM whose output, the next
hidden state, is projected: h = (o * tanh(c)) @ P), written independently of
rnnfuse's layers: the float64 reference that the ProjectedLSTM tests of
every backend compare with. `ops` picks the arrays: NumPy (the default) or
TensorFlow's (`tensorflow_ops()`, for gradients through a tape).

    >>> import numpy as np
    >>> w = (np.zeros((3, 8)), np.zeros((1, 8)), np.zeros(8), np.ones((2, 1)))
    >>> y, h, c = lstmp(np.ones((1, 4, 3)), w, np.zeros((1, 1)), np.zeros((1, 2)))
    >>> y.shape, h.shape, c.shape
    ((1, 4, 1), (1, 1), (1, 2))
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

NUMPY = SimpleNamespace(sigmoid=lambda v: 1.0 / (1.0 + np.exp(-v)), tanh=np.tanh,
                        split=np.split, where=np.where, stack=np.stack, zeros_like=np.zeros_like)


def tensorflow_ops() -> SimpleNamespace:
    import tensorflow as tf

    return SimpleNamespace(sigmoid=tf.sigmoid, tanh=tf.tanh, split=tf.split, where=tf.where,
                           stack=tf.stack, zeros_like=tf.zeros_like)


def lstmp(x, weights, h0, c0, mask=None, go_backwards=False, zero_output_for_mask=False,
          ops=NUMPY):
    """(outputs [B, T, P] in processing order, h, c) of one LSTMP layer:
    `weights` = (kernel, recurrent kernel, bias, projection), Keras' gate
    order (i, f, c, o). A masked step keeps the states and outputs the
    previous output (zeros where `zero_output_for_mask`)."""
    kernel, recurrent, bias, projection = weights
    h, c = h0, c0
    prev = ops.zeros_like(h0)
    outputs = []
    for t in (range(x.shape[1])[::-1] if go_backwards else range(x.shape[1])):
        z = x[:, t] @ kernel + h @ recurrent + bias
        zi, zf, zg, zo = ops.split(z, 4, axis=-1)
        c_new = ops.sigmoid(zf) * c + ops.sigmoid(zi) * ops.tanh(zg)
        h_new = (ops.sigmoid(zo) * ops.tanh(c_new)) @ projection
        if mask is None:
            h, c, prev = h_new, c_new, h_new
        else:
            keep = mask[:, t][:, None]
            out = ops.where(keep, h_new, ops.zeros_like(h_new) if zero_output_for_mask else prev)
            h, c, prev = ops.where(keep, h_new, h), ops.where(keep, c_new, c), out
        outputs.append(prev)
    return ops.stack(outputs, axis=1), h, c
