"""rnnfuse's wavefront kernel as a plan kernel and a tuner candidate for
inference and training (TensorFlow backend), on the CPU.

The op is faked at its lowest level (wavefront_fakes.py):
`op_build.load_wavefront_op` returns `FakeWavefrontOp`, whose
`rnnfuse_wavefront` records each call and computes what the kernel
computes (the emulated cuDNN of
cudnn_reference.py, from the op's own inputs: layer 0's input projection
and the canonical flat buffer) with no gradient of its own, as the real op
has none; the kernel's on-chip plan is `fake_limits` (a stack fits when
layers x units <= LIMIT). The training ops are their TF step-by-step
references (`wavefront_training.reference_forward_saving`,
`recurrence_reference`, recorded in `FakeWavefrontOp.training`), and the
backward's device plan keeps the real rule on the kind (LSTM and GRU). Everything between
`FusedRNN` and the ops is the real code: the plan, the training path, the
packing, the cuDNN gradient recomputed in an inference call's backward
pass, the fallback with its reason, and the tuner's candidate list, timing
(a fake timer), gradient check and cache.
The real kernel is tested on the GPU (tests/gpu/test_gpu_wavefront.py).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, fused_with_plan, max_abs_diff, stack_model, wavefront_inputs, wavefront_mask, wavefront_stack
from fake_clock import FakeTimer
from rnnfuse.backends.cuda import library
from rnnfuse.backends.tensorflow import wavefront_bidirectional, wavefront_op, wavefront_training
from rnnfuse.fused import FusedRNN
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.plan import FUSED, Plan
from rnnfuse.tuning import first_batch, tuner
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.table import static_plan
from rnnfuse.tuning.tuner import KEEP_ORIGINAL_MARGIN, tune_plans
from wavefront_fakes import install

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}
WAVEFRONT = Plan((2,), kernel="wavefront")
# The fake on-chip plan: layers x units above this do not fit.
LIMIT = 48
FP16_TOL = 5e-3


@pytest.fixture
def fake_wavefront(monkeypatch, emulated_cudnn):
    return install(monkeypatch, LIMIT)


# -- the fused call -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("masked", [False, True])
def test_an_inference_call_runs_the_wavefront_op(fake_wavefront, half, kind, masked):
    # (A reversed first layer runs fused without a mask only: rule go_backwards_mask.)
    model = wavefront_stack(kind, go_backwards_first=not masked)
    layer = fused_with_plan(model, WAVEFRONT)
    x = wavefront_inputs()
    mask = wavefront_mask(masked)
    y = layer(x, mask=mask, training=False)
    assert layer.last_path.kind == "fused" and layer.last_path.kernel.name == "RnnfuseWavefront"
    assert layer.last_path.kernel.note is None
    assert len(fake_wavefront.calls) == 1 and fake_wavefront.calls[0]["mode"] == kind
    assert fake_wavefront.calls[0]["lengths"] == (4 if masked else 0)
    from rnnfuse.backends.cuda import library
    assert fake_wavefront.calls[0]["variant"] == library.FORWARD_VARIANT
    layer.set_plan(FUSED)
    want = layer(x, mask=mask, training=False)
    assert layer.last_path.kernel.name == "CudnnRNNV3" and len(fake_wavefront.calls) == 1
    assert max_abs_diff(y, want) <= 1e-3
    layer.set_plan(Plan(()))  # the original layers, with the mask
    assert max_abs_diff(y, layer(x, mask=mask, training=False)) <= FP16_TOL
    if masked:
        assert max_abs_diff(y, model(x)) > 4 * FP16_TOL, "the mask must matter here"


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_training_call_runs_the_training_ops(fake_wavefront, half, kind):
    layer = fused_with_plan(wavefront_stack(kind), WAVEFRONT)
    x = tf.constant(wavefront_inputs())
    with tf.GradientTape() as tape:
        y = layer(x, training=True)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert fake_wavefront.calls == []
    assert fake_wavefront.training == ["forward", "backward", "backward"]
    ran = layer.last_path.kernel
    assert ran.name == wavefront_op.TRAINING_KERNEL_NAME and ran.note is None
    assert ran.algorithm == "backward=layer"  # no op loaded ("auto"), and for a GRU
    assert layer.plan == WAVEFRONT
    assert WAVEFRONT.for_training() == Plan((2,)) and WAVEFRONT.inference_only
    layer.set_plan(FUSED)
    with tf.GradientTape() as tape:
        want_y = layer(x, training=True)
        loss = tf.reduce_sum(tf.cast(want_y, tf.float32) ** 2)
    want = tape.gradient(loss, layer.trainable_variables)
    assert max_abs_diff(y, want_y) <= FP16_TOL
    for g, w in zip(grads, want):
        scale = max(1.0, float(np.max(np.abs(w))))
        assert float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) <= 2 * FP16_TOL * scale
    assert all(float(np.max(np.abs(g))) > 0 for g in grads)


def test_a_shape_the_kernel_refuses_runs_cudnn_with_the_reason(fake_wavefront, half):
    model = wavefront_stack(layers=4, units=16)
    layer = fused_with_plan(model, Plan((4,), kernel="wavefront"))
    x = wavefront_inputs()
    y = layer(x, training=False)
    ran = layer.last_path.kernel
    assert fake_wavefront.calls == [] and ran.name == "CudnnRNNV3"
    assert "4 layers of 16 units do not fit on chip" in ran.note and "cuDNN runs it" in ran.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL


def test_a_float32_stack_runs_cudnn_with_the_reason(fake_wavefront):
    layer = fused_with_plan(wavefront_stack(), WAVEFRONT)
    layer(wavefront_inputs(), training=False)
    assert fake_wavefront.calls == []
    assert "float16 and bfloat16, not float32" in layer.last_path.kernel.note


def test_a_traced_call_of_unknown_batch_runs_cudnn_with_the_reason(fake_wavefront, half):
    layer = fused_with_plan(wavefront_stack(), WAVEFRONT)
    step = tf.function(lambda x: layer(x, training=False),
                       input_signature=[tf.TensorSpec([None, 7, 5], tf.float32)])
    step(wavefront_inputs())
    assert fake_wavefront.calls == []
    assert "static batch" in layer.last_path.kernel.note


def _gradients(layer, x, weights, traced=False):
    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.cast(layer(x, training=False), tf.float32)
            loss = tf.reduce_sum(y * weights)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    fn = tf.function(grads) if traced else grads
    return [np.asarray(g, np.float64) for g in fn(tf.convert_to_tensor(x))]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("traced", [False, True])
def test_gradients_through_an_inference_call_are_cudnns(fake_wavefront, half, kind, traced):
    """The op has no gradient; the call's gradient is cuDNN's, recomputed:
    equal to the cuDNN plan's (same kernel, same inputs) and to the
    original layers' within float16 rounding."""
    model = wavefront_stack(kind)
    layer = fused_with_plan(model, WAVEFRONT)
    x = wavefront_inputs()
    weights = tf.constant(np.random.default_rng(3).standard_normal((4, 7, 8)), tf.float32)
    grads = _gradients(layer, x, weights, traced)
    assert len(fake_wavefront.calls) == 1 and layer.last_path.kernel.name == "RnnfuseWavefront"
    layer.set_plan(FUSED)
    cudnn = _gradients(layer, x, weights, traced)
    for got, want in zip(grads, cudnn):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    layer.set_plan(Plan(()))
    original = _gradients(layer, x, weights)
    for got, want in zip(grads, original):
        assert np.max(np.abs(got - want)) <= FP16_TOL * max(1.0, np.max(np.abs(want)))
    assert any(np.max(np.abs(g)) > 0 for g in grads)


def test_gradients_reach_the_initial_states(fake_wavefront, half):
    model = stack_model("lstm", 2, units=8, input_size=5, steps=7, initial_state=True,
                        last_return_sequences=True)
    layer = fused_with_plan(model, WAVEFRONT)
    x = tf.constant(wavefront_inputs())
    states = [tf.constant(np.random.default_rng(i).standard_normal((4, 8)), tf.float32)
              for i in range(2)]
    grads = {}
    for plan in (WAVEFRONT, FUSED):
        layer.set_plan(plan)
        with tf.GradientTape() as tape:
            tape.watch(states)
            loss = tf.reduce_sum(tf.cast(layer(x, initial_state=states, training=False),
                                         tf.float32) ** 2)
        grads[plan.kernel] = tape.gradient(loss, states)
    assert len(fake_wavefront.calls) == 1
    for got, want in zip(grads["wavefront"], grads["cudnn"]):
        assert got is not None
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# -- the tuner ------------------------------------------------------------------------


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


def _tune(groups, timer, *, training=False, cache=None, shape=(8, 7, 5)):
    return tune_plans(groups, lambda g: shape, training=training, cache=cache, measure=timer,
                      check_gradients=lambda g, p, s, d: 1e-6, environment=ENV, progress=False)


@pytest.fixture
def no_steps(monkeypatch):
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: None for p in plans})


def test_the_wavefront_plan_is_timed_for_inference_and_training(
        fake_wavefront, half, no_steps):
    groups = _groups(wavefront_stack())
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (result,) = _tune(groups, timer)
    assert "fused on wavefront" in timer.names[0]
    assert result.plan == WAVEFRONT and result.timings["fused on wavefront"] == 0.5
    # The kernel's own plan function was asked, with the timed shape.
    assert fake_wavefront.asked == [("lstm", 2, 8, 8, 7, 5)]
    trainer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (trained,) = _tune(groups, trainer, training=True)
    assert "fused on wavefront" in trainer.names[0] and trained.plan == WAVEFRONT
    # A GRU stack is a training candidate too (its per-layer backward).
    gru_trainer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (gru,) = _tune(_groups(wavefront_stack("gru")), gru_trainer, training=True)
    assert "fused on wavefront" in gru_trainer.names[0] and gru.plan == WAVEFRONT


def test_the_wavefront_plan_must_win_by_the_margin(fake_wavefront, half, no_steps):
    close = 1.0 - KEEP_ORIGINAL_MARGIN / 2
    (result,) = _tune(_groups(wavefront_stack()), FakeTimer({"per-layer": 1.0, "fused": 1.5,
                                                    "fused on wavefront": close}))
    assert result.plan.per_layer
    (result,) = _tune(_groups(wavefront_stack()), FakeTimer({"per-layer": 1.0, "fused": 0.7,
                                                    "fused on wavefront": 0.8}))
    assert result.plan == Plan((2,)), "chosen only where it measures faster"


def test_a_group_the_kernel_refuses_is_not_timed_and_says_why(fake_wavefront, half, no_steps,
                                                             monkeypatch):
    timer = FakeTimer({"fused on wavefront": 0.1})
    # Two layers of 32 fit nowhere as one, and each alone (32 <= LIMIT) would,
    # but 2 x 64 units: not even one layer fits, so no segments either.
    (result,) = _tune(_groups(wavefront_stack(layers=2, units=64)), timer)
    assert all("wavefront" not in n for names in timer.names for n in names)
    assert "do not fit on chip" in result.rejected["fused on wavefront"]
    assert "segments" not in result.rejected["fused on wavefront"]
    (f32,) = _tune(_groups(stack_model("lstm", 2, units=8, input_size=5, steps=7,
                                       dtype="float32")), FakeTimer({}))
    assert "float16 and bfloat16" in f32.rejected["fused on wavefront"]
    monkeypatch.setattr(wavefront_bidirectional, "BIDIRECTIONAL", False)
    (bi,) = _tune(_groups(keras.Sequential([
        keras.Input((7, 5)),
        keras.layers.Bidirectional(keras.layers.GRU(8, return_sequences=True)),
        keras.layers.Bidirectional(keras.layers.GRU(8)),
    ])), FakeTimer({}))
    # Switched on: test_wavefront_bidirectional_tf.py.
    assert bi.rejected["fused on wavefront"] == wavefront_bidirectional.BIDIRECTIONAL_OFF


def test_the_decision_is_cached_with_its_kernel(fake_wavefront, half, no_steps, tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    groups = _groups(wavefront_stack())
    _tune(groups, FakeTimer({"per-layer": 2.0, "fused on wavefront": 0.5}), cache=cache)
    (entry,) = json.loads((tmp_path / "plans.json").read_text())["entries"].values()
    assert entry["plan"]["kernel"] == "wavefront"
    timer = FakeTimer({})
    (again,) = _tune(groups, timer, cache=PlanCache(tmp_path / "plans.json"))
    assert again.source == "cache" and again.plan == WAVEFRONT and timer.names == []


def test_a_training_candidate_whose_backward_is_wrong_is_rejected(
        fake_wavefront, half, no_steps, monkeypatch):
    """The tuner's gradient check runs the candidate's training path (the
    training ops), so a wrong backward loses the decision with the reason."""
    def wrong(*args, **kwargs):
        dgates, dh0, dc0 = wavefront_training.recurrence_reference(*args, **kwargs)
        return dgates * 1.5, dh0, dc0

    monkeypatch.setattr(wavefront_training, "backward_layer", wrong)
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    # 2 steps, 4 units: the check traces every step of three gradients (the
    # float64 reference, the candidate, its cuDNN twin) in Python.
    (trained,) = tune_plans(_groups(wavefront_stack(units=4, steps=2)), lambda g: (8, 2, 5),
                            training=True, measure=timer, environment=ENV, progress=False)
    assert trained.plan == Plan((2,))
    assert "gradient error" in trained.rejected["fused on wavefront"]


@pytest.mark.parametrize("training", [False, True])
def test_the_static_table_never_chooses_the_wavefront_kernel_without_a_shape(half, training):
    for layers, units in [(2, 8), (4, 512), (1, 512)]:
        (group,) = _groups(stack_model("lstm", layers, units=units, input_size=5, steps=7))
        assert static_plan(group, "float16", training).kernel == "cudnn"


def _kernel_group(cell="lstm", layers=4, units=512, bidirectional=False, dtype="float16",
                  **fields):
    from rnnfuse.report import FusionGroup

    return FusionGroup(tuple(f"l{i}" for i in range(layers)), cell, units, layers, units,
                       bidirectional, dtype=dtype, **fields)


@pytest.mark.parametrize("training", [False, True])
def test_the_kernel_rule_picks_the_wavefront_kernel_where_it_takes_the_stack(
        monkeypatch, training):
    """In the measured regime, with the whole stack taken, every static
    plan (proven ones included) is the kernel's; a refusal falls through
    to the backend's table."""
    from rnnfuse.backends import tensorflow as tf_backend

    asked = []
    monkeypatch.setattr(tf_backend, "kernel_reason", lambda kernel, group, shape, training=False:
                        asked.append((kernel, shape, training)))
    for cell, dtype in [("lstm", "float16"), ("lstm", "bfloat16")] + (
            [] if training else [("gru", "bfloat16")]):
        group = _kernel_group(cell, dtype=dtype)
        plan = static_plan(group, dtype, training, proven_only=True, shape=(64, 1000, 512))
        assert plan == Plan((4,), kernel="wavefront")
    assert asked[-1] == ("wavefront", (64, 1000, 512), training)
    monkeypatch.setattr(tf_backend, "kernel_reason",
                        lambda *args, **kwargs: "weights do not fit on chip")
    plan = static_plan(_kernel_group(), "float16", training, shape=(64, 1000, 512))
    assert plan.kernel == "cudnn"


@pytest.mark.parametrize("change", [
    dict(layers=2), dict(units=128), dict(units=1024), dict(bidirectional=True),
    dict(dtype="float32"), dict(cell="rnn_tanh"), dict(shape=(16, 1000, 512)), dict(shape=(256, 1000, 512)),
    dict(shape=(64, 100, 512)), dict(shape=(None, 1000, 512)), dict(shape=(64, 1000)),
    dict(shape=()), dict(absorbed_dropout=("dropout",)), dict(proj_size=128),
    dict(cell="gru", training=True),
])
def test_the_kernel_rule_keeps_to_its_measured_regime(monkeypatch, change):
    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.tuning.table import kernel_plan

    monkeypatch.setattr(tf_backend, "kernel_reason", lambda *args, **kwargs: None)
    shape, training = change.pop("shape", (64, 1000, 512)), change.pop("training", True)
    group = _kernel_group(**change)
    assert kernel_plan(group, group.dtype, training, shape) is None
    assert static_plan(group, group.dtype, training, shape=shape).kernel == "cudnn"
    assert kernel_plan(_kernel_group(), "float16", training, (64, 1000, 512)) is not None


def test_a_step_whose_kernel_falls_back_is_not_timed(fake_wavefront, half, monkeypatch):
    """The tuner times the kernel it names: a wavefront step that ran cuDNN
    (a refusal the pre-check did not foresee) is left out with the reason."""
    from rnnfuse.backends import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "kernel_reason", lambda kernel, group, shape, training=False: None)
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.1})
    (result,) = _tune(_groups(wavefront_stack(layers=4, units=16)), timer, shape=(4, 7, 5))
    assert "do not fit on chip" in result.rejected["fused on wavefront"]
    assert "did not run" in result.rejected["fused on wavefront"]
    assert result.plan.kernel == "cudnn"


# -- first-batch tuning -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_predict_and_fit_each_run_their_own_decision(
        fake_wavefront, half, no_steps, monkeypatch, tmp_path, kind):
    """One decision per mode: predict switches the layer to the wavefront
    plan; fit to the training decision, the wavefront plan too (its
    training ops run; the inference op is not called by the train step);
    predict again to the wavefront plan; decisions() and the path record
    what ran."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    model = wavefront_stack(kind, units=8)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    fast._rnnfuse_autotune.measure = FakeTimer({"per-layer": 2.0, "fused": 1.0,
                                                "fused on wavefront": 0.5})
    fast._rnnfuse_autotune.fit_share = None  # a tiny predict times everything
    (layer,) = fused_layers(fast)
    x = wavefront_inputs(batch=8)
    y = fast.predict(x, batch_size=8, verbose=0)
    assert layer.plan == WAVEFRONT and layer.last_path.kernel.name == "RnnfuseWavefront"
    assert len(fake_wavefront.calls) == 1
    assert max_abs_diff(y, model.predict(x, verbose=0)) <= FP16_TOL
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, np.asarray(y, "float32"), batch_size=8, epochs=1, verbose=0)
    assert len(fake_wavefront.calls) == 1
    records = {r["mode"]: r for r in first_batch.decisions(fast)}
    assert layer.plan == WAVEFRONT and records["training"]["chosen"] == "fused on wavefront"
    assert layer.last_path.kernel.name == wavefront_op.TRAINING_KERNEL_NAME
    assert fake_wavefront.training[-3:] == ["forward", "backward", "backward"]
    fast.predict(x, batch_size=8, verbose=0)
    assert layer.plan == WAVEFRONT and len(fake_wavefront.calls) == 2
    records = {r["mode"]: r for r in first_batch.decisions(fast)}
    assert records["inference"]["chosen"] == "fused on wavefront"


# -- stacks larger than the chip: consecutive segments on the kernel ----------------------

SEGMENTS = Plan((2, 2), kernel="wavefront")


def test_segment_plans_are_split_plans_on_the_kernel():
    assert SEGMENTS.name == "split 2+2 on wavefront" and SEGMENTS.inference_only
    assert Plan.from_dict(SEGMENTS.to_dict()) == SEGMENTS
    assert SEGMENTS.to_dict() == {"pieces": [2, 2], "algorithm": None, "kernel": "wavefront"}
    assert SEGMENTS.for_training() == Plan((2, 2))


@pytest.mark.parametrize("masked", [False, True])
def test_a_stack_over_the_limit_runs_as_segments_on_the_wavefront_op(
        fake_wavefront, half, masked):
    """4 x 16 units do not fit (LIMIT 48) as one launch; 2 + 2 do: two
    launches, each over its own layers, the second reading the first's
    output, equal to the same split on cuDNN and to the original layers."""
    model = wavefront_stack(layers=4, units=16)
    layer = fused_with_plan(model, SEGMENTS)
    x = wavefront_inputs()
    mask = wavefront_mask(masked)
    y = layer(x, mask=mask, training=False)
    ran = layer.last_path.kernel
    assert ran.name == "RnnfuseWavefront" and ran.note is None
    assert [(c["steps"], c["batch"], c["lengths"]) for c in fake_wavefront.calls] == [
        (7, 4, 4 if masked else 0)] * 2
    # Each launch was planned for its own two layers: the second reads 16 features.
    assert [a[1:3] + a[5:] for a in fake_wavefront.asked] == [(2, 16, 5), (2, 16, 16)]
    layer.set_plan(Plan((2, 2)))
    assert max_abs_diff(y, layer(x, mask=mask, training=False)) <= 1e-3
    layer.set_plan(Plan(()))
    assert max_abs_diff(y, layer(x, mask=mask, training=False)) <= FP16_TOL


def test_a_training_call_runs_each_segments_training_ops(fake_wavefront, half):
    layer = fused_with_plan(wavefront_stack(layers=4, units=16), SEGMENTS)
    x = tf.constant(wavefront_inputs())
    grads = {}
    for plan in (SEGMENTS, Plan((2, 2))):
        layer.set_plan(plan)
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        grads[plan.kernel] = tape.gradient(loss, layer.trainable_variables)
        if plan is SEGMENTS:
            ran = layer.last_path.kernel
    assert ran.name == wavefront_op.TRAINING_KERNEL_NAME and ran.note is None
    # Both segments' forwards, then the top segment's two layers, then the bottom's.
    assert fake_wavefront.training == ["forward", "forward"] + ["backward"] * 4
    assert fake_wavefront.calls == []
    assert len(grads["wavefront"]) == 12
    for g, w in zip(grads["wavefront"], grads["cudnn"]):
        scale = max(1.0, float(np.max(np.abs(w))))
        assert float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) <= 2 * FP16_TOL * scale
        assert float(np.max(np.abs(g))) > 0


def test_a_segment_the_kernel_refuses_runs_cudnn_and_the_path_says_why(fake_wavefront, half):
    """Split 2+2 of 32 units: each segment (64 > LIMIT) is refused; cuDNN
    runs it, never a wrong answer, and the layer's path carries the note."""
    model = wavefront_stack(layers=4, units=32)
    layer = fused_with_plan(model, SEGMENTS)
    x = wavefront_inputs()
    y = layer(x, training=False)
    ran = layer.last_path.kernel
    assert fake_wavefront.calls == [] and ran.name == "CudnnRNNV3"
    assert "2 layers of 32 units do not fit on chip" in ran.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL


@pytest.mark.parametrize("training", [False, True])
def test_the_tuner_times_segments_where_the_whole_stack_does_not_fit(
        fake_wavefront, half, no_steps, training):
    groups = _groups(wavefront_stack(layers=4, units=16))
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "split 2+2 on wavefront": 0.5})
    (result,) = _tune(groups, timer, training=training)
    # Timed in the first stage beside the whole run on cuDNN (no whole run on
    # the kernel to wait for), and chosen: it measured faster.
    assert "split 2+2 on wavefront" in timer.names[0]
    assert all("fused on wavefront" not in n for names in timer.names for n in names)
    assert result.plan == SEGMENTS and result.timings["split 2+2 on wavefront"] == 0.5
    why = result.rejected["fused on wavefront"]
    assert "4 layers of 16 units do not fit on chip" in why
    assert "timed as segments that each fit instead: split 2+2 on wavefront" in why
    (slower,) = _tune(groups, FakeTimer({"per-layer": 2.0, "fused": 1.0,
                                         "split 2+2 on wavefront": 1.2}), training=training)
    assert slower.plan == Plan((4,)), "chosen only where it measures faster"


def test_the_tuner_picks_the_fewest_balanced_segments(fake_wavefront, half, no_steps):
    """6 x 8 units: 48 fits (LIMIT) and 7 layers would not, so a 7-layer
    stack runs as 4 + 3: the fewest segments, the largest as small as can be."""
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0})
    (result,) = _tune(_groups(wavefront_stack(layers=7, units=8)), timer)
    assert "split 4+3 on wavefront" in timer.names[0]
    assert "split 4+3 on wavefront" in result.rejected["fused on wavefront"]


def test_a_segmented_decision_is_cached_and_rewritten_as_its_segments(
        fake_wavefront, half, no_steps, tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    groups = _groups(wavefront_stack(layers=4, units=16))
    _tune(groups, FakeTimer({"per-layer": 2.0, "split 2+2 on wavefront": 0.5}), cache=cache)
    (entry,) = json.loads((tmp_path / "plans.json").read_text())["entries"].values()
    assert entry["plan"] == SEGMENTS.to_dict()
    (again,) = _tune(groups, FakeTimer({}), cache=PlanCache(tmp_path / "plans.json"))
    assert again.source == "cache" and again.plan == SEGMENTS
    from rnnfuse.tuning.plans import split_groups

    assert [(len(g.layers), p.name) for g, p in split_groups(groups, [SEGMENTS])] == [
        (2, "fused on wavefront")] * 2


def test_a_traced_training_step_runs_each_segments_training_ops(fake_wavefront, half):
    """What `fit` traces: both segments' saving forwards and all four layers'
    backwards in one graph, gradients equal to the eager call's."""
    layer = fused_with_plan(wavefront_stack(layers=4, units=16), SEGMENTS)
    x = tf.constant(wavefront_inputs())

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x, training=True), tf.float32) ** 2)
        return tape.gradient(loss, layer.trainable_variables)

    traced = tf.function(step)(x)
    assert fake_wavefront.training == ["forward", "forward"] + ["backward"] * 4
    assert layer.last_path.kernel.name == wavefront_op.TRAINING_KERNEL_NAME
    for got, want in zip(traced, step(x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
