"""Stacks of rnnfuse.layers.ProjectedLSTM run PyTorch's proj_size LSTM.

The reference is the ProjectedLSTM layers themselves, which under the torch
backend run Keras' generic loop over `ProjectedLSTMCell` (the LSTMP
equations written with keras.ops); the fused layer must make one
`torch._VF.lstm` call with a projection weight per pseudo-layer.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

import rnnfuse
from builders import fused_layers, max_abs_diff
from rnnfuse.layers import ProjectedLSTM

L = keras.layers
UNITS, PROJ, STEPS, FEATURES = 7, 3, 6, 5


def _model(num_layers, *, bidirectional=False, masked=False, return_state=False, initial_state=False):
    if masked:
        inp = keras.Input((STEPS,), dtype="int32")
        x = L.Embedding(11, FEATURES, mask_zero=True)(inp)
    else:
        inp = keras.Input((STEPS, FEATURES))
        x = inp
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
    got, expected = fast(inputs), model(inputs)
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
    assert max_abs_diff(got, model(inputs)) <= 6e-2
