"""The Keras -> PyTorch weight conversion, checked against Keras' own layers.

`run_stack` is called directly (no FusedRNN) on stacks of Keras layers with
random non-zero weights and biases; the reference is the same layers run one
after another by Keras' torch backend (its `_fallback_lstm/_fallback_gru`
loops and its generic `rnn()` loop). A wrong transpose, gate order, bias
placement, layer order or direction order fails here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

from builders import KINDS, rnn_layer, stack_spec
from lstmp_reference import lstmp
from rnnfuse.backends import torch as torch_backend
from rnnfuse.backends.base import GATES, StackCall, StackSpec
from rnnfuse.layers import ProjectedLSTM

B, T, F, H = 3, 6, 5, 4


def _randomize(layers, rng, scale=0.5):
    for layer in layers:
        for w in layer.weights:
            w.assign(rng.uniform(-scale, scale, w.shape).astype("float32"))


def _build(kind, num_levels, bidirectional, use_bias=True, rng=None):
    rng = rng or np.random.default_rng(0)
    layers = []
    for _ in range(num_levels):
        layer = rnn_layer(kind, H, return_sequences=True, return_state=True, use_bias=use_bias)
        layers.append(keras.layers.Bidirectional(layer) if bidirectional else layer)
    x = rng.standard_normal((B, T, F)).astype("float32")
    y = x
    for layer in layers:
        y = layer(y)[0]
    _randomize(layers, rng)
    return layers, x


def _keras_reference(layers, x, kind):
    """Outputs of the last layer and final states of every pseudo-layer."""
    states = []
    y = x
    for layer in layers:
        out = layer(y)
        y = out[0]
        per_dir = out[1:]
        n = 2 if kind == "lstm" else 1
        for d in range(len(per_dir) // n):
            states.append(per_dir[d * n : (d + 1) * n])
    return y, states


def _np(t):
    """float64 NumPy copy of a tensor or a Keras variable."""
    return keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(t)).astype(np.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_levels", [1, 2, 3, 4])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_run_stack_matches_keras_layers(kind, num_levels, bidirectional, torch_calls):
    layers, x = _build(kind, num_levels, bidirectional, rng=np.random.default_rng(num_levels))
    expected, states = _keras_reference(layers, x, kind)
    spec = stack_spec(layers)
    out, h, c, _ = torch_backend.run_stack(keras.ops.convert_to_tensor(x), StackCall(spec))

    assert [call["mode"] for call in torch_calls] == [kind], "not one fused call"
    call = torch_calls[0]
    assert call["num_layers"] == num_levels
    assert call["bidirectional"] is bidirectional
    assert len(call["params"]) == 4 * num_levels * (2 if bidirectional else 1)
    np.testing.assert_allclose(_np(out), _np(expected), atol=2e-6)
    assert h.shape == (spec.num_pseudo_layers, B, H)
    for p, s in enumerate(states):
        np.testing.assert_allclose(_np(h[p]), _np(s[0]), atol=2e-6)
        if kind == "lstm":
            np.testing.assert_allclose(_np(c[p]), _np(s[1]), atol=2e-6)
    assert (c is None) is (kind != "lstm")


@pytest.mark.parametrize("kind", KINDS)
def test_use_bias_false_matches_keras(kind):
    layers, x = _build(kind, 2, False, use_bias=False)
    expected, _ = _keras_reference(layers, x, kind)
    out, _, _, _ = torch_backend.run_stack(keras.ops.convert_to_tensor(x), StackCall(stack_spec(layers)))
    np.testing.assert_allclose(_np(out), _np(expected), atol=2e-6)


def test_weight_list_layout_per_kind():
    """Shapes, zero recurrent biases and the GRU gate swap, read directly."""
    rng = np.random.default_rng(1)
    for kind in KINDS:
        layers, _ = _build(kind, 2, True, rng=rng)
        spec = stack_spec(layers)
        params = torch_backend.pack_params(spec)
        g = GATES[kind]
        assert len(params) == 4 * 4
        widths = [F, F, 2 * H, 2 * H]
        for p, n in enumerate(widths):
            w_ih, w_hh, b_ih, b_hh = params[4 * p : 4 * p + 4]
            cell = spec.cells[p // 2][p % 2]
            kernel = _np(cell.kernel)
            assert tuple(w_ih.shape) == (g * H, n)
            assert tuple(w_hh.shape) == (g * H, H)
            if kind == "gru":
                bias = _np(cell.bias)
                # PyTorch's r, z, n = Keras' r, z, h blocks.
                np.testing.assert_array_equal(_np(w_ih[:H]), kernel[:, H : 2 * H].T)
                np.testing.assert_array_equal(_np(w_ih[H : 2 * H]), kernel[:, :H].T)
                np.testing.assert_array_equal(_np(w_ih[2 * H :]), kernel[:, 2 * H :].T)
                np.testing.assert_array_equal(_np(b_hh[:H]), bias[1, H : 2 * H])
                np.testing.assert_array_equal(_np(b_ih[2 * H :]), bias[0, 2 * H :])
            else:
                np.testing.assert_array_equal(_np(w_ih), kernel.T)
                np.testing.assert_array_equal(_np(b_ih), _np(cell.bias))
                assert not _np(b_hh).any()


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_the_original_variables(kind):
    layers, x = _build(kind, 3, kind in ("lstm", "gru"), rng=np.random.default_rng(7))
    variables = [w for layer in layers for w in layer.trainable_weights]
    params = [v.value for v in variables]
    w = torch.as_tensor(np.random.default_rng(8).standard_normal(64).astype("float32"))

    expected, _ = _keras_reference(layers, x, kind)
    loss = (expected * w[: expected.shape[-1]]).sum()
    expected_grads = torch.autograd.grad(loss, params)

    out, _, _, _ = torch_backend.run_stack(keras.ops.convert_to_tensor(x), StackCall(stack_spec(layers)))
    loss = (out * w[: out.shape[-1]]).sum()
    got_grads = torch.autograd.grad(loss, params)
    for v, g, e in zip(variables, got_grads, expected_grads):
        assert float(e.abs().max()) > 0, v.path
        np.testing.assert_allclose(_np(g), _np(e), atol=1e-5, err_msg=v.path)


def test_assigning_a_variable_changes_the_fused_output():
    layers, x = _build("gru", 2, False)
    spec = stack_spec(layers)
    before = _np(torch_backend.run_stack(keras.ops.convert_to_tensor(x), StackCall(spec))[0])
    cell = spec.cells[1][0]
    cell.recurrent_kernel.assign(np.zeros(cell.recurrent_kernel.shape, "float32"))
    after = _np(torch_backend.run_stack(keras.ops.convert_to_tensor(x), StackCall(spec))[0])
    assert np.abs(after - before).max() > 1e-3
    expected, _ = _keras_reference(layers, x, "gru")
    np.testing.assert_allclose(after, _np(expected), atol=2e-6)


def _numpy_lstmp(x, cells, h0, c0):
    """Independent NumPy LSTMP over levels (unidirectional): the equations."""
    y = x.astype(np.float64)
    hs, cs = [], []
    for level, cell in enumerate(cells):
        k, r, b, p = (_np(cell.kernel), _np(cell.recurrent_kernel), _np(cell.bias), _np(cell.projection_kernel))
        y, h, c = lstmp(y, (k, r, b, p), h0[level].astype(np.float64), c0[level].astype(np.float64))
        hs.append(h)
        cs.append(c)
    return y, hs, cs


def test_projection_matches_numpy_lstmp_reference(torch_calls):
    rng = np.random.default_rng(11)
    units, proj = 6, 3
    layers = [ProjectedLSTM(units, proj, return_sequences=True) for _ in range(3)]
    x = rng.standard_normal((B, T, F)).astype("float32")
    y = x
    for layer in layers:
        y = layer(y)
    _randomize(layers, rng)
    h0 = rng.standard_normal((3, B, proj)).astype("float32")
    c0 = rng.standard_normal((3, B, units)).astype("float32")
    spec = stack_spec(layers)
    assert spec.proj_size == proj
    torch_calls.clear()  # building the layers ran their own (single-layer) calls
    out, h, c, _ = torch_backend.run_stack(
        keras.ops.convert_to_tensor(x), StackCall(spec, initial_h=list(h0), initial_c=list(c0))
    )
    params = torch_calls[0]["params"]
    assert len(params) == 5 * 3  # w_ih, w_hh, b_ih, b_hh, w_hr per level
    assert tuple(params[4].shape) == (proj, units)
    expected, hs, cs = _numpy_lstmp(x, [l.cell for l in layers], h0, c0)
    np.testing.assert_allclose(_np(out), expected, atol=2e-6)
    assert tuple(h.shape) == (3, B, proj) and tuple(c.shape) == (3, B, units)
    for level in range(3):
        np.testing.assert_allclose(_np(h[level]), hs[level], atol=2e-6)
        np.testing.assert_allclose(_np(c[level]), cs[level], atol=2e-6)


def test_lengths_reverse_and_initial_states_match_a_per_sequence_run():
    """Masked run == each sequence run alone on its own length."""
    rng = np.random.default_rng(5)
    layers, x = _build("lstm", 2, True, rng=rng)
    spec = stack_spec(layers)
    lengths = [6, 2, 4]
    mask = np.arange(T)[None, :] < np.array(lengths)[:, None]
    h0 = [rng.standard_normal((B, H)).astype("float32") for _ in range(4)]
    c0 = [rng.standard_normal((B, H)).astype("float32") for _ in range(4)]
    for reverse in (False, True):
        out, h, c, _ = torch_backend.run_stack(
            keras.ops.convert_to_tensor(x),
            StackCall(spec, mask=mask, reverse=reverse, initial_h=h0, initial_c=c0),
        )
        for b, n in enumerate(lengths):
            xb = x[b : b + 1, :n]
            if reverse:
                xb = xb[:, ::-1].copy()
            ob, hb, cb, _ = torch_backend.run_stack(
                keras.ops.convert_to_tensor(xb),
                StackCall(spec, initial_h=[s[b : b + 1] for s in h0],
                          initial_c=[s[b : b + 1] for s in c0]),
            )
            np.testing.assert_allclose(_np(out[b, :n]), _np(ob[0]), atol=2e-6)
            assert not _np(out[b, n:]).any(), "padded steps are not zero"
            np.testing.assert_allclose(_np(h[:, b]), _np(hb[:, 0]), atol=2e-6)
            np.testing.assert_allclose(_np(c[:, b]), _np(cb[:, 0]), atol=2e-6)


def test_mask_is_supported_values():
    ok = np.array([[1, 1, 0], [1, 1, 1]], bool)
    hole = np.array([[1, 0, 1], [1, 1, 1]], bool)
    empty = np.array([[0, 0, 0], [1, 1, 1]], bool)
    assert bool(torch_backend.mask_is_supported(ok))
    assert not bool(torch_backend.mask_is_supported(hole))
    assert not bool(torch_backend.mask_is_supported(empty))


def test_unsupported_reason():
    cells = ((keras.layers.LSTMCell(4),),)
    spec = StackSpec("lstm", 4, cells)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert torch_backend.unsupported_reason(spec, dtype) is None
    assert "int32" in torch_backend.unsupported_reason(spec, "int32")
    too_wide = StackSpec("lstm", 4, cells, proj_size=4)
    assert "proj_size" in torch_backend.unsupported_reason(too_wide, "float32")


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_per_level_calls_compute_what_one_call_computes(kind, bidirectional, masked, torch_calls):
    rng = np.random.default_rng(21)
    layers, x = _build(kind, 3, bidirectional, rng=rng)
    spec = stack_spec(layers)
    mask = (np.arange(T)[None, :] < np.array([6, 3, 1])[:, None]) if masked else None
    n = 2 if kind == "lstm" else 1
    h0 = [rng.standard_normal((B, H)).astype("float32") for _ in range(spec.num_pseudo_layers)]
    call = StackCall(spec, mask=mask, initial_h=h0, initial_c=h0 if n == 2 else None)
    xt = keras.ops.convert_to_tensor(x)
    with torch_backend.call_mode("one"):
        one = torch_backend.run_stack(xt, call)
    with torch_backend.call_mode("per_level"):
        per = torch_backend.run_stack(xt, call)
    assert [c["num_layers"] for c in torch_calls] == [3, 1, 1, 1]
    assert all(c["packed"] is masked for c in torch_calls)
    for a, b in zip(one[:3], per[:3]):
        if a is None:
            assert b is None
        else:
            np.testing.assert_allclose(_np(b), _np(a), atol=2e-6)


def test_call_mode_auto_is_one_call_on_the_cpu(torch_calls):
    layers, x = _build("lstm", 3, False)
    assert torch_backend.get_call_mode() == "auto"
    torch_backend.run_stack(keras.ops.convert_to_tensor(x).half(), StackCall(stack_spec(layers)))
    assert [c["num_layers"] for c in torch_calls] == [3]
    with pytest.raises(ValueError, match="per_level"):
        torch_backend.set_call_mode("split")


def test_per_level_calls_apply_between_level_dropout(torch_calls):
    layers, x = _build("gru", 3, False)
    xt = keras.ops.convert_to_tensor(x)
    spec = stack_spec(layers)
    with torch_backend.call_mode("per_level"):
        plain = _np(torch_backend.run_stack(xt, StackCall(spec))[0])
        torch.manual_seed(0)
        dropped = _np(torch_backend.run_stack(xt, StackCall(spec, dropout=0.5))[0])
        torch.manual_seed(0)
        again = _np(torch_backend.run_stack(xt, StackCall(spec, dropout=0.5))[0])
    assert np.abs(dropped - plain).max() > 1e-3
    np.testing.assert_array_equal(dropped, again)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge_mode, scale", [("sum", 1.0), ("ave", 0.5)])
@pytest.mark.parametrize("mode", ["one", "per_level"])
def test_sum_and_ave_merges_pack_the_next_input_kernel_doubled(kind, merge_mode, scale, mode, torch_calls):
    """Bidirectional(merge_mode=sum|ave) -> Bidirectional in one call: the
    upper level's w_ih is [s*W; s*W]^T (it reads [fwd, bwd]); outputs and
    gradients (W's: both halves' summed) are Keras' own."""
    rng = np.random.default_rng(11)
    layers = [
        keras.layers.Bidirectional(rnn_layer(kind, H, return_sequences=True), merge_mode=merge_mode),
        keras.layers.Bidirectional(rnn_layer(kind, H, return_sequences=True)),
    ]
    x = keras.ops.convert_to_tensor(rng.standard_normal((B, T, F)).astype("float32"))
    layers[1](layers[0](x))
    _randomize(layers, rng)
    spec = stack_spec(layers)
    assert spec.input_merges == (None, merge_mode)
    params = torch_backend.pack_params(spec)
    g = GATES[kind]
    for d in range(2):
        w_ih = params[4 * (2 + d)]
        assert tuple(w_ih.shape) == (g * H, 2 * H)
        plain = torch_backend._cell_params(kind, spec.cells[1][d], torch.float32, w_ih.device)[0]
        np.testing.assert_array_equal(_np(w_ih), scale * np.concatenate([_np(plain)] * 2, axis=1))

    variables = [v.value for layer in layers for v in layer.trainable_weights]
    expected = layers[1](layers[0](x))
    expected_grads = torch.autograd.grad((expected**2).sum(), variables)
    torch_calls.clear()
    with torch_backend.call_mode(mode):
        out, _, _, _ = torch_backend.run_stack(x, StackCall(spec))
    assert [c["num_layers"] for c in torch_calls] == ([2] if mode == "one" else [1, 1])
    np.testing.assert_allclose(_np(out), _np(expected), atol=2e-6)
    for got, want in zip(torch.autograd.grad((out**2).sum(), variables), expected_grads):
        np.testing.assert_allclose(_np(got), _np(want), atol=2e-5)
