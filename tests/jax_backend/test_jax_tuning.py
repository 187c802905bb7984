"""Measured plans under JAX (first-batch tuning, `tune=`) on the CPU.

The device is faked (an environment that names a GPU), the timer is a
deterministic fake, and the cuDNN core is its emulation, so these tests
pin which candidates JAX times (cuDNN's algorithms, whole, split, the
original layers) and that the chosen plan is what Keras' jitted steps run.
"""

from __future__ import annotations

import numpy as np
import pytest

import fake_clock
import rnnfuse
from builders import fused_layers, random_inputs, stack_model
from rnnfuse.tuning import first_batch, tuner
from rnnfuse.tuning.cache import PlanCache

ENV = {"device": "FakeGPU", "jax": "0", "backend": "jax", "rnnfuse": "0.1.0"}


class FakeTimer(fake_clock.FakeTimer):
    default = 10.0


@pytest.fixture
def fake_gpu(monkeypatch, emulated_core):
    """A device to 'time' on; steps are never built (the timer is fake)."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    built = []

    def steps(group, plans, shape, dtype, training, jit_baseline=False, masked=False):
        built.append({"shape": shape, "plans": [p.name for p in plans]})
        return {p.name: None for p in plans}

    monkeypatch.setattr(tuner, "_steps", steps)
    return built


def _timed(model, timer, tmp_path):
    """optimize(model) timed by `timer`, the gradient check passing, no budget."""
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    state = fast._rnnfuse_autotune
    state.measure = timer
    state.check_gradients = lambda g, p, shape, dtype: 1e-6
    state.fit_share = None  # tiny fits time everything (the budget: test_budget.py)
    return fast


def test_first_fit_times_cudnns_algorithms_and_runs_the_fastest(fake_gpu, emulated_core,
                                                               tmp_path):
    model = stack_model("gru", 4, units=6, steps=9, last_return_sequences=True)
    timer = FakeTimer({"per-layer": 3.0, "fused": 2.0, "split 2+2": 2.5,
                       "fused @persistent_static+tc": 1.0})
    fast = _timed(model, timer, tmp_path)
    (layer,) = fused_layers(fast)
    rng = np.random.default_rng(0)
    x = random_inputs(model, 16, rng)
    y = np.asarray(model.predict(x, verbose=0))
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    timed = set().union(*map(set, timer.names))
    assert {"per-layer", "fused", "fused @persistent_static+tc",
            "fused @persistent_dynamic+tc"} <= timed, timed
    assert any(name.startswith("split 2+2") for name in timed), timed  # a split, in a stage
    assert fake_gpu[0]["shape"] == (8, 9, 5), "timed on the first batch's shape"
    assert layer.plan == rnnfuse.Plan((4,), "persistent_static+tc")
    ran = layer.last_path.kernel
    assert ran.name == "rnnfuse cuDNN core (XLA FFI)" and ran.algorithm == "persistent_static+tc"
    # The fit's jitted step ran the algorithm in both passes (4 * 1 + tensor ops).
    assert {a["algorithm"] for t, a in emulated_core.calls if "training" in t} == {5}
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["input"] == [8, 9, 5]


def test_without_a_device_to_time_on_jax_the_static_table_decides():
    """A small float32 stack is planned fused (here, without a GPU, its
    layers still run Keras' call); a large one keeps Keras' layers."""
    small, large = stack_model("lstm", 3), stack_model("lstm", 3, units=512)
    (layer,) = fused_layers(rnnfuse.optimize(small))
    assert layer.plan == rnnfuse.FUSED.for_length(3)
    assert fused_layers(rnnfuse.optimize(large)) == []


def test_a_custom_jitted_loop_runs_its_modes_decision_not_the_last_one_set(
        fake_gpu, emulated_core, tmp_path, monkeypatch):
    """`predict` after `fit` sets the layer's own plan to the inference
    decision; a user's own jitted training step (`stateless_call` under
    `jax.grad`) still runs the training decision, looked up, untimed."""
    import jax
    import jax.numpy as jnp

    from rnnfuse.fused import FusedRNN

    ran = []
    real_run = FusedRNN._run

    def run(self, plan, *args, **kwargs):
        if self.planner is not None:  # the model's layer, not a split plan's piece
            ran.append(plan.name)
        return real_run(self, plan, *args, **kwargs)

    monkeypatch.setattr(FusedRNN, "_run", run)
    model = stack_model("gru", 4, units=6, steps=9, last_return_sequences=True)
    timer = FakeTimer({"per-layer": 3.0, "fused": 2.0, "split 2+2": 1.0})
    fast = _timed(model, timer, tmp_path)
    (layer,) = fused_layers(fast)
    x = random_inputs(model, 8, np.random.default_rng(0))
    y = np.asarray(model.predict(x, verbose=0))
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    timer.medians = {"per-layer": 3.0, "fused": 1.0, "split 2+2": 2.0}
    fast.predict(x, batch_size=8, verbose=0)
    chosen = {r["mode"]: r["chosen"] for r in first_batch.decisions(fast)}
    assert chosen["training"].startswith("split 2+2") and chosen["inference"].startswith("fused")
    assert layer.plan.name == chosen["inference"]
    timings, ran[:] = timer.calls, []
    trainable = [v.value for v in fast.trainable_variables]
    others = [v.value for v in fast.non_trainable_variables]

    @jax.jit
    def grads(trainable, x):
        def loss(trainable):
            out, _ = fast.stateless_call(trainable, others, x, training=True)
            return jnp.mean(out ** 2)
        return jax.grad(loss)(trainable)

    grads(trainable, jnp.asarray(x))
    assert ran == [chosen["training"]]
    assert timer.calls == timings and len(first_batch.decisions(fast)) == 2
