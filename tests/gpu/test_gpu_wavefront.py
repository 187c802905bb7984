"""rnnfuse's wavefront kernel as the TensorFlow op `RnnfuseWavefront`, on a
real Hopper GPU (the H200), after the TensorFlow staging of ../shared/gpu:

    python3 -m pytest -q -s tests/gpu/test_gpu_wavefront.py

The op (built on first use like the cuDNN op) runs fused LSTM/GRU stacks
from the live Keras variables; its outputs and final states are compared
with rnnfuse's cuDNN op on the same canonical buffer (the standard
algorithm) and with a float64 NumPy reference, as ||out - ref|| / ||ref||.
A shape over the kernel's limits raises NotImplementedError (the fused
layer's cue to run cuDNN), a gradient through the raw op is a clear error,
and through `run_differentiable` it is cuDNN's.

As a tuner candidate: an optimized 4x512 float16 LSTM's `predict` at batch
64, T=1000, tuned on this GPU, chooses the wavefront plan; the predict step
holds and ran the op (its FusedRNN's path names RnnfuseWavefront, with no
fallback note: a silent fallback fails), matches the original model within
float16 rounding, and is faster than the original's predict (the ratio is
a GPU_REPORT line); the same model at batch 8 keeps cuDNN or the original.
The kernel's exactness over randomized shapes is tested through torch
(test_gpu_wavefront_torch.py), which needs no TensorFlow.
"""

from __future__ import annotations

import json
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, stack_model, traced_op_types
from gpu_report import report
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.base import StackSpec
from rnnfuse.backends.tensorflow import op_build, wavefront_op
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache

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
        y, h, c, ran = wavefront_op.run_stack(xt, stack=stack, mask=mask)
        y_cudnn, h_cudnn, _, ran_cudnn = tf_backend.run_stack(xt, stack=stack, mask=mask)
    assert ran.name == wavefront_op.KERNEL_NAME and ran_cudnn.name == "RnnfuseCudnnRnn"
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


def test_a_gradient_through_the_raw_op_is_a_clear_error():
    stack = _stack("gru", 2, 64, 64)
    x = tf.Variable(tf.zeros([4, 5, 64], tf.float16))
    with tf.GradientTape() as tape:
        # The loss inside the tape (outside it the tape sees no path, and
        # gives None whatever the op's gradient is).
        loss = tf.reduce_sum(wavefront_op.run_stack(x, stack=stack).outputs)
    with pytest.raises(ValueError, match="inference kernel"):
        tape.gradient(loss, x)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_backends_wavefront_call_has_cudnns_gradient(kind):
    """kernel="wavefront" through the backend: the op runs the forward
    pass, the gradient (inputs and every variable) is cuDNN's."""
    stack = _stack(kind, 3, 256, 128)
    rng = np.random.default_rng(5)
    x = tf.constant(rng.standard_normal((16, 40, 128)), tf.float16)
    weights = tf.constant(rng.standard_normal((16, 40, 256)), tf.float32)
    variables = [v.value for (cell,) in stack.cells for v in cell.trainable_weights]
    grads, kernels = [], []
    for kernel in ("wavefront", "cudnn"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            run = tf_backend.run_stack(x, stack=stack, kernel=kernel)
            loss = tf.reduce_sum(tf.cast(run.outputs, tf.float32) * weights)
        kernels.append(run.kernel)
        grads.append(tape.gradient(loss, [x, *variables]))
    assert kernels[0].name == wavefront_op.KERNEL_NAME and kernels[0].note is None
    assert kernels[1].name == "RnnfuseCudnnRnn"
    for got, want in zip(*grads):
        assert got is not None and _rel(got, np.asarray(tf.cast(want, tf.float64))) <= 1e-3


# -- the tuner candidate, through predict ------------------------------------------------


def _lstm_model(layers, units, steps):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        return stack_model("lstm", layers, units=units, input_size=units, steps=steps,
                           last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")


def _median_predict_s(model, x, batch, repeats=5):
    model.predict(x, batch_size=batch, verbose=0)  # trace
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.predict(x, batch_size=batch, verbose=0)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def test_predict_of_a_4x512_float16_lstm_at_batch_64_runs_the_wavefront_kernel(tmp_path):
    model = _lstm_model(4, 512, 1000)
    x = np.random.default_rng(0).standard_normal((256, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    y = fast.predict(x, batch_size=64, verbose=0)  # four full batches: one trace
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    assert record["mode"] == "inference" and record["input"] == [64, 1000, 512]
    assert record["chosen"] == "fused on wavefront", record
    # The traced predict step ran the op, no fallback (a note would say why).
    ran = layer.last_path.kernel
    assert ran.name == wavefront_op.KERNEL_NAME and ran.note is None, layer.last_path
    assert wavefront_op.KERNEL_NAME in traced_op_types(
        lambda t: fast(t, training=False), tf.constant(x[:64]))
    want = model.predict(x, batch_size=64, verbose=0)
    rel = _rel(y, want)
    assert rel <= 2e-3 and float(np.max(np.abs(np.asarray(y, np.float64) - want))) <= 2e-2
    original_s = _median_predict_s(model, x, 64)
    fast_s = _median_predict_s(fast, x, 64)
    assert layer.last_path.kernel.name == wavefront_op.KERNEL_NAME
    report("wavefront_predict_tf", {
        "shape": "4x512 LSTM B64 T1000 float16", "chosen": record["chosen"],
        "timings_ms": record["timings_ms"], "predict_original_ms": 1e3 * original_s,
        "predict_optimized_ms": 1e3 * fast_s, "speedup": original_s / fast_s, "rel_diff": rel,
    })
    assert fast_s < original_s, (fast_s, original_s)


def test_predict_at_batch_8_keeps_cudnn_or_the_original(tmp_path):
    """Batch 8, where cuDNN's persistent kernel is faster (docs/kernel.md's
    crossover): the wavefront plan is timed and not chosen."""
    model = _lstm_model(2, 512, 1000)
    x = np.random.default_rng(1).standard_normal((16, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    fast.predict(x, batch_size=8, verbose=0)
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    report("wavefront_predict_tf_b8", {"chosen": record["chosen"],
                                       "timings_ms": record["timings_ms"],
                                       "rejected": record["rejected"]})
    assert "fused on wavefront" in record["timings_ms"], record
    assert layer.plan.kernel != "wavefront" and "wavefront" not in record["chosen"], record
