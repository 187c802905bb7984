"""The flat cuDNN params buffer, checked with no GPU.

`pack_params` builds the buffer from Keras variables; the NumPy reference in
cudnn_reference.py reads it with cuDNN's layout and equations. Both are
checked against the original Keras layers (their generic CPU loop), so a
wrong gate order, transpose, bias placement or layer order fails here.

A Bidirectional merged by "sum" or "ave" inside a stack is checked against
a plain NumPy forward written from the Keras equations and variables (no
buffer at all): layer by layer, merging the directions as Keras does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from builders import KINDS, rnn_layer, stack_spec
from cudnn_reference import numpy_cudnn_rnn, unpack
from rnnfuse.backends.base import GATES, INPUT_SCALES
from rnnfuse.backends.tensorflow import pack_params
from rnnfuse.recurrent import PACKED_MERGES


def _run_keras(layers, x, initial=None):
    y = x
    for i, layer in enumerate(layers):
        y = layer(y, initial_state=initial if i == 0 else None)
    return np.asarray(y)


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

    params = pack_params(stack_spec(layers), "float32").numpy()
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
    params = pack_params(stack_spec(layers), "float32").numpy()
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
    assert int(pack_params(stack_spec(layers), "float32").shape[0]) == expected


def test_lstm_input_biases_are_zero_and_keras_bias_is_recurrent():
    layer = keras.layers.LSTM(3)
    layer(np.zeros((1, 2, 2), "float32"))
    layer.cell.bias.assign(np.arange(12, dtype="float32") + 1)
    params = pack_params(stack_spec([layer]), "float32").numpy()
    parts = unpack(np, params, "lstm", 2, 3, 1, 1)[0]
    np.testing.assert_array_equal(np.concatenate(parts["bW"]), np.zeros(12))
    np.testing.assert_array_equal(np.concatenate(parts["bR"]), np.arange(12) + 1)


def test_gru_gates_are_reordered_z_r_h_to_r_z_h():
    layer = keras.layers.GRU(2)
    layer(np.zeros((1, 2, 1), "float32"))
    bias = np.arange(12, dtype="float32").reshape(2, 6)
    layer.cell.bias.assign(bias)
    params = pack_params(stack_spec([layer]), "float32").numpy()
    parts = unpack(np, params, "gru", 1, 2, 1, 1)[0]
    # Keras rows: input [z0 z1 r0 r1 h0 h1], recurrent likewise.
    np.testing.assert_array_equal(np.concatenate(parts["bW"]), [2, 3, 0, 1, 4, 5])
    np.testing.assert_array_equal(np.concatenate(parts["bR"]), [8, 9, 6, 7, 10, 11])


def test_float16_buffer_is_cast_from_float32_variables():
    layer = keras.layers.GRU(4, return_sequences=True)
    layer(np.zeros((1, 2, 3), "float32"))
    p16 = pack_params(stack_spec([layer]), "float16")
    p32 = pack_params(stack_spec([layer]), "float32")
    assert p16.dtype.name == "float16"
    np.testing.assert_allclose(p16.numpy(), p32.numpy(), atol=1e-3, rtol=1e-3)


# -- a Bidirectional merged by "sum" or "ave" below the top ---------------------


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _keras_cell_step(kind, cell, x, h, c):
    """One step of a Keras cell, from its own variables (Keras' layout)."""
    k = np.asarray(cell.kernel, np.float64)
    r = np.asarray(cell.recurrent_kernel, np.float64)
    b = np.asarray(cell.bias, np.float64)
    if kind == "lstm":
        i, f, g, o = np.split(x @ k + h @ r + b, 4, axis=-1)
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        return _sigmoid(o) * np.tanh(c), c
    if kind == "gru":  # reset_after=True: bias rows are input, recurrent
        xz, xr, xh = np.split(x @ k + b[0], 3, axis=-1)
        rz, rr, rh = np.split(h @ r + b[1], 3, axis=-1)
        z, rg = _sigmoid(xz + rz), _sigmoid(xr + rr)
        return z * h + (1.0 - z) * np.tanh(xh + rg * rh), c
    pre = x @ k + b + h @ r
    return (np.tanh(pre) if kind == "rnn_tanh" else np.maximum(pre, 0.0)), c


def _keras_direction(kind, cell, x, lengths, reverse):
    """[B, T, H]: one direction over batch-major `x`, zeros past each length;
    the backward one reads each sequence reversed within its length."""
    batch, steps, _ = x.shape
    units = int(cell.units)
    h, c = np.zeros((batch, units)), np.zeros((batch, units))
    out = np.zeros((batch, steps, units))
    for t in range(steps):
        idx = np.array([(n - 1 - t if reverse else t) if t < n else t for n in lengths])
        valid = (t < np.asarray(lengths))[:, None]
        xt = x[np.arange(batch), idx]
        h_new, c_new = _keras_cell_step(kind, cell, xt, h, c)
        h, c = np.where(valid, h_new, h), np.where(valid, c_new, c)
        out[np.arange(batch), idx] = np.where(valid, h_new, 0.0)
    return out


def _numpy_bidirectional_stack(kind, layers, x, lengths):
    """The stack layer by layer as Keras runs it: each Bidirectional's two
    directions, merged by its merge_mode before the next layer reads them."""
    y = x.astype(np.float64)
    for layer in layers:
        fwd = _keras_direction(kind, layer.forward_layer.cell, y, lengths, reverse=False)
        bwd = _keras_direction(kind, layer.backward_layer.cell, y, lengths, reverse=True)
        y = {
            "concat": lambda: np.concatenate([fwd, bwd], -1),
            "sum": lambda: fwd + bwd,
            "ave": lambda: (fwd + bwd) / 2,
        }[layer.merge_mode]()
    return y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merges", [("sum",), ("ave",), ("sum", "ave"), ("concat", "ave")])
def test_sum_and_ave_between_levels_pack_the_next_kernel_doubled(kind, merges):
    """One call on the packed buffer == NumPy layer by layer with Keras' merges.

    Levels below the top merge by `merges`; the top one concatenates, so
    both of its directions are compared. Right-padded lengths included.
    """
    rng = np.random.default_rng(5)
    batch, steps, units = 3, 6, 4
    x = rng.standard_normal((batch, steps, 3)).astype("float32")
    lengths = [6, 4, 1]
    layers = [
        keras.layers.Bidirectional(rnn_layer(kind, units, return_sequences=True), merge_mode=m)
        for m in (*merges, "concat")
    ]
    _run_keras(layers, x)
    for layer in layers:
        for w in layer.weights:
            w.assign(rng.uniform(-0.6, 0.6, w.shape).astype("float32"))
    expected = _numpy_bidirectional_stack(kind, layers, x, lengths)
    # The NumPy forward is Keras' own computation (unmasked rows).
    np.testing.assert_allclose(expected[0], _run_keras(layers, x)[0], atol=2e-5)

    spec = stack_spec(layers)
    assert spec.input_merges == (None, *[m if m != "concat" else None for m in merges])
    params = pack_params(spec, "float32").numpy()
    levels = len(layers)
    h0 = np.zeros((2 * levels, batch, units))
    out, _, _ = numpy_cudnn_rnn(
        x.transpose(1, 0, 2), h0, h0 if kind == "lstm" else None, params, lengths, kind,
        bidirectional=True,
    )
    np.testing.assert_allclose(out.transpose(1, 0, 2), expected, atol=1e-9)


def test_the_packer_scales_exactly_the_merges_the_rule_lets_through():
    assert set(INPUT_SCALES) == set(PACKED_MERGES)


@pytest.mark.parametrize("merge, scale", [("sum", 1.0), ("ave", 0.5)])
def test_the_doubled_kernel_is_the_original_stacked_on_the_input_axis(merge, scale):
    layers = [
        keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True), merge_mode=merge),
        keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True)),
    ]
    _run_keras(layers, np.zeros((1, 2, 3), "float32"))
    params = pack_params(stack_spec(layers), "float32").numpy()
    # Level 1 reads 2H = 8 features in the buffer; its Keras kernel is [4, 12].
    gates, h = GATES["gru"], 4
    assert params.shape[0] == 2 * (gates * h * (3 + h) + gates * h * (2 * h + h)) + 4 * 2 * gates * h
    parts = unpack(np, params, "gru", 3, h, 2, 2)
    for d, cell in enumerate((layers[1].forward_layer.cell, layers[1].backward_layer.cell)):
        w = np.concatenate(parts[2 + d]["W"], axis=0)  # cuDNN r, z, h rows [3H, 2H]
        kernel = np.asarray(cell.kernel)  # Keras z, r, h columns [H, 3H]
        rzh = np.concatenate([kernel[:, h : 2 * h], kernel[:, :h], kernel[:, 2 * h :]], axis=1)
        np.testing.assert_array_equal(w, scale * np.concatenate([rzh, rzh], axis=0).T)
        # Biases are not doubled or scaled.
        bias = np.asarray(cell.bias)
        np.testing.assert_array_equal(np.concatenate(parts[2 + d]["bR"]), np.concatenate([bias[1, h : 2 * h], bias[1, :h], bias[1, 2 * h :]]))
