"""Per-shape decisions (rnnfuse/tuning/per_shape.py) on the CPU.

The device is faked (an environment naming a GPU), the timer is a fake
whose medians depend on the batch size it is timed at, and the fused kernel
is rnnfuse's op emulated (`emulated_op`: it records each call's algorithm
input), so these tests pin which plan runs at which shape: a new bucket is
timed, not carried; a custom loop's trace gets a timed plan; a plan never
switches mid-epoch; a persistent algorithm never runs untimed.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, max_abs_diff, stack_model
from rnnfuse.plan import Algorithm
from rnnfuse.tuning import first_batch, per_shape, tuner
from rnnfuse.tuning.cache import PlanCache
from timed_optimize import timed_optimize

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow", "rnnfuse": "0.1.0"}
PERSISTENT = "fused @persistent_dynamic+tc"
# Few steps: the emulated op and the traced steps unroll every one; no
# decision here depends on the length.
STEPS = 3


class ShapeTimer:
    """Medians per candidate name for each timed batch size (the steps it
    gets are the shapes the fake `_steps` built them for)."""

    def __init__(self, by_batch):
        self.by_batch, self.calls = by_batch, []

    def __call__(self, steps):
        shape = next(iter(steps.values()))
        self.calls.append((shape, sorted(steps)))
        medians = self.by_batch[shape[0]]
        return {name: {"median": medians.get(name, 10.0)} for name in steps}


@pytest.fixture
def timed(monkeypatch, emulated_op, tmp_path):
    """(optimize(model) with a fake GPU and ShapeTimer, the op's recorded
    algorithm per call)."""
    return timed_optimize(monkeypatch, emulated_op, tmp_path, ENV, ShapeTimer)


def _model():
    return stack_model("lstm", 2, units=6, steps=STEPS, input_size=5, last_return_sequences=True)


def _xy(model, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, STEPS, 5)).astype("float32")
    return x, np.asarray(model.predict(x, verbose=0))


def _custom_train_step(model):
    """A user's own training step: a tf.function with a GradientTape."""
    variables = model.trainable_variables

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        return tape.gradient(loss, variables)

    return train_step


# Persistent wins at batch 8 and loses at 32 (as persistent_dynamic did for
# 8x LSTM(128): 4.18 ms a layer at 32, 13.38 at 128).
MEDIANS = {
    8: {"per-layer": 3.0, "fused": 2.0, PERSISTENT: 1.0, "fused @persistent_static+tc": 2.5},
    32: {"per-layer": 3.0, "fused": 2.0, PERSISTENT: 6.0, "fused @persistent_static+tc": 7.0},
}


def test_predict_at_a_new_batch_bucket_is_timed_not_carried(timed):
    make, algorithms = timed
    model = _model()
    fast, timer = make(model, MEDIANS)
    x, _ = _xy(model, 64)
    fast.predict(x, batch_size=8, verbose=0)
    assert algorithms()[-1] == "persistent_dynamic"
    out = fast.predict(x, batch_size=32, verbose=0)
    assert [shape[0] for shape, _ in timer.calls] == [8, 32]
    # At 32 only what was in contention at 8 (within 1.5x of its best), the
    # chosen plan's standard twin and the original layers are timed.
    assert timer.calls[1][1] == sorted(["per-layer", PERSISTENT, "fused"])
    assert algorithms()[-1] == "standard", "the persistent plan was carried to batch 32"
    assert max_abs_diff(out, model.predict(x, verbose=0)) <= 2e-5


def test_a_plan_is_never_switched_mid_epoch(timed):
    make, algorithms = timed
    model = _model()
    fast, timer = make(model, MEDIANS)
    x, y = _xy(model, 20)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=2, verbose=0)  # batches of 8, 8 and 4
    assert len(timer.calls) == 1, "timed again during the call"
    (layer,) = fused_layers(fast)
    assert layer.plan.name == PERSISTENT
    # Keras' TensorFlow step is traced once for every batch of the call
    # (the partial one too, its batch size left open): the call's plan.
    assert algorithms() == ["persistent_dynamic"]
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["input"] == [8, STEPS, 5]


def test_a_custom_loop_trace_gets_a_plan_timed_for_its_shape(timed):
    make, algorithms = timed
    model = _model()
    fast, timer = make(model, MEDIANS)
    x, _ = _xy(model, 8)
    train_step = _custom_train_step(fast)
    infer = tf.function(lambda x: fast(x, training=False))
    train_step(x)
    assert len(timer.calls) == 1 and algorithms() == ["persistent_dynamic"]
    out = infer(x)
    assert len(timer.calls) == 2, "inference is its own decision"
    infer(x)
    assert len(timer.calls) == 2, "a decided shape is not timed again"
    assert max_abs_diff(out, model(x)) <= 2e-5
    big = np.concatenate([x] * 4)
    infer(big)
    assert [shape[0] for shape, _ in timer.calls] == [8, 8, 32]
    assert algorithms()[-1] == "standard"
    records = first_batch.decisions(fast)
    assert [(r["mode"], r["bucket"][0]) for r in records] == [("training", 8), ("inference", 8), ("inference", 32)]


def test_a_custom_loop_after_fit_is_timed_apart_where_fit_timed_the_original_with_xla(timed):
    """`fit` times the original layers XLA-compiled (Keras compiles the
    original model so under jit_compile="auto"); a user's own tf.function
    runs them without XLA, so the same shape there is its own decision, and
    it can choose otherwise. (On the CPU Keras' LSTM supports XLA; on a
    GPU, where it runs cuDNN, only SimpleRNN stacks do.)"""
    make, algorithms = timed
    model = _model()
    by_batch = {8: dict(MEDIANS[8])}
    fast, timer = make(model, by_batch)
    x, y = _xy(model, 8)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(timer.calls) == 1
    (fit_record,) = first_batch.decisions(fast)
    assert fit_record["xla_baseline"] is True and fit_record["chosen"] == PERSISTENT
    # Without XLA the original layers win at this shape.
    by_batch[8] = {**MEDIANS[8], "per-layer": 0.5}
    train_step = _custom_train_step(fast)
    train_step(x)
    assert len(timer.calls) == 2, "the fit decision was carried to the custom loop"
    loop_record = first_batch.decisions(fast)[-1]
    assert loop_record["xla_baseline"] is False and loop_record["chosen"] == "per-layer"
    (layer,) = fused_layers(fast)
    assert layer.last_path.reason.rule == "plan_per_layer"
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(timer.calls) == 2, "fit's own decision is kept for fit"
    assert algorithms()[-1] == "persistent_dynamic"


def test_a_trace_whose_batch_is_open_runs_the_static_table_without_timing(timed):
    make, algorithms = timed
    model = _model()
    fast, timer = make(model, MEDIANS)
    x, _ = _xy(model, 8)
    fast.predict(x, batch_size=8, verbose=0)  # persistent_dynamic at 8
    spec = tf.TensorSpec((None, STEPS, 5), tf.float32)
    out = tf.function(lambda t: fast(t, training=False), input_signature=[spec])(x)
    assert len(timer.calls) == 1, "an open batch cannot be timed"
    # The table keeps a float32 2x6 LSTM's layers (fused lost there).
    (layer,) = fused_layers(fast)
    assert layer.last_path.reason.rule == "plan_per_layer"
    assert max_abs_diff(out, model(x)) <= 2e-5


def test_untimed_drops_only_a_cudnn_algorithm():
    assert per_shape.untimed(rnnfuse.Plan((1, 1), "persistent_static+tc")) == rnnfuse.Plan((1, 1))
    assert per_shape.untimed(rnnfuse.PER_LAYER) == rnnfuse.PER_LAYER
    # rnnfuse's wavefront kernel wins only at some shapes (batch 32 and up).
    assert per_shape.untimed(rnnfuse.Plan((2,), kernel="wavefront")) == rnnfuse.Plan((2,))
    assert per_shape.bucket_of(1, 1) == (1, 1) and per_shape.bucket_of(90, 1000) == (64, 1024)


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")


def _recorded_decisions():
    for path in sorted(glob.glob(os.path.join(RESULTS, "user_view_*_h200*.json"))):
        with open(path) as f:
            data = json.load(f)
        for row in data.get("results", []) if isinstance(data, dict) else []:
            for decision in row.get("decisions", []):
                if len(decision.get("timings_ms", {})) > 1 and decision.get("source") == "measured":
                    yield os.path.basename(path), decision


def test_on_the_recorded_matrix_racing_and_contention_keep_every_choice():
    """Every decision the user-view matrix recorded (full timing):
    the chosen plan was within RACE of the best median, so the race's early
    stop would not have dropped it, and within CONTENTION, so a new bucket
    after it times it again."""
    decisions = list(_recorded_decisions())
    assert len(decisions) > 50
    for name, d in decisions:
        times = d["timings_ms"]
        best = min(times.values())
        chosen = times[d["chosen"]]
        assert chosen <= tuner.RACE * best, (name, d["layers"], d["chosen"], times)
        assert chosen <= per_shape.CONTENTION * best


def test_contenders_are_the_close_candidates_the_choice_its_twin_and_the_original():
    import types

    group = types.SimpleNamespace(layers=("a", "b", "c", "d"), absorbed_dropout=())
    result = types.SimpleNamespace(
        plan=rnnfuse.Plan((2, 2), "persistent_static+tc"),
        timings={"per-layer": 9.0, "fused": 1.4, "split 2+2 @persistent_static+tc": 1.0, "split 2+2": 2.0},
    )
    names = [p.name for p in per_shape.contenders(result, group, "tensorflow")]
    assert names == ["per-layer", "split 2+2 @persistent_static+tc", "split 2+2", "fused"]
    assert Algorithm.parse("persistent_static+tc").algo == 1


def test_timing_from_inside_a_custom_loop_trace_runs_real_steps_and_leaves_the_losses_alone(
    monkeypatch, emulated_op, tmp_path
):
    """The tuner's real steps (tf.functions of their own, run eagerly from
    inside the user's trace through Backend.timing_context) time the
    candidates; the loss the caller's trace collects is its own model's."""
    import keras

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    inp = keras.Input((5, 3))
    h = keras.layers.LSTM(4, return_sequences=True)(inp)
    out = keras.layers.LSTM(4, activity_regularizer="l2")(h)
    model = keras.Model(inp, out)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    fast._rnnfuse_autotune.environment = dict(ENV)
    x = np.random.default_rng(3).standard_normal((4, 5, 3)).astype("float32")

    @tf.function
    def step(t):
        y = fast(t, training=False)
        return y, tf.add_n(fast.losses)

    got, loss = step(x)
    want = model(x, training=False)
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured" and len(record["timings_ms"]) >= 2
    assert max_abs_diff(got, want) <= 2e-5
    assert len(fast.losses) == len(model.losses) == 1
    assert abs(float(loss) - float(model.losses[0])) <= 1e-5


def test_timing_from_inside_a_custom_training_loop_trace_times_training_steps(
    monkeypatch, emulated_op, tmp_path
):
    """A user's GradientTape step (training=True, an outer tape recording):
    the tuner's training steps, run from inside that trace, take their own
    gradients (they once came back None here), and
    the caller's gradients are the original model's."""
    import keras

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    model = stack_model("lstm", 2, units=6, steps=STEPS, input_size=5, last_return_sequences=False)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    fast._rnnfuse_autotune.environment = dict(ENV)
    x = np.random.default_rng(4).standard_normal((4, STEPS, 5)).astype("float32")

    def step_of(m):
        @tf.function
        def step(t):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(m(t, training=True)))
            return loss, tape.gradient(loss, m.trainable_variables)

        return step

    got_loss, got = step_of(fast)(x)
    want_loss, want = step_of(model)(x)
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["source"] == "measured", record
    assert len(record["timings_ms"]) >= 2, record
    assert abs(float(got_loss) - float(want_loss)) <= 1e-4
    assert all(g is not None for g in got)
    assert max(max_abs_diff(g, w) for g, w in zip(got, want)) <= 1e-4


@pytest.fixture
def made_steps(monkeypatch):
    """(model, step function name, jit_compile) for every Keras step
    function made from here on."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    made = []
    for name in ("make_train_function", "make_predict_function"):
        keras_make = getattr(TensorFlowTrainer, name)

        def spy(self, force=False, keras_make=keras_make, name=name):
            if getattr(self, name.replace("make_", ""), None) is None or force:
                made.append((self, name, bool(self.jit_compile)))
            return keras_make(self, force)

        monkeypatch.setattr(TensorFlowTrainer, name, spy)
    return made


# Training at batch 8: fused wins; inference at 32: the original layers.
TRAIN_FUSED_PREDICT_PER_LAYER = {
    8: {"per-layer": 5.0, "fused": 1.0},
    32: {"per-layer": 1.0, "fused": 5.0},
}


def _trained_fused(timed):
    """(a SimpleRNN stack, its optimized model after one fused fit epoch, x)."""
    make, _ = timed
    model = stack_model("rnn_tanh", 2, units=6, steps=STEPS, input_size=5)
    fast, _ = make(model, TRAIN_FUSED_PREDICT_PER_LAYER)
    x, y = _xy(model, 64)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model, fast, x


def test_each_modes_step_is_xla_compiled_where_its_plans_keep_the_original_layers(
    timed, made_steps
):
    """A SimpleRNN stack Keras would XLA-compile: trained fused, predicted
    per layer. The predict step is made with jit_compile=True (as the tuner
    timed the original layers), the train step without; predict under XLA
    gives the original's outputs. A predict step that lost XLA with the
    train plan ran 0.11x."""
    model, fast, x = _trained_fused(timed)
    out = fast.predict(x, batch_size=32, verbose=0)
    assert [r["chosen"] for r in first_batch.decisions(fast)] == ["fused", "per-layer"]
    mine = [(name, jit) for m, name, jit in made_steps if m is fast]
    assert mine == [("make_train_function", False), ("make_predict_function", True)], mine
    assert fast.jit_compile is False, "the model's own jit_compile is left as Keras set it"
    assert max_abs_diff(out, model.predict(x, batch_size=32, verbose=0)) <= 2e-5


def test_a_step_whose_plan_is_decided_at_its_trace_is_not_xla_compiled(timed, made_steps):
    """predict from a generator: the first batch cannot be read ahead, so
    the fused layer decides when the step is traced, and may fuse; the step
    is made as Keras would make it for the fused model (no XLA)."""
    model, fast, x = _trained_fused(timed)
    fast.predict(x, batch_size=32, verbose=0)  # inference decided: the original layers

    def batches():
        for i in range(0, 64, 32):
            yield (x[i:i + 32],)

    out = fast.predict(batches(), verbose=0)
    mine = [(name, jit) for m, name, jit in made_steps if m is fast]
    assert mine[-1] == ("make_predict_function", False), mine
    assert max_abs_diff(out, model.predict(x, batch_size=32, verbose=0)) <= 2e-5
