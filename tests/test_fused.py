"""rnnfuse.fused: FusedRNN's call paths (CallPath records) and its
fallback to the original layers when the backend raises
NotImplementedError (as Keras' Bidirectional falls back)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from rnnfuse import FusedRNN, PathKind

from builders import max_abs_diff


def _pair():
    a = keras.layers.LSTM(4, return_sequences=True, name="a")
    b = keras.layers.LSTM(4, name="b")
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
    expected = b(a(x))
    return a, b, x, expected


def test_without_a_device_the_path_is_a_record_with_the_rule():
    a, b, x, expected = _pair()
    fused = FusedRNN([a, b])
    assert max_abs_diff(fused(x), expected) == 0.0
    path = fused.last_path
    assert path.kind is PathKind.LAYERS and path.reason.rule == "no_device"
    assert str(path) == "layers: the fused kernel needs a CUDA GPU and tensorflow sees none"


def test_the_fused_path_is_the_fused_record(emulated_cudnn):
    a, b, x, expected = _pair()
    fused = FusedRNN([a, b])
    assert max_abs_diff(fused(x), expected) <= 1e-5
    assert fused.last_path.kind is PathKind.FUSED and fused.last_path == "fused"
    assert fused.last_path.kernel.name == "CudnnRNNV3"  # no op loaded here


def test_the_path_is_the_branch_a_masked_call_ran(emulated_cudnn):
    """A left-padded batch runs the original layers (the kernel 0 times) and
    says so; a right-padded one runs the kernel once and says "fused"."""
    a, b, x, _ = _pair()
    fused = FusedRNN([a, b])
    left = np.array([[False, True, True, True, True], [True] * 5])
    assert max_abs_diff(fused(x, mask=left), b(a(x, mask=left), mask=left)) <= 1e-5
    assert not emulated_cudnn, "the kernel ran for a left-padded mask"
    assert fused.last_path.kind is PathKind.LAYERS
    assert fused.last_path.reason.rule == "mask_not_right_padded"
    right = np.array([[True, True, True, False, False], [True] * 5])
    assert max_abs_diff(fused(x, mask=right), b(a(x, mask=right), mask=right)) <= 1e-5
    assert len(emulated_cudnn) == 1 and fused.last_path == "fused"


def test_where_keras_asserts_traced_masks_a_traced_fused_call_asserts_them_too(
        emulated_cudnn, monkeypatch):
    """Where Keras runs its LSTM on cuDNN (TensorFlow with a GPU: stood in
    for here), its traced step fails on a mask that is not right-padded.
    A traced fused call then fails the same way, with Keras' message, and
    traces no branch for other masks; eagerly, both still take the
    generic loop (Keras catches its own assertion there)."""
    import tensorflow as tf

    from rnnfuse.backends.tensorflow.backend import TensorFlowBackend

    monkeypatch.setattr(TensorFlowBackend, "keras_runs_cudnn", lambda self: True)
    generic = []
    real = FusedRNN._call_layers
    monkeypatch.setattr(FusedRNN, "_call_layers",
                        lambda self, *a, **k: generic.append(k) or real(self, *a, **k))
    a, b, x, _ = _pair()
    fused = FusedRNN([a, b])
    step = tf.function(lambda x, m: fused(x, mask=m))
    right = np.array([[True, True, True, False, False], [True] * 5])
    step(x, right)
    assert not generic, "a branch for other masks was traced"
    assert fused.last_path == "fused" and emulated_cudnn
    left = np.array([[False, True, True, True, True], [True] * 5])
    with pytest.raises(tf.errors.InvalidArgumentError, match="right-padded"):
        step(x, left)
    fused(x, mask=left)  # eager
    assert fused.last_path.reason.rule == "mask_not_right_padded" and generic


def test_not_implemented_from_the_backend_runs_the_original_layers(emulated_cudnn, monkeypatch):
    from rnnfuse.backends import tensorflow as tf_backend

    def refuse(*args, **kwargs):
        raise NotImplementedError("not this call")

    monkeypatch.setattr(tf_backend, "run_stack", refuse)
    a, b, x, expected = _pair()
    fused = FusedRNN([a, b])
    assert max_abs_diff(fused(x), expected) == 0.0
    assert fused.last_path.kind is PathKind.LAYERS
    assert fused.last_path.reason.rule == "not_implemented"
    assert "not this call" in fused.last_path
    assert not emulated_cudnn


def test_call_paths_pickle_and_compare_as_strings():
    import pickle

    path = rnnfuse.CallPath(PathKind.LAYERS, rnnfuse.Reason("no_device", "x"))
    again = pickle.loads(pickle.dumps(path))
    assert (again, again.kind, again.reason.rule) == ("layers: x", PathKind.LAYERS, "no_device")
