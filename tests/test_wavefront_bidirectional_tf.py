"""Bidirectional stacks on rnnfuse's wavefront ops under TensorFlow
(rnnfuse/backends/tensorflow/wavefront_bidirectional.py), on the CPU: the
ops faked as in test_wavefront_wiring.py (wavefront_fakes.py: the emulated
cuDNN in the inference op's place, the TF step-by-step references in the
training ops', a fake on-chip limit). Everything else is the real code:
one-layer calls a direction, direction 1 reversed within each row's length
(`tf.reverse_sequence`), the packing (merges below the top included), the
states' order, the switch (off as it ships; turned on here) and the
fallbacks; compared with cuDNN's bidirectional equations in float64
(tests/cudnn_reference.py) and with Keras' own Bidirectional layers. The
real kernel: tests/gpu/test_gpu_wavefront_bidirectional_tf.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

import rnnfuse
from builders import (bidirectional_stack, fused_layers, max_abs_diff, wavefront_inputs,
                      wavefront_mask)
from cudnn_reference import cudnn_rnn
from fake_clock import FakeTimer
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.base import StackCall, StackSpec
from rnnfuse.backends.tensorflow import wavefront_bidirectional as bidir
from rnnfuse.backends.tensorflow import wavefront_op
from rnnfuse.plan import FUSED, Plan
from rnnfuse.tuning import tuner
from rnnfuse.tuning.tuner import tune_plans
from wavefront_fakes import install

LIMIT = 48  # the fake on-chip plan: layers x units above this do not fit
FP16_TOL = 5e-3
ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}


@pytest.fixture
def faked(monkeypatch, emulated_cudnn):
    """The fake ops, the switch as it ships (off)."""
    return install(monkeypatch, LIMIT)


@pytest.fixture
def enabled(monkeypatch, faked):
    """The fake ops with the switch on."""
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    return faked


def test_the_switch_ships_on_and_its_reason_names_it():
    assert bidir.BIDIRECTIONAL is True
    assert "wavefront_bidirectional.BIDIRECTIONAL" in bidir.BIDIRECTIONAL_OFF


# -- the composition against cuDNN's bidirectional equations ---------------------------------


@pytest.mark.parametrize("lengths", [None, [5, 4, 2, 1]])
def test_reversal_within_lengths_is_its_own_inverse_and_keeps_the_padding(lengths):
    x = tf.reshape(tf.range(5 * 4 * 2, dtype=tf.float32), [5, 4, 2])
    lens = None if lengths is None else tf.constant(lengths, tf.int32)
    once = bidir.reverse_within_lengths(x, lens).numpy()
    np.testing.assert_array_equal(bidir.reverse_within_lengths(once, lens), x)
    for b, n in enumerate(lengths or [5] * 4):
        np.testing.assert_array_equal(once[:n, b], x.numpy()[:n, b][::-1])
        np.testing.assert_array_equal(once[n:, b], x.numpy()[n:, b])


def _pieces(kind, layers, units, inputs, rng):
    """Per pseudo layer [w_ih, w_hh, b_ih, b_hh] (flat, float64)."""
    gh = (4 if kind == "lstm" else 3) * units
    out = []
    for k in range(2 * layers):
        n = inputs if k < 2 else 2 * units
        out.append([tf.constant(rng.standard_normal(s) * scale, tf.float64)
                    for s, scale in [(gh * n, 0.4), (gh * units, 0.4), (gh, 0.2), (gh, 0.2)]])
    return out


def _compare(kind, layers, ragged, training=True):
    """(composed, reference) each as ((y, hy, cy), gradients of x, every
    piece, h0 and c0): float64, direction by direction against cuDNN's
    bidirectional equations."""
    rng = np.random.default_rng(0)
    units, inputs, batch, steps = 4, 3, 4, 6
    lengths = tf.constant([6, 5, 2, 1], tf.int32) if ragged else None
    pieces = _pieces(kind, layers, units, inputs, rng)
    x = tf.constant(rng.standard_normal((steps, batch, inputs)))
    h0 = tf.constant(rng.standard_normal((2 * layers, batch, units)) * 0.3)
    c0 = tf.constant(rng.standard_normal((2 * layers, batch, units)) * 0.3)
    c0 = c0 if kind == "lstm" else None
    shapes = [(steps, batch, 2 * units), (2 * layers, batch, units), (2 * layers, batch, units)]
    weights = [tf.constant(rng.standard_normal(s)) for s in shapes]
    lens = tf.fill([batch], steps) if lengths is None else lengths
    alive = tf.cast(tf.range(steps)[:, None] < lens[None, :], tf.float64)[..., None]

    def composed(x, pieces, h0, c0):
        return bidir.forward(x, [tf.concat(p, 0) for p in pieces], h0, c0, lengths, kind=kind,
                             training=training)

    def reference(x, pieces, h0, c0):
        flat = tf.concat([a for p in pieces for a in p[:2]] + [a for p in pieces for a in p[2:]],
                         0)
        return cudnn_rnn(tnp, x, h0, c0, flat, lens, kind, True)

    out = []
    for fn in (composed, reference):
        leaves = [x, pieces, h0] + ([c0] if c0 is not None else [])
        with tf.GradientTape() as tape:
            tape.watch(tf.nest.flatten(leaves))
            y, hy, cy = fn(x, pieces, h0, c0)
            y = y * alive  # past each length: zeros on the kernel, not in the reference's
            loss = sum(tf.reduce_sum(t * w) for t, w in zip((y, hy, cy), weights)
                       if t is not None)
        out.append(((y, hy, cy), tape.gradient(loss, leaves)))
    return out


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("layers,ragged", [(1, True), (3, True), (1, False)])
def test_the_composition_is_cudnns_bidirectional_stack(faked, kind, layers, ragged):
    """Float64 through the training ops' references: outputs, final states
    (layer-major, forward first) and the tape's gradients of x, every
    weight and the initial states; one saving forward and one backward
    recurrence a direction of each layer."""
    (got, grads), (want, ref) = _compare(kind, layers, ragged)
    for name, g, w in zip(["y", "hy", "cy"], got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)
    for g, w in zip(tf.nest.flatten(grads), tf.nest.flatten(ref)):
        assert g is not None
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)
    assert faked.training == ["forward"] * (2 * layers) + ["backward"] * (2 * layers)
    assert faked.calls == []


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_inference_runs_the_inference_op_a_direction(faked, kind):
    """The inference op once a direction of each layer (the layer's input
    width: 3, then 2H), outputs and states those of cuDNN's equations."""
    (got, _), (want, _) = _compare(kind, 2, True, training=False)
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert [c["input_size"] for c in faked.calls] == [3, 3, 8, 8]
    assert all(c["lengths"] == 4 for c in faked.calls) and faked.training == []


def test_the_comparison_fails_where_direction_1_is_not_reversed(faked, monkeypatch):
    """The tests above can fail: direction 1 run forward in time breaks them."""
    monkeypatch.setattr(bidir, "reverse_within_lengths", lambda t, lengths: t)
    (got, _), (want, _) = _compare("lstm", 1, True)
    assert float(tf.reduce_max(tf.abs(got[0] - want[0]))) > 1e-2


def test_clear_errors():
    z = tf.zeros([3, 2, 4], tf.float16)
    with pytest.raises(ValueError, match="received 3"):
        bidir.forward(z, [tf.reshape(z, [-1])] * 3, z, z, None, kind="lstm")
    cells = (keras.layers.LSTMCell(4), keras.layers.LSTMCell(4))
    for cell in cells:
        cell.build((None, 3))
    with pytest.raises(NotImplementedError, match="reads reversed"):
        bidir.run_stack(z[..., :3], StackCall(StackSpec("lstm", 4, (cells,)), reverse=True))


# -- the backend: Keras' Bidirectional layers, the switch, the tuner --------------------------


def _fused(model, layers):
    plan = Plan((layers,), kernel="wavefront")
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False, plan=lambda g: plan))
    return layer


def _outputs_and_grads(layer, x, weights, training=True, **kwargs):
    with tf.GradientTape() as tape:
        y = layer(x, training=training, **kwargs)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
    grads = tape.gradient(loss, layer.trainable_variables)
    return y, [np.asarray(g, np.float64) for g in grads]


def _keras_case(kind, merge_mode, layers, masked, initial):
    """(the fused layer on the plan, x, weights, call kwargs)."""
    layer = _fused(bidirectional_stack(kind, merge_mode, layers, initial_state=initial), layers)
    kwargs = {}
    if masked:
        kwargs["mask"] = tf.constant(wavefront_mask())
    if initial:
        rng = np.random.default_rng(5)
        kwargs["initial_state"] = [tf.constant(rng.standard_normal((4, 8)) * 0.5, tf.float32)
                                   for _ in range(4 if kind == "lstm" else 2)]
    width = 16 if merge_mode == "concat" else 8
    weights = tf.constant(np.random.default_rng(3).standard_normal((4, 7, width)), tf.float32)
    return layer, tf.constant(wavefront_inputs()), weights, kwargs


def _assert_near(got, want):
    (y, grads), (want_y, want_grads) = got, want
    assert max_abs_diff(y, want_y) <= FP16_TOL
    for g, w in zip(grads, want_grads):
        assert np.max(np.abs(g - w)) <= 2 * FP16_TOL * max(1.0, np.max(np.abs(w)))
    assert all(np.max(np.abs(g)) > 0 for g in grads)


@pytest.mark.parametrize("kind,merge_mode,layers,masked,initial", [
    ("lstm", "concat", 1, False, False), ("gru", "concat", 3, True, False),
    ("lstm", "sum", 3, True, True), ("gru", "ave", 2, False, True),
    ("lstm", "ave", 2, True, False), ("gru", "sum", 1, True, True)])
def test_a_training_call_on_the_plan_matches_keras_bidirectional_layers(
        enabled, half, kind, merge_mode, layers, masked, initial):
    """Training: the saving forward and backward a direction of each layer,
    outputs and every variable's gradient Keras' layers' within float16."""
    layer, x, weights, kwargs = _keras_case(kind, merge_mode, layers, masked, initial)
    got = _outputs_and_grads(layer, x, weights, **kwargs)
    ran = layer.last_path.kernel
    assert layer.last_path.kind == "fused" and ran.name == wavefront_op.TRAINING_KERNEL_NAME
    assert ran.note is None and ran.algorithm == f"{bidir.ALGORITHM}, backward=layer"
    assert enabled.training == ["forward"] * (2 * layers) + ["backward"] * (2 * layers)
    assert enabled.calls == []
    layer.set_plan(Plan(()))  # Keras' own layers
    _assert_near(got, _outputs_and_grads(layer, x, weights, **kwargs))


def test_an_inference_call_runs_the_op_a_direction_with_cudnns_gradient(enabled, half):
    """training=False: the inference op a direction, a mask as lengths; a
    tape around it gets cuDNN's gradient (recomputed), the cuDNN plan's."""
    layer, x, weights, kwargs = _keras_case("gru", "concat", 1, True, False)
    got = _outputs_and_grads(layer, x, weights, training=False, **kwargs)
    ran = layer.last_path.kernel
    assert (ran.name, ran.algorithm, ran.note) == (wavefront_op.KERNEL_NAME, bidir.ALGORITHM,
                                                   None)
    assert [(c["input_size"], c["lengths"]) for c in enabled.calls] == [(5, 4)] * 2
    assert enabled.training == []
    layer.set_plan(FUSED)
    cudnn = _outputs_and_grads(layer, x, weights, training=False, **kwargs)
    assert layer.last_path.kernel.name == "CudnnRNNV3"
    assert max_abs_diff(got[0], cudnn[0]) <= 1e-3
    for g, w in zip(got[1], cudnn[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert all(np.max(np.abs(g)) > 0 for g in got[1])


def test_while_the_switch_is_off_cudnn_runs_with_the_reason(faked, half, monkeypatch):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", False)
    model = bidirectional_stack()
    layer = _fused(model, 2)
    x = wavefront_inputs()
    y = layer(x, training=False)
    ran = layer.last_path.kernel
    assert faked.calls == [] and ran.name == "CudnnRNNV3"
    assert "wavefront_bidirectional.BIDIRECTIONAL" in ran.note and "cuDNN runs it" in ran.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL


def test_a_layer_the_kernel_refuses_runs_cudnn_with_the_reason(enabled, half):
    model = bidirectional_stack(layers=1, units=64)
    layer = _fused(model, 1)
    x = wavefront_inputs()
    y = layer(x, training=True)
    ran = layer.last_path.kernel
    assert enabled.calls == enabled.training == [] and ran.name == "CudnnRNNV3"
    assert "1 layers of 64 units do not fit on chip" in ran.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL


def test_the_tuner_is_offered_the_plan_only_with_the_switch_on(faked, half, monkeypatch):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", False)
    (group,) = rnnfuse.analyze(bidirectional_stack()).groups
    assert bidir.BIDIRECTIONAL_OFF == tf_backend.kernel_reason("wavefront", group, (4, 7, 5))
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    assert tf_backend.kernel_reason("wavefront", group, (4, 7, 5), training=True) is None
    assert sorted(faked.asked) == [("lstm", 1, 8, 4, 7, 5), ("lstm", 1, 8, 4, 7, 16)]
    (wide,) = rnnfuse.analyze(bidirectional_stack(units=64)).groups
    assert tf_backend.kernel_reason("wavefront", wide, (4, 7, 5)) == \
        "1 layers of 64 units do not fit on chip"
    keras.config.set_dtype_policy("float32")
    (group32,) = rnnfuse.analyze(bidirectional_stack()).groups
    assert "not float32" in tf_backend.kernel_reason("wavefront", group32, (4, 7, 5))


@pytest.mark.parametrize("training", [False, True])
def test_the_tuner_times_the_plan_with_the_switch_on(faked, half, monkeypatch, training):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", False)
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: None
                                                                        for p in plans})
    groups = rnnfuse.analyze(bidirectional_stack("gru")).groups

    def tune():
        timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
        (result,) = tune_plans(groups, lambda g: (8, 7, 5), training=training, measure=timer,
                               check_gradients=lambda g, p, s, d: 1e-6, environment=ENV,
                               progress=False)
        return result, [n for names in timer.names for n in names]

    off, timed = tune()
    assert off.rejected["fused on wavefront"] == bidir.BIDIRECTIONAL_OFF
    assert "fused on wavefront" not in timed and off.plan.kernel == "cudnn"
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    on, timed = tune()
    assert "fused on wavefront" in timed
    assert on.plan == Plan((2,), kernel="wavefront") and on.timings["fused on wavefront"] == 0.5


def test_tune_times_the_plan_with_the_switch_on(enabled, half):
    """`optimize(model, tune=...)`'s timing: the plan's candidate is a real
    traced training step on the composition, kept after its gradient check."""
    from rnnfuse.api import choose_plans

    model = bidirectional_stack()
    (result,) = choose_plans(model, rnnfuse.analyze(model).groups,
                             tune=rnnfuse.TuneShape(4, 7), cache=False)
    assert result.source == "measured"
    assert "fused on wavefront" in result.timings, result
    assert {"forward", "backward"} <= set(enabled.training)
