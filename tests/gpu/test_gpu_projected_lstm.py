"""ProjectedLSTM's fast path on the GPU against an exact float64 reference.

Proof that the fast path ran (a silent fall-back to Keras' loop fails):
a spy on the module's `_recurrence` dispatcher records every variant it ran,
`layer.last_path` names it, and the outputs live on the GPU. TF32 is off
(tests/gpu/conftest.py), so float32 results compare tightly.

Run on the GPU machine:

    python -m pytest -q tests/gpu/test_gpu_projected_lstm.py
"""

from __future__ import annotations

import numpy as np
import pytest

import keras
import tensorflow as tf

from lstmp_reference import lstmp, tensorflow_ops
from rnnfuse.layers import ProjectedLSTM
from rnnfuse.backends.tensorflow import projected_lstm as tf_plstm
from rnnfuse.layers import projected_lstm as plstm

pytestmark = pytest.mark.gpu

B, T, F, U, P = 4, 40, 12, 32, 8
GPU_VARIANTS = ("custom_xla", "custom", "while_xla", "while")
KERAS_SEED = 99  # tests/conftest.py seeds each test with it


@pytest.fixture
def spy(monkeypatch):
    """Records the variant of every call into the fast path's dispatcher."""
    seen = []
    real = tf_plstm._recurrence

    def recording(variant, *args, **kwargs):
        seen.append(variant)
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(tf_plstm, "_recurrence", recording)
    return seen


def _data(seed, batch=B, steps=T, features=F, units=U, proj=P):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, steps, features)).astype("float32")
    mask = rng.random((batch, steps)) > 0.25
    mask[0] = True
    mask[1, : steps // 3] = False  # leading padding
    h0 = rng.normal(size=(batch, proj)).astype("float32")
    c0 = rng.normal(size=(batch, units)).astype("float32")
    shapes = ((batch, steps, proj), (batch, proj), (batch, units))
    loss_w = [rng.normal(size=s).astype("float32") for s in shapes]
    return x, mask, h0, c0, loss_w


def _layer_run(layer, x, mask, h0, c0, loss_w):
    """Outputs and gradients on the GPU; an all-True mask is not passed."""
    h0v, c0v = tf.Variable(h0), tf.Variable(c0)
    kwargs = {} if mask.all() else {"mask": tf.constant(mask)}
    with tf.device("/GPU:0"):
        with tf.GradientTape() as tape:
            y, h, c = layer(x, initial_state=[h0v, c0v], **kwargs)
            outs = (y, h, c)
            loss = sum(tf.reduce_sum(tf.cast(a, tf.float32) * w) for a, w in zip(outs, loss_w))
        cell = layer.cell
        wrt = [cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel, h0v, c0v]
        grads = tape.gradient(loss, wrt)
    assert "GPU" in y.device, y.device
    as64 = lambda ts: [t.numpy().astype(np.float64) for t in ts]
    return as64((y, h, c)), as64(grads)


def _reference_run(layer, x, mask, h0, c0, loss_w, go_backwards, zero_output):
    cell = layer.cell
    with tf.device("/CPU:0"):
        params = [
            tf.constant(np.asarray(v.numpy(), np.float64))
            for v in (cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel)
        ] + [tf.constant(h0, tf.float64), tf.constant(c0, tf.float64)]
        with tf.GradientTape() as tape:
            tape.watch(params)
            # Keras' generic loop in float64 TensorFlow ops, written
            # independently of the layer (for outputs and gradients).
            y, h, c = lstmp(
                tf.constant(x, tf.float64), params[:4], params[4], params[5],
                tf.constant(mask), go_backwards, zero_output, ops=tensorflow_ops(),
            )
            loss = sum(
                tf.reduce_sum(a * tf.constant(w, tf.float64)) for a, w in zip((y, h, c), loss_w)
            )
        grads = tape.gradient(loss, params)
    return [t.numpy() for t in (y, h, c)], [g.numpy() for g in grads]


def _assert_close(got, want, atol, rtol):
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=f"tensor {k}")


def test_auto_resolves_to_xla_on_gpu():
    assert plstm.get_fast_path(resolve=True) == "custom_xla"


@pytest.mark.parametrize("variant", GPU_VARIANTS + ("custom_xla/u4",))
@pytest.mark.parametrize("go_backwards, masked", [(False, True), (True, True), (False, False)])
def test_fast_path_on_gpu_matches_float64_reference(variant, go_backwards, masked, spy):
    x, mask, h0, c0, loss_w = _data(1)
    if not masked:
        mask = np.ones_like(mask)
    layer = ProjectedLSTM(U, P, return_sequences=True, return_state=True, go_backwards=go_backwards)
    name, _, unroll = variant.partition("/u")
    with plstm.fast_path(name, int(unroll or 1)):
        outs, grads = _layer_run(layer, x, mask, h0, c0, loss_w)
    assert spy == [name] and layer.last_path == variant
    ref_outs, ref_grads = _reference_run(layer, x, mask, h0, c0, loss_w, go_backwards, False)
    _assert_close(outs, ref_outs, atol=1e-5, rtol=1e-4)
    _assert_close(grads, ref_grads, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("variant", ["custom_xla", "custom"])
def test_mixed_float16_on_gpu_matches_float64_reference(variant, spy):
    keras.config.set_dtype_policy("mixed_float16")
    x, mask, h0, c0, loss_w = _data(2)
    layer = ProjectedLSTM(U, P, return_sequences=True, return_state=True, zero_output_for_mask=True)
    with plstm.fast_path(variant):
        outs, grads = _layer_run(layer, x, mask, h0, c0, loss_w)
    assert spy == [variant] and layer.compute_dtype == "float16"
    ref_outs, ref_grads = _reference_run(layer, x, mask, h0, c0, loss_w, False, True)
    _assert_close(outs, ref_outs, atol=1e-2, rtol=1e-2)
    for g, r in zip(grads, ref_grads):
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, atol=1e-2 * scale, rtol=1e-2)


def test_speech_sized_layer_matches_keras_loop(spy):
    """1024/256-like shapes scaled down (T=300): default path vs Keras' loop."""
    batch, steps, features, units, proj = 8, 300, 64, 256, 64
    x, mask, h0, c0, loss_w = _data(3, batch, steps, features, units, proj)
    mask = np.ones_like(mask)
    mask[1, 200:] = False  # right padding
    layer = ProjectedLSTM(units, proj, return_sequences=True, return_state=True)
    results = {}
    for path in ("off", "auto"):
        with plstm.fast_path(path):
            results[path] = _layer_run(layer, x, mask, h0, c0, loss_w)
    assert spy == ["custom_xla"]
    fast, slow = results["auto"], results["off"]
    _assert_close(fast[0], slow[0], atol=1e-4, rtol=1e-3)
    for g, r in zip(fast[1], slow[1]):
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, atol=1e-4 * scale, rtol=1e-3)


def test_bidirectional_stack_in_model_fit_on_gpu(spy):
    """Keras' fit (jit_compile='auto': XLA on a GPU) trains a bidirectional
    ProjectedLSTM stack through the fast path, and the loss goes down."""
    x, mask, _, _, _ = _data(4)
    y = np.random.default_rng(4).normal(size=(B, 1)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((T, F)),
            keras.layers.Bidirectional(ProjectedLSTM(U, P, return_sequences=True)),
            keras.layers.Bidirectional(ProjectedLSTM(U, P)),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, epochs=15, batch_size=B, verbose=0)
    assert set(spy) == {"custom_xla"} and len(spy) >= 4
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
