"""The rewritten model (rnnfuse/passes/rewrite.py): its graph and inputs.

- sub-models cut from the optimized model's layers work, fused or not
  (captcha_ocr's prediction model);
- a model in which nothing fuses is the original graph: the same layers
  called in the same nodes, so it costs what the original costs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from builders import fused_layers, max_abs_diff, stack_model

import rnnfuse
from rnnfuse.tuning.plans import PER_LAYER

L = keras.layers


def _ocr_like(fuse: bool) -> keras.Model:
    """captcha_ocr's shape: image -> dense -> two BiLSTMs (or one) -> dense2."""
    image = keras.Input((12, 6), name="image")
    label = keras.Input((12,), name="label")
    x = L.Dense(8, name="dense1")(image)
    x = L.Bidirectional(L.LSTM(4, return_sequences=True), name="bi1")(x)
    if fuse:
        x = L.Bidirectional(L.LSTM(4, return_sequences=True), name="bi2")(x)
    x = L.Dense(5, name="dense2")(x)
    loss = L.Add(name="ctc")([L.Dense(1)(x)[..., 0], label])
    return keras.Model([image, label], loss)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "nothing_fused"])
def test_a_sub_model_of_the_optimized_model_layers_builds_and_matches(fuse):
    model = _ocr_like(fuse)
    fast = rnnfuse.optimize(model)
    assert bool(fused_layers(fast)) == fuse
    prediction = keras.Model(fast.get_layer("image").output, fast.get_layer("dense2").output)
    reference = keras.Model(model.get_layer("image").output, model.get_layer("dense2").output)
    x = np.random.default_rng(0).standard_normal((2, 12, 6)).astype("float32")
    assert max_abs_diff(prediction(x), reference(x)) == 0.0
    # The inputs keep their names and are the original ones.
    assert [t.name for t in fast.inputs] == [t.name for t in model.inputs]


def test_a_sub_model_of_an_optimized_sequential_builds():
    model = stack_model("gru", 2, head=True, functional=False)
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast)
    sub = keras.Model(fast.inputs[0], fast.get_layer("head").output)
    x = np.random.default_rng(1).standard_normal((2, 7, 5)).astype("float32")
    assert max_abs_diff(sub(x), model(x)) == 0.0


def _graph_ops(model, x) -> list[str]:
    """The op types of `model`'s traced training forward pass (TensorFlow)."""
    import tensorflow as tf

    fn = tf.function(lambda t: model(t, training=True))
    graph = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    return sorted(op.type for op in graph.get_operations())


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "sequential"])
def test_a_model_with_nothing_fused_is_the_original_graph(functional):
    if keras.backend.backend() != "tensorflow":
        pytest.skip("counts TensorFlow graph ops")
    model = stack_model("gru", 3, units=8, head=True, functional=functional)
    fast = rnnfuse.optimize(model, plan=PER_LAYER)
    assert not fused_layers(fast) and fast is not model
    assert fast.layers == model.layers
    if functional:
        # The very same nodes: no layer is called again, nothing is added.
        assert [id(t) for t in fast.outputs] == [id(t) for t in model.outputs]
        assert [id(t) for t in fast.inputs] == [id(t) for t in model.inputs]
    x = np.random.default_rng(2).standard_normal((4, 7, 5)).astype("float32")
    assert _graph_ops(fast, x) == _graph_ops(model, x)
    np.testing.assert_array_equal(fast(x), model(x))
