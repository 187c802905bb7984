"""rnnfuse.layers.ProjectedLSTM runs PyTorch's proj_size LSTM under torch.

Stacks fused by `rnnfuse.optimize` make one `torch._VF.lstm` call with a
projection weight per pseudo-layer; a single ProjectedLSTM layer makes one
call of its own. The reference is Keras' generic loop over
`ProjectedLSTMCell` (the LSTMP equations written with keras.ops), forced
with `fast_path("off")` (or `use_cudnn=False`).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

import rnnfuse
from builders import fused_layers, max_abs_diff, sequence_input
from rnnfuse.layers import ProjectedLSTM
from rnnfuse.layers.projected_lstm import fast_path

L = keras.layers
UNITS, PROJ, STEPS, FEATURES = 7, 3, 6, 5


def _model(num_layers, *, bidirectional=False, masked=False, return_state=False, initial_state=False):
    inp, x = sequence_input(masked, STEPS, FEATURES)
    inputs = [inp]
    for i in range(num_layers):
        last = i == num_layers - 1
        layer = ProjectedLSTM(UNITS, PROJ, return_sequences=True, return_state=last and return_state)
        if bidirectional:
            layer = L.Bidirectional(layer)
        kwargs = {}
        if i == 0 and initial_state:
            states = [keras.Input((PROJ,)), keras.Input((UNITS,))]
            if bidirectional:
                states += [keras.Input((PROJ,)), keras.Input((UNITS,))]
            inputs += states
            kwargs["initial_state"] = states
        x = layer(x, **kwargs)
    model = keras.Model(inputs if len(inputs) > 1 else inp, x)
    rng = np.random.default_rng(num_layers)
    for v in model.weights:
        v.assign(rng.uniform(-0.6, 0.6, v.shape).astype("float32"))
    return model


def _inputs(model, rng):
    values = []
    for spec in model.inputs:
        shape = [3 if d is None else d for d in spec.shape]
        if "int" in str(spec.dtype):
            tokens = rng.integers(1, 11, shape)
            tokens[0, 2:] = 0
            tokens[2, 4:] = 0
            values.append(tokens.astype("int32"))
        else:
            values.append(rng.standard_normal(shape).astype("float32"))
    return values if len(values) > 1 else values[0]


def _grads(model, inputs):
    out = model(inputs)
    loss = sum((t.float() ** 2).sum() for t in keras.tree.flatten(out))
    return out, torch.autograd.grad(loss, [v.value for v in model.trainable_variables])


@pytest.mark.parametrize("num_layers", [2, 3])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_projected_stack_runs_one_projected_call(num_layers, bidirectional, masked, torch_calls):
    model = _model(num_layers, bidirectional=bidirectional, masked=masked, return_state=True)
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.stack.proj_size == PROJ
    inputs = _inputs(model, np.random.default_rng(0))
    torch_calls.clear()
    with fast_path("off"):
        expected, expected_grads = _grads(model, inputs)
    got, got_grads = _grads(fast, inputs)
    assert len(torch_calls) == 1, fused.last_path
    call = torch_calls[0]
    assert call["mode"] == "lstm" and call["num_layers"] == num_layers
    assert call["packed"] is masked
    per_layer = 5  # w_ih, w_hh, b_ih, b_hh, w_hr
    assert len(call["params"]) == per_layer * num_layers * (2 if bidirectional else 1)
    assert tuple(call["params"][4].shape) == (PROJ, UNITS)
    assert max_abs_diff(got, expected) <= 2e-5
    for g, e in zip(got_grads, expected_grads):
        assert float((g - e).abs().max()) <= 1e-4


@pytest.mark.parametrize("bidirectional", [False, True])
def test_projected_initial_state_and_return_state(bidirectional, torch_calls):
    model = _model(2, bidirectional=bidirectional, return_state=True, initial_state=True)
    fast = rnnfuse.optimize(model)
    inputs = _inputs(model, np.random.default_rng(1))
    torch_calls.clear()
    with fast_path("off"):
        expected = model(inputs)
    got = fast(inputs)
    assert len(torch_calls) == 1
    shapes = [tuple(t.shape) for t in keras.tree.flatten(got)]
    assert shapes == [tuple(t.shape) for t in keras.tree.flatten(expected)]
    assert (3, PROJ) in shapes and (3, UNITS) in shapes
    assert max_abs_diff(got, expected) <= 2e-5


def test_projected_mixed_bfloat16(torch_calls):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _model(2)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model)
    inputs = _inputs(model, np.random.default_rng(2))
    got = fast(inputs)
    assert torch_calls and torch_calls[0]["params"][4].dtype == torch.bfloat16
    with fast_path("off"):
        expected = model(inputs)
    assert max_abs_diff(got, expected) <= 6e-2


# -- a single ProjectedLSTM layer -----------------------------------------------------


def _single(*, bidirectional=False, masked=False, initial_state=False, dtype=None, **kwargs):
    """One ProjectedLSTM (or Bidirectional) layer returning sequences and states."""
    inp, x = sequence_input(masked, STEPS, FEATURES)
    layer = ProjectedLSTM(
        UNITS, PROJ, return_sequences=True, return_state=True, dtype=dtype, **kwargs
    )
    outer = L.Bidirectional(layer, dtype=dtype) if bidirectional else layer
    inputs, call_kwargs = [inp], {}
    if initial_state:
        states = []
        for _ in range(2 if bidirectional else 1):
            states += [keras.Input((PROJ,)), keras.Input((UNITS,))]
        inputs += states
        call_kwargs["initial_state"] = states
    model = keras.Model(inputs if len(inputs) > 1 else inp, outer(x, **call_kwargs))
    rng = np.random.default_rng(7)
    for v in model.weights:
        v.assign(rng.uniform(-0.6, 0.6, v.shape).astype("float32"))
    parts = (outer.forward_layer, outer.backward_layer) if bidirectional else (layer,)
    return model, parts


def _input_grads(model, inputs):
    """Outputs and gradients w.r.t. the weights and the float inputs."""
    inputs = keras.tree.map_structure(torch.as_tensor, inputs)
    floats = [t.requires_grad_() for t in keras.tree.flatten(inputs) if t.is_floating_point()]
    out = model(inputs)
    loss = sum(
        (t.float() * torch.linspace(-1.0, 2.0, t.shape[-1]) + t.float() ** 2).sum()
        for t in keras.tree.flatten(out)
    )
    wrt = [v.value for v in model.trainable_variables] + floats
    return out, torch.autograd.grad(loss, wrt)


def _assert_matches_keras_loop(model, parts, inputs, torch_calls, *, calls, tol=2e-5):
    torch_calls.clear()
    with fast_path("off"):
        expected, expected_grads = _input_grads(model, inputs)
    assert not torch_calls
    assert all(p.last_path.startswith("keras_loop") for p in parts)
    got, got_grads = _input_grads(model, inputs)
    paths = [p.last_path for p in parts]
    assert len(torch_calls) == calls, paths
    if calls:
        assert paths == ["torch_fused"] * len(parts)
        for call in torch_calls:
            assert call["mode"] == "lstm" and call["num_layers"] == 1
            assert tuple(call["params"][4].shape) == (PROJ, UNITS)
    else:
        assert all(p.startswith("keras_loop") for p in paths), paths
    shapes = [tuple(t.shape) for t in keras.tree.flatten(got)]
    assert shapes == [tuple(t.shape) for t in keras.tree.flatten(expected)]
    assert max_abs_diff(got, expected) <= tol
    assert len(got_grads) == len(expected_grads)
    for g, e in zip(got_grads, expected_grads):
        assert float((g - e).abs().max()) <= 10 * tol


@pytest.mark.parametrize(
    "bidirectional, go_backwards, zero_output_for_mask",
    [
        (False, False, False),
        (False, False, True),
        (False, True, False),
        (False, True, True),
        (True, False, None),
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_single_layer_runs_torch_call(
    bidirectional, go_backwards, zero_output_for_mask, masked, torch_calls
):
    kwargs = {"go_backwards": go_backwards}
    if zero_output_for_mask is not None:
        kwargs["zero_output_for_mask"] = zero_output_for_mask
    model, parts = _single(
        bidirectional=bidirectional, masked=masked, initial_state=not masked, **kwargs
    )
    inputs = _inputs(model, np.random.default_rng(3))
    _assert_matches_keras_loop(
        model, parts, inputs, torch_calls, calls=2 if bidirectional else 1
    )
    if masked:
        assert all(c["packed"] for c in torch_calls)


@pytest.mark.parametrize("hole", ["middle", "left_padded", "empty_row"])
@pytest.mark.parametrize("go_backwards", [False, True])
def test_single_layer_unsupported_mask_runs_keras_loop(hole, go_backwards, torch_calls):
    model, parts = _single(masked=True, go_backwards=go_backwards)
    tokens = _inputs(model, np.random.default_rng(4))
    if hole == "middle":
        tokens[1, 2] = 0
    elif hole == "left_padded":
        tokens[1, :3], tokens[1, 3:] = 0, 5
    else:
        tokens[1, :] = 0
    torch_calls.clear()
    got = model(tokens)
    assert not torch_calls and parts[0].last_path.startswith("keras_loop: the mask")
    with fast_path("off"):
        expected = model(tokens)
    assert max_abs_diff(got, expected) == 0.0


def test_single_layer_use_cudnn_false_and_reasons(torch_calls):
    x = np.random.default_rng(5).standard_normal((2, STEPS, FEATURES)).astype("float32")
    off = ProjectedLSTM(UNITS, PROJ, use_cudnn=False)
    rec = ProjectedLSTM(UNITS, PROJ, recurrent_dropout=0.2)
    wide = ProjectedLSTM(PROJ, UNITS)  # proj_size >= units: PyTorch refuses
    relu = ProjectedLSTM(UNITS, PROJ, activation="relu")
    for layer in (off, rec, wide, relu):
        layer(x, training=True)
    assert not torch_calls
    assert off.last_path == "keras_loop: use_cudnn=False"
    assert "recurrent_dropout" in rec.last_path
    assert "proj_size < units" in wide.last_path
    assert "tanh and sigmoid" in relu.last_path
    with pytest.raises(ValueError, match="use_cudnn=True"):
        ProjectedLSTM(PROJ, UNITS, use_cudnn=True)(x)
    fused = ProjectedLSTM(UNITS, PROJ, use_cudnn=True)
    fused(x)
    assert fused.last_path.split("/")[0] == "torch_fused" and len(torch_calls) == 1


def test_single_layer_input_dropout_matches_keras_loop(torch_calls):
    """Same seed, same dropout masks: training outputs and gradients match."""
    x = torch.as_tensor(
        np.random.default_rng(6).standard_normal((3, STEPS, FEATURES)).astype("float32")
    )
    layers = [
        ProjectedLSTM(UNITS, PROJ, dropout=0.4, seed=11, return_sequences=True, use_cudnn=u)
        for u in ("auto", False)
    ]
    results = []
    for layer in layers:
        layer.build(x.shape)
        rng = np.random.default_rng(8)
        for v in layer.weights:
            v.assign(rng.uniform(-0.6, 0.6, v.shape).astype("float32"))
        y = layer(x, training=True)
        grads = torch.autograd.grad((y**2).sum(), [v.value for v in layer.trainable_variables])
        results.append((y, grads))
    assert layers[0].last_path == "torch_fused" and len(torch_calls) == 1
    (y0, g0), (y1, g1) = results
    assert float((y0 - y1).detach().abs().max()) <= 2e-5
    for a, b in zip(g0, g1):
        assert float((a - b).abs().max()) <= 2e-4
    # Without dropout the result differs: the masks were applied.
    plain = layers[0](x, training=False)
    assert float((plain - y0).detach().abs().max()) > 1e-3


def test_single_layer_stateful_matches_keras_loop(torch_calls):
    x = np.random.default_rng(9).standard_normal((2, STEPS, FEATURES)).astype("float32")
    layers = [
        ProjectedLSTM(UNITS, PROJ, stateful=True, use_cudnn=u) for u in ("auto", False)
    ]
    outs = []
    for layer in layers:
        layer(x)
        rng = np.random.default_rng(10)
        for v in layer.trainable_weights:
            v.assign(rng.uniform(-0.6, 0.6, v.shape).astype("float32"))
        layer.reset_states()
        outs.append([layer(x), layer(x[:, ::-1])])
    assert layers[0].last_path == "torch_fused" and len(torch_calls) == 3
    assert max_abs_diff(outs[0], outs[1]) <= 2e-5
    assert max_abs_diff(outs[0][0], outs[0][1]) > 1e-3


def test_single_layer_mixed_bfloat16(torch_calls):
    model, parts = _single(masked=True, dtype="mixed_bfloat16")
    tokens = _inputs(model, np.random.default_rng(12))
    torch_calls.clear()
    got = model(tokens)
    assert parts[0].last_path == "torch_fused" and len(torch_calls) == 1
    assert torch_calls[0]["params"][4].dtype == torch.bfloat16
    with fast_path("off"):
        expected = model(tokens)
    assert max_abs_diff(got, expected) <= 6e-2
