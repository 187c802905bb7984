"""Plans on a real GPU: the default (static-table) plans against the original
model, and the cuDNN algorithm switch in graph mode.

test_gpu_fused.py pins `plan=rnnfuse.FUSED` to test fusion itself; here the
plans `optimize` picks by default (split, per-layer, persistent algorithm in
float16) are checked against the original, and a persistent-algorithm plan
is checked against a float64 reference.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, random_inputs, stack_model
from rnnfuse.backends import tensorflow as tf_backend


def _grads(model, x, dtype=tf.float32):
    with tf.GradientTape() as tape:
        out = model(x)
        loss = sum(tf.reduce_sum(tf.cast(t, dtype) ** 2) for t in keras.tree.flatten(out))
    return [tf.cast(tf.convert_to_tensor(g), tf.float64) for g in tape.gradient(loss, model.trainable_variables)], out


def _pieces(fast) -> list[int]:
    """The plan the optimized model runs, as piece sizes: a FusedRNN with
    pieces None runs its layers as one call, () per layer, (a, b) split
    (optimize's default tune="auto" keeps one switchable FusedRNN per
    group; tune=False builds one FusedRNN per piece)."""
    out = []
    for f in fused_layers(fast):
        out.extend(list(f.plan.pieces))
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_default_float16_plan_uses_the_persistent_algorithm_and_matches(kind):
    keras.config.set_dtype_policy("mixed_float16")
    model = stack_model(kind, 4, units=64, input_size=32, steps=40, last_return_sequences=True)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model)
    (fused,) = fused_layers(fast)
    assert fused.plan.algorithm == "persistent_static+tc"
    x = tf.constant(random_inputs(model, 16, np.random.default_rng(0)))
    step = tf.function(lambda t: fast(t))
    assert _rel(step(x), model(x)) <= 1e-2
    g_fast, _ = _grads(fast, x)
    g_orig, _ = _grads(model, x)
    assert max(_rel(a, b) for a, b in zip(g_fast, g_orig)) <= 2e-2


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("units, layers", [(512, 4), (512, 2), (64, 3)])
def test_default_float32_plans_match_keras_within_1e5(kind, units, layers):
    model = stack_model(kind, layers, units=units, input_size=32, steps=30, last_return_sequences=True)
    fast = rnnfuse.optimize(model)
    expected = rnnfuse.tuning.table.static_plan(
        rnnfuse.analyze(model).groups[0], "float32", True
    )
    assert _pieces(fast) == list(expected.for_length(layers).pieces)
    assert all(f.plan.algorithm is None for f in fused_layers(fast))
    x = tf.constant(random_inputs(model, 8, np.random.default_rng(1)))
    assert _rel(tf.function(lambda t: fast(t))(x), model(x)) <= 1e-5


@pytest.mark.real_gpu_only  # the CPU emulator has one algorithm
@pytest.mark.cudnn_op  # the algorithm is an attribute of rnnfuse's op only
def test_persistent_algorithm_takes_effect_in_graph_mode_and_stays_accurate():
    """Same stack, default vs persistent kernel (rnnfuse's op, both passes),
    inside tf.function: the results differ (another algorithm really ran)
    yet both are as close to a float64 run as each other, and no
    process-wide variable is set."""
    model = stack_model("lstm", 2, units=128, input_size=32, steps=50, last_return_sequences=True)
    x = tf.constant(random_inputs(model, 8, np.random.default_rng(2)))
    default = rnnfuse.optimize(model, plan=rnnfuse.Plan((2,)))
    persistent = rnnfuse.optimize(model, plan=rnnfuse.Plan((2,), "persistent_static+tc"))
    reference = rnnfuse.FusedRNN(fused_layers(default)[0].fused_layers, dtype="float64")
    ref = reference(tf.cast(x, tf.float64))
    out_default = tf.function(lambda t: default(t))(x)
    out_persistent = tf.function(lambda t: persistent(t))(x)
    assert not np.array_equal(np.asarray(out_default), np.asarray(out_persistent))
    err_default = _rel(out_default, ref)
    err_persistent = _rel(out_persistent, ref)
    print(f"vs float64: default {err_default:.2e}, persistent {err_persistent:.2e}")
    assert err_persistent <= max(4 * err_default, 1e-5)
    assert all(v not in __import__("os").environ for v in ("TF_DEBUG_CUDNN_RNN", "TF_DEBUG_CUDNN_RNN_ALGO"))


def test_mixed_float16_relu_is_as_accurate_as_keras_against_float64():
    """ReLU RNNs in float16 drift from each other (unbounded activations);
    the fused path must be as close to float64 as Keras' own loop is."""
    keras.config.set_dtype_policy("mixed_float16")
    model = stack_model("rnn_relu", 3, units=32, input_size=16, steps=20, last_return_sequences=True)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = tf.constant(random_inputs(model, 8, np.random.default_rng(3)))
    reference = rnnfuse.FusedRNN(fused_layers(fast)[0].fused_layers, dtype="float64")
    with tf.GradientTape() as tape:
        ref_out = reference(tf.cast(x, tf.float64))
        loss = tf.reduce_sum(ref_out**2)
    g_ref = [tf.cast(tf.convert_to_tensor(g), tf.float64) for g in tape.gradient(loss, model.trainable_variables)]
    g_fast, out_fast = _grads(fast, x)
    g_orig, out_orig = _grads(model, x)
    err = lambda gs: max(_rel(a, b) for a, b in zip(gs, g_ref))  # noqa: E731
    print(f"gradient error vs float64: fused {err(g_fast):.2e}, keras {err(g_orig):.2e}")
    assert _rel(out_fast, ref_out) <= 1e-2
    assert err(g_fast) <= max(2 * err(g_orig), 1e-2)
