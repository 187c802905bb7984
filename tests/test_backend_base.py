"""rnnfuse.backends.base: the contract's records and helpers (the backends'
implementations are in test_backends.py)."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest

from rnnfuse.backends.base import (
    PROJECTED_LSTM_PATHS,
    NoFusedKernel,
    ProjectedLSTMCall,
    StackCall,
    StackSpec,
    cpu_description,
    loss_weights,
    tanh_sigmoid,
)


def test_stack_spec_counts_levels_directions_and_output_width():
    cell = keras.layers.LSTMCell(4)
    spec = StackSpec("lstm", 4, ((cell, cell),) * 3, proj_size=2)
    assert (spec.num_levels, spec.num_directions, spec.num_pseudo_layers) == (3, 2, 6)
    assert spec.output_size == 2
    assert StackSpec("gru", 5, ((cell,),)).output_size == 5
    with pytest.raises(Exception):
        spec.units = 3  # frozen


def test_a_stack_call_has_the_contracts_defaults_and_is_frozen():
    spec = StackSpec("lstm", 4, ((keras.layers.LSTMCell(4),),))
    call = StackCall(spec)
    assert (call.initial_h, call.initial_c, call.mask, call.reverse) == (None, None, None, False)
    assert (call.dropout, call.seed, call.algorithm) == (0.0, (0, 0), None)
    assert (call.kernel, call.training) == ("cudnn", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.kernel = "wavefront"
    changed = dataclasses.replace(call, kernel="wavefront", training=True)
    assert (changed.stack, changed.kernel, changed.training) == (spec, "wavefront", True)
    assert call.kernel == "cudnn"
    assert [f.name for f in dataclasses.fields(StackCall)] == [
        "stack", "initial_h", "initial_c", "mask", "reverse", "dropout", "seed", "algorithm",
        "kernel", "training"]


def test_tanh_sigmoid_accepts_only_exactly_those_activations():
    assert tanh_sigmoid(keras.layers.LSTMCell(3))
    assert not tanh_sigmoid(keras.layers.LSTMCell(3, activation="relu"))
    assert not tanh_sigmoid(keras.layers.LSTMCell(3, recurrent_activation="hard_sigmoid"))
    own = object()
    cell = keras.layers.LSTMCell(3)
    cell.activation = own
    assert not tanh_sigmoid(cell) and tanh_sigmoid(cell, {"tanh": [own]})


def test_no_fused_kernel_refuses_projected_lstm_with_a_reason():
    backend = NoFusedKernel("openvino")
    call = ProjectedLSTMCall(cell=None)
    assert (call.path, call.unroll, call.training) == ("auto", 1, False)
    assert backend.projected_lstm_reason(None) == "no fast path for the openvino backend"
    with pytest.raises(NotImplementedError, match="openvino"):
        backend.run_projected_lstm(None, None, None, call)
    assert backend.resolve_projected_lstm_path("auto") == "auto"
    assert PROJECTED_LSTM_PATHS[0] == "auto" and "off" in PROJECTED_LSTM_PATHS


def test_loss_weights_are_fixed_per_seed_and_shape():
    a = loss_weights([(2, 3), (4,)], seed=1)
    b = loss_weights([(2, 3), (4,)], seed=1)
    assert [w.shape for w in a] == [(2, 3), (4,)] and all(w.dtype == np.float32 for w in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], loss_weights([(2, 3)], seed=2)[0])


def test_cpu_description_names_the_library():
    text = cpu_description("TensorFlow 9.9")
    assert text.startswith("CPU: ") and "TensorFlow 9.9 (no GPU visible)" in text
