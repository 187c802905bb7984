"""Keras integration of optimized models: fit, evaluate, predict, callbacks,
summary, and how the fused layer takes part in Keras' XLA decision.

The fused path runs through the emulated CudnnRNNV3 (tests/conftest.py), so
these tests train through the same packing and assembly code as on a GPU.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from builders import fused_layers, random_inputs, stack_model
from keras.src.trainers.trainer import model_supports_jit

import rnnfuse

L = keras.layers


def _twins(kind: str, **kwargs):
    """(original, reference): two equal models with identical weights."""
    model = stack_model(kind, 2, head=True, **kwargs)
    reference = stack_model(kind, 2, head=True, **kwargs)
    reference.set_weights(model.get_weights())
    return model, reference


def _data(model, n: int, seed: int):
    rng = np.random.default_rng(seed)
    return random_inputs(model, n, rng), rng.standard_normal((n, 3)).astype("float32")


def _emulate(monkeypatch) -> list:
    """What the emulated_cudnn fixture does, switched on mid-test."""
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend

    calls = []
    monkeypatch.setattr(
        tf_backend, "cudnn_rnn", lambda **kw: calls.append(kw) or emulated_cudnn_rnn(**kw)
    )
    monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    return calls


def test_fit_evaluate_predict_and_callbacks_track_the_original(emulated_cudnn, tmp_path):
    model, reference = _twins("rnn_tanh", steps=4, units=4, input_size=3)
    fast = rnnfuse.optimize(model)
    fast.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    # The reference runs eagerly: the same steps, without a second trace.
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], run_eagerly=True
    )
    x, y = _data(model, 12, 0)
    xv, yv = _data(model, 4, 1)
    weights_ckpt = tmp_path / "best.weights.h5"
    model_ckpt = tmp_path / "last.keras"
    callbacks = [
        keras.callbacks.ModelCheckpoint(weights_ckpt, save_weights_only=True),
        keras.callbacks.ModelCheckpoint(model_ckpt),
        # Stops after epoch 2: epoch 1 sets the best, epoch 2 cannot beat it by 10.
        keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=0),
    ]
    history = fast.fit(
        x, y, batch_size=4, epochs=5, shuffle=False, verbose=0,
        validation_data=(xv, yv), callbacks=callbacks,
    )
    assert emulated_cudnn, "the fused path did not run"
    assert len(history.history["loss"]) == 2  # EarlyStopping stopped it
    expected = reference.fit(
        x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv)
    )
    for key in ("loss", "mae", "val_loss"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5, atol=1e-6
        )
    for a, b in zip(model.weights, reference.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    expected_out = np.asarray(reference(xv))
    loss, mae = fast.evaluate(xv, yv, verbose=0)
    np.testing.assert_allclose(loss, np.mean((expected_out - yv) ** 2), rtol=1e-5)
    np.testing.assert_allclose(mae, np.mean(np.abs(expected_out - yv)), rtol=1e-5)
    np.testing.assert_allclose(fast.predict(xv, verbose=0), expected_out, atol=1e-5)
    # The weights checkpoint loads into the original model's code; the
    # .keras checkpoint is the original model's file, which
    # rnnfuse.load_model optimizes again.
    fresh = stack_model("rnn_tanh", 2, head=True, steps=4, units=4, input_size=3)
    fresh.load_weights(weights_ckpt)
    for a, b in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    loaded = keras.models.load_model(model_ckpt)
    assert not fused_layers(loaded)
    np.testing.assert_allclose(loaded(xv), fast(xv), atol=1e-6)
    again = rnnfuse.load_model(model_ckpt)
    assert len(fused_layers(again)) == 1
    assert int(again.optimizer.iterations.numpy()) == int(fast.optimizer.iterations.numpy())


def test_summary_lists_the_fused_layer_and_every_parameter():
    model = stack_model("lstm", 3, head=True)
    fast = rnnfuse.optimize(model)
    lines = []
    fast.summary(print_fn=lambda line, **_: lines.append(line))
    text = "\n".join(lines)
    assert "FusedRNN" in text
    assert f"{model.count_params():,}" in text
    assert fast.count_params() == model.count_params()


# -- XLA -------------------------------------------------------------------------


def test_a_fused_layer_that_may_run_cudnn_opts_out_of_xla(emulated_cudnn, monkeypatch):
    import tensorflow as tf

    model = stack_model("rnn_tanh", 2, head=True)  # Keras' own SimpleRNN: XLA-able
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.uses_fused_kernel and not fused.supports_jit
    assert model_supports_jit(model) and not model_supports_jit(fast)
    # jit_compile="auto" on a machine with a GPU (Keras turns XLA off on
    # CPU-only machines before it asks the layers).
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *a: [gpu])
    model.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    fast.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    assert model.jit_compile is True
    assert fast.jit_compile is False


def test_forcing_jit_compile_true_is_a_clear_error(emulated_cudnn):
    fast = rnnfuse.optimize(stack_model("rnn_tanh", 2, head=True))
    words = r"jit_compile=True.*'fused_rnn_tanh_0_to_rnn_tanh_1'.*XLA cannot compile cuDNN.*jit_compile='auto'"
    with pytest.raises(ValueError, match=words):
        fast.compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_tracing_the_fused_path_for_xla_is_a_clear_error(emulated_cudnn):
    import tensorflow as tf

    model = stack_model("rnn_tanh", 2, head=True)
    fast = rnnfuse.optimize(model)
    x = random_inputs(model, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="FusedRNN 'fused_rnn_tanh_0_to_rnn_tanh_1'.*traced for XLA"):
        tf.function(lambda t: fast(t), jit_compile=True)(x)


def test_without_a_gpu_jit_compile_true_just_works():
    model = stack_model("rnn_tanh", 2, head=True, steps=4)
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast)[0].supports_jit
    fast.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    assert fast.jit_compile is True
    x, y = _data(model, 8, 2)
    history = fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    np.testing.assert_allclose(fast(x), model(x), atol=1e-6)
    # LSTM stacks: Keras' own LSTM opts out; no error either.
    lstm = rnnfuse.optimize(stack_model("lstm", 2, head=True))
    lstm.compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_a_model_compiled_for_xla_without_gpu_loads_where_cudnn_runs(tmp_path, monkeypatch):
    fast = rnnfuse.optimize(stack_model("rnn_tanh", 2, head=True))
    fast.compile(optimizer="sgd", loss="mse", jit_compile=True)
    fast.save(tmp_path / "xla.keras", fused=True)
    fast.save(tmp_path / "plain.keras")
    _emulate(monkeypatch)
    for loaded in (keras.models.load_model(tmp_path / "xla.keras"),
                   rnnfuse.load_model(tmp_path / "plain.keras")):
        assert fused_layers(loaded)[0].uses_fused_kernel
        assert loaded.compiled and loaded.jit_compile is False
