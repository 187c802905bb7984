"""rnnfuse's wavefront kernel as the TensorFlow op `RnnfuseWavefront`, on a
real Hopper GPU (the H200), after the TensorFlow staging of ../shared/gpu:

    python3 -m pytest -q tests/gpu/test_gpu_wavefront.py

The op (built on first use like the cuDNN op) runs fused LSTM/GRU stacks
from the live Keras variables; its outputs and final states are compared
with rnnfuse's cuDNN op on the same canonical buffer (the standard
algorithm) and with a float64 NumPy reference, as ||out - ref|| / ||ref||.
A shape over the kernel's limits raises NotImplementedError (the fused
layer's cue to run cuDNN), and a gradient through the op is a clear error.
The kernel's exactness over randomized shapes is tested through torch
(test_gpu_wavefront_torch.py), which needs no TensorFlow.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.base import StackSpec
from rnnfuse.backends.tensorflow import op_build, wavefront_op

pytestmark = [pytest.mark.cudnn_op, pytest.mark.real_gpu_only]
TOL = {"float16": 1e-3, "bfloat16": 8e-3}


@pytest.fixture(autouse=True)
def _op_loaded():
    op_build.reset_for_tests()
    if op_build.load_wavefront_op() is None:
        pytest.fail(f"the wavefront op did not load: {op_build.wavefront_load_failure()}")
    yield


def _stack(kind, layers, units, inputs):
    cls = keras.layers.LSTMCell if kind == "lstm" else keras.layers.GRUCell
    cells = []
    for i in range(layers):
        cell = cls(units)
        cell.build((None, inputs if i == 0 else units))
        cells.append((cell,))
    return StackSpec(kind, units, tuple(cells))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _reference(stack, x, mask):
    """float64 NumPy forward of the stack (Keras gate order), cuDNN's padding rules."""
    x = x.astype(np.float64)
    batch, steps, _ = x.shape
    lengths = mask.sum(1) if mask is not None else np.full(batch, steps)
    inp, hs = x, []
    for (cell,) in stack.cells:
        k, r, b = (np.asarray(v, np.float64) for v in (cell.kernel, cell.recurrent_kernel, cell.bias))
        h = np.zeros((batch, stack.units))
        c = np.zeros_like(h)
        out = np.zeros((batch, steps, stack.units))
        for t in range(steps):
            if stack.kind == "lstm":
                z = inp[:, t] @ k + h @ r + b
                i, f, g, o = np.split(z, 4, axis=1)
                c_new = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
                h_new = _sigmoid(o) * np.tanh(c_new)
            else:  # reset_after: bias rows are (input, recurrent), gates z, r, h
                xz, xr, xh = np.split(inp[:, t] @ k + b[0], 3, axis=1)
                hz, hr, hh = np.split(h @ r + b[1], 3, axis=1)
                zg, rg = _sigmoid(xz + hz), _sigmoid(xr + hr)
                h_new = zg * h + (1 - zg) * np.tanh(xh + rg * hh)
                c_new = c
            alive = (t < lengths)[:, None]
            h, c = np.where(alive, h_new, h), np.where(alive, c_new, c)
            out[:, t] = np.where(alive, h_new, 0)
        inp = out
        hs.append(h)
    return inp, np.stack(hs)


def _rel(a, b):
    a, b = np.asarray(tf.cast(a, tf.float64)), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize(
    "kind, layers, units, batch, steps, dtype, masked",
    [
        ("lstm", 4, 512, 64, 50, "float16", False),
        ("lstm", 3, 256, 20, 40, "bfloat16", True),
        ("gru", 4, 512, 32, 30, "float16", True),
        ("gru", 2, 128, 3, 17, "bfloat16", False),
    ],
)
def test_the_op_matches_float64_and_the_cudnn_op(kind, layers, units, batch, steps, dtype, masked):
    rng = np.random.default_rng(layers * 1000 + units + batch)
    stack = _stack(kind, layers, units, units)
    for (cell,) in stack.cells:  # random biases too (Keras initialises them to 0 / 1)
        cell.bias.assign(rng.uniform(-0.3, 0.3, cell.bias.shape).astype("float32"))
    x = rng.standard_normal((batch, steps, units)).astype("float32")
    mask = None
    if masked:
        lengths = rng.integers(1, steps + 1, batch)
        mask = np.arange(steps)[None, :] < lengths[:, None]
    xt = tf.cast(tf.constant(x), dtype)
    with tf.device("GPU:0"):
        y, h, c = wavefront_op.run_stack(xt, stack=stack, mask=mask)
        y_cudnn, h_cudnn, _ = tf_backend.run_stack(xt, stack=stack, mask=mask)
    assert tf_backend.last_kernel()["kernel"] != wavefront_op.KERNEL_NAME
    # The reference sees the weights and inputs the kernel saw (rounded).
    for (cell,) in stack.cells:
        for v in (cell.kernel, cell.recurrent_kernel, cell.bias):
            v.assign(tf.cast(tf.cast(v, dtype), tf.float32))
    ref_y, ref_h = _reference(stack, np.asarray(tf.cast(xt, tf.float32)), mask)
    tol = max(TOL[dtype], 2 * _rel(y_cudnn, ref_y))
    assert _rel(y, ref_y) <= tol and _rel(h, ref_h) <= max(TOL[dtype], 2 * _rel(h_cudnn, ref_h))
    assert (c is None) == (kind == "gru")


def test_a_stack_over_the_limits_raises_not_implemented():
    stack = _stack("lstm", 8, 512, 512)
    with pytest.raises(NotImplementedError, match="do not fit on chip"):
        wavefront_op.run_stack(tf.zeros([64, 10, 512], tf.float16), stack=stack)


def test_float32_and_training_calls_are_refused():
    stack = _stack("lstm", 2, 64, 64)
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        wavefront_op.run_stack(tf.zeros([4, 5, 64]), stack=stack)
    with pytest.raises(NotImplementedError, match="no dropout"):
        wavefront_op.run_stack(tf.zeros([4, 5, 64], tf.float16), stack=stack, dropout=0.2)


def test_a_gradient_through_the_op_is_a_clear_error():
    stack = _stack("gru", 2, 64, 64)
    x = tf.Variable(tf.zeros([4, 5, 64], tf.float16))
    with tf.GradientTape() as tape:
        y, _, _ = wavefront_op.run_stack(x, stack=stack)
    with pytest.raises(ValueError, match="inference kernel"):
        tape.gradient(tf.reduce_sum(y), x)
