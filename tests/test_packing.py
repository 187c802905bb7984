"""The flat cuDNN params buffer, checked with no GPU.

`pack_params` builds the buffer from Keras variables; the NumPy reference in
cudnn_reference.py reads it with cuDNN's layout and equations. Both are
checked against the original Keras layers (their generic CPU loop), so a
wrong gate order, transpose, bias placement or layer order fails here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from builders import KINDS, rnn_layer
from cudnn_reference import numpy_cudnn_rnn, unpack
from rnnfuse.backends.base import GATES, StackSpec
from rnnfuse.backends.tensorflow import pack_params
from rnnfuse.recurrent import describe


def _run_keras(layers, x, initial=None):
    y = x
    for i, layer in enumerate(layers):
        y = layer(y, initial_state=initial if i == 0 else None)
    return np.asarray(y)


def _spec(layers) -> StackSpec:
    views = [describe(l) for l in layers]
    return StackSpec(
        kind=views[0].kind,
        units=views[0].units,
        cells=tuple(level for v in views for level in v.levels),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("use_bias", [True, False])
def test_reference_reads_packed_buffer_like_keras(kind, num_layers, use_bias):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6, 5)).astype("float32")
    layers = [
        rnn_layer(kind, 4, return_sequences=True, use_bias=use_bias)
        for _ in range(num_layers)
    ]
    expected = _run_keras(layers, x)
    for layer in layers:  # non-zero biases, so their placement matters
        for w in layer.weights:
            w.assign(rng.standard_normal(w.shape).astype("float32") * 0.5)
    expected = _run_keras(layers, x)

    params = pack_params(_spec(layers), "float32").numpy()
    h0 = np.zeros((num_layers, 3, 4))
    out, h_n, _ = numpy_cudnn_rnn(
        x.transpose(1, 0, 2), h0, h0 if kind == "lstm" else None, params, [6, 6, 6], kind
    )
    np.testing.assert_allclose(out.transpose(1, 0, 2), expected, atol=2e-5)
    np.testing.assert_allclose(h_n[-1], expected[:, -1], atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bidirectional_layout_is_fwd0_bwd0_fwd1_bwd1_then_biases(kind):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3)).astype("float32")
    layers = [
        keras.layers.Bidirectional(rnn_layer(kind, 4, return_sequences=True))
        for _ in range(2)
    ]
    _run_keras(layers, x)
    for layer in layers:
        for w in layer.weights:
            w.assign(rng.standard_normal(w.shape).astype("float32") * 0.5)
    expected = _run_keras(layers, x)
    params = pack_params(_spec(layers), "float32").numpy()
    h0 = np.zeros((4, 2, 4))
    out, _, _ = numpy_cudnn_rnn(
        x.transpose(1, 0, 2), h0, h0 if kind == "lstm" else None, params,
        [5, 5], kind, bidirectional=True,
    )
    np.testing.assert_allclose(out.transpose(1, 0, 2), expected, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_buffer_size_matches_cudnn_arithmetic(kind):
    layers = [rnn_layer(kind, 7, return_sequences=True) for _ in range(3)]
    _run_keras(layers, np.zeros((1, 2, 5), "float32"))
    gates, h, n0 = GATES[kind], 7, 5
    expected = sum(gates * h * (n + h) + 2 * gates * h for n in (n0, h, h))
    assert int(pack_params(_spec(layers), "float32").shape[0]) == expected


def test_lstm_input_biases_are_zero_and_keras_bias_is_recurrent():
    layer = keras.layers.LSTM(3)
    layer(np.zeros((1, 2, 2), "float32"))
    layer.cell.bias.assign(np.arange(12, dtype="float32") + 1)
    params = pack_params(_spec([layer]), "float32").numpy()
    parts = unpack(np, params, "lstm", 2, 3, 1, 1)[0]
    np.testing.assert_array_equal(np.concatenate(parts["bW"]), np.zeros(12))
    np.testing.assert_array_equal(np.concatenate(parts["bR"]), np.arange(12) + 1)


def test_gru_gates_are_reordered_z_r_h_to_r_z_h():
    layer = keras.layers.GRU(2)
    layer(np.zeros((1, 2, 1), "float32"))
    bias = np.arange(12, dtype="float32").reshape(2, 6)
    layer.cell.bias.assign(bias)
    params = pack_params(_spec([layer]), "float32").numpy()
    parts = unpack(np, params, "gru", 1, 2, 1, 1)[0]
    # Keras rows: input [z0 z1 r0 r1 h0 h1], recurrent likewise.
    np.testing.assert_array_equal(np.concatenate(parts["bW"]), [2, 3, 0, 1, 4, 5])
    np.testing.assert_array_equal(np.concatenate(parts["bR"]), [8, 9, 6, 7, 10, 11])


def test_float16_buffer_is_cast_from_float32_variables():
    layer = keras.layers.GRU(4, return_sequences=True)
    layer(np.zeros((1, 2, 3), "float32"))
    p16 = pack_params(_spec([layer]), "float16")
    p32 = pack_params(_spec([layer]), "float32")
    assert p16.dtype.name == "float16"
    np.testing.assert_allclose(p16.numpy(), p32.numpy(), atol=1e-3, rtol=1e-3)
