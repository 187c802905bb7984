"""Every entry point of one model runs the plan decided for its group, mode
and bucket (TensorFlow on the CPU).

The device is faked, the timer is a fake and the fused kernel is rnnfuse's
op emulated (`emulated_op`: it records each call's algorithm), so these
tests pin which plan a user's own training loop runs after `fit` decided:
the decided one, looked up, not timed again, wherever its original layers
run on the path `fit` timed them on (XLA-compiled or not).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import race_online, stack_model
from rnnfuse.tuning import first_batch, tuner
from timed_optimize import timed_optimize

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}
PERSISTENT = "fused @persistent_dynamic+tc"
MEDIANS = {"per-layer": 3.0, "fused": 2.0, PERSISTENT: 1.0, "fused @persistent_static+tc": 2.5}


class Timer:
    """Fixed medians per candidate name; counts its timings."""

    def __init__(self, medians):
        self.medians, self.calls = medians, 0

    def __call__(self, steps):
        self.calls += 1
        return {name: {"median": self.medians.get(name, 10.0)} for name in steps}


@pytest.fixture
def timed(monkeypatch, emulated_op, tmp_path):
    """optimize(model) with a fake GPU and a fake timer."""
    return timed_optimize(monkeypatch, emulated_op, tmp_path, ENV, Timer)


def _model(cudnn_on_gpu: bool):
    model = stack_model("lstm", 2, units=6, steps=7, input_size=5, last_return_sequences=True)
    if cudnn_on_gpu:
        # As Keras sets it where its LSTM can run cuDNN: the original model is
        # then not XLA-compiled, so `fit` times its layers without XLA.
        for layer in model.layers:
            layer.supports_jit = False
    return model


def _xy(n=8):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 7, 5)).astype("float32"),
            rng.standard_normal((n, 7, 6)).astype("float32"))


def _custom_step(model, jit_compile=False):
    """A user's own training step: a GradientTape around a direct call."""
    variables = model.trainable_variables

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        return tape.gradient(loss, variables)

    return tf.function(step, jit_compile=jit_compile)


def test_after_fit_decides_a_custom_loop_runs_the_decided_plan_untimed(timed, plans_run):
    make, algorithms = timed
    model = _model(cudnn_on_gpu=True)
    fast, timer = make(model, MEDIANS)
    x, y = _xy()
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["xla_baseline"] is False and record["chosen"] == PERSISTENT
    assert timer.calls == 1
    plans_run.clear()
    del algorithms()[:]
    # A traced custom step, the same step eagerly, and train_on_batch.
    _custom_step(fast)(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(fast(x, training=True) ** 2)
    assert all(g is not None for g in tape.gradient(loss, fast.trainable_variables))
    fast.train_on_batch(x, y)
    assert timer.calls == 1, "fit's decision was timed again"
    assert len(first_batch.decisions(fast)) == 1
    assert plans_run and set(plans_run) == {PERSISTENT}
    assert set(algorithms()) == {"persistent_dynamic"}


def test_inference_entry_points_share_the_inference_decision(timed, plans_run):
    make, algorithms = timed
    model = _model(cudnn_on_gpu=True)
    fast, timer = make(model, {**MEDIANS, "per-layer": 0.5})
    x, y = _xy()
    fast.compile(optimizer="sgd", loss="mse")
    fast.predict(x, batch_size=8, verbose=0)
    assert timer.calls == 1
    plans_run.clear()
    fast.predict_on_batch(x)
    fast.evaluate(x, y, batch_size=8, verbose=0)
    tf.function(lambda t: fast(t, training=False))(x)
    fast(x, training=False)
    assert timer.calls == 1 and len(first_batch.decisions(fast)) == 1
    # The decision keeps the original layers: each call runs theirs.
    assert plans_run and set(plans_run) <= {"original", "per-layer"}


def test_an_xla_compiled_custom_loop_reuses_what_an_xla_compiled_fit_decided(timed, plans_run):
    """On the CPU Keras XLA-compiles an LSTM model's `fit` (jit_compile="auto"),
    so `fit` times the original layers XLA-compiled; a user's step under
    jit_compile=True runs them so too: the same baseline, the same decision."""
    make, _ = timed
    model = _model(cudnn_on_gpu=False)
    fast, timer = make(model, {**MEDIANS, "per-layer": 0.5})
    x, y = _xy()
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["xla_baseline"] is True and record["chosen"] == "per-layer"
    plans_run.clear()
    _custom_step(fast, jit_compile=True)(x)
    assert timer.calls == 1 and len(first_batch.decisions(fast)) == 1
    # Found decided (untimed) as keeping the original layers: their own call.
    assert plans_run == ["original"]


def test_after_an_online_race_a_custom_loop_runs_the_committed_plan(
    monkeypatch, emulated_cudnn, plans_run
):
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))

    def no_offline_timing(*args, **kwargs):
        raise AssertionError("timed apart from the fit")

    monkeypatch.setattr(tuner, "_steps", no_offline_timing)
    model = stack_model("lstm", 4, units=6, steps=9, last_return_sequences=True)
    for layer in model.layers:
        layer.supports_jit = False  # Keras' LSTM where cuDNN can run
    fast = rnnfuse.optimize(model, cache=False)
    ran = []
    state = race_online(fast, {"per-layer": 3.0, "fused": 2.0, "split 2+2": 1.0}, ran)
    state.environment = dict(ENV)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 9, 5)).astype("float32")
    y = rng.standard_normal((16, 9, 6)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=2, epochs=3, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["chosen"] == "split 2+2" and record["xla_baseline"] is False
    raced = list(ran)
    plans_run.clear()
    _custom_step(fast)(x[:2])
    fast(x[:2], training=True)
    assert ran == raced and len(first_batch.decisions(fast)) == 1
    assert plans_run and set(plans_run) == {"split 2+2"}
