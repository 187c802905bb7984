"""rnnfuse.passes.rewrite: groups become FusedRNN layers; counted rewrites,
positive and negative; failures recorded, not swallowed; the rewritten
model's graph and inputs.

- sub-models cut from the optimized model's layers work, fused or not
  (captcha_ocr's prediction model);
- a model in which nothing fuses is the original graph: the same layers
  called in the same nodes, so it costs what the original costs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.passes.rewrite import rewrite_model
from rnnfuse.plan import PER_LAYER

from builders import failing_to_build, fused_layers, layers_model, max_abs_diff, stack_model

L = keras.layers


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


def _two_runs(functional: bool):
    layers = [
        L.GRU(4, return_sequences=True, name="g1"),
        L.GRU(4, return_sequences=True, name="g2"),
        L.Dense(5, name="mid"),
        L.LSTM(5, return_sequences=True, name="l1"),
        L.LSTM(5, name="l2"),
    ]
    return layers_model(layers, functional)


@pytest.mark.parametrize("functional", [False, True])
def test_each_group_is_one_rewrite(functional):
    model = _two_runs(functional)
    new, failed = rewrite_model(model, _groups(model))
    assert failed == ()
    assert [[l.name for l in f.fused_layers] for f in fused_layers(new)] == [["g1", "g2"], ["l1", "l2"]]
    x = np.random.default_rng(0).standard_normal((2, 6, 3)).astype("float32")
    assert max_abs_diff(new(x), model(x)) == 0.0


@pytest.mark.parametrize("functional", [False, True])
def test_no_group_is_zero_rewrites(functional):
    model = _two_runs(functional)
    new, failed = rewrite_model(model, [])
    assert fused_layers(new) == [] and failed == ()
    named = lambda m: [l.name for l in m.layers if not isinstance(l, keras.layers.InputLayer)]
    assert named(new) == named(model)


def test_a_run_broken_by_a_rule_is_zero_rewrites():
    model = keras.Sequential(
        [keras.Input((6, 3)), L.LSTM(4, return_sequences=True, name="a"), L.LSTM(8, name="b")]
    )
    groups = plan_fusion(build_layer_graph(model), model_name=model.name, min_layers=2).groups
    assert groups == ()
    assert fused_layers(rnnfuse.optimize(model, min_layers=2)) == []
    # By default each is a group of one, whose static plan on TensorFlow
    # keeps Keras' layer: still zero rewrites.
    assert [g.layers for g in _groups(model)] == [("a",), ("b",)]
    assert fused_layers(rnnfuse.optimize(model)) == []


def test_a_failed_group_is_recorded_in_the_result(monkeypatch):
    failing_to_build(monkeypatch, "g1", ValueError("cannot stack"))
    model = _two_runs(True)
    with pytest.warns(rnnfuse.FusionWarning, match="g1 -> g2"):
        result = rnnfuse.optimize(model, return_result=True)
    (failure,) = result.failed
    assert failure.group.layers == ("g1", "g2")
    assert failure.reason == "ValueError: cannot stack"
    assert len(fused_layers(result.model)) == 1


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
