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


def test_first_fit_times_cudnns_algorithms_and_runs_the_fastest(fake_gpu, emulated_core,
                                                               tmp_path):
    model = stack_model("gru", 4, units=6, steps=9, last_return_sequences=True)
    timer = FakeTimer({"per-layer": 3.0, "fused": 2.0, "split 2+2": 2.5,
                       "fused @persistent_static+tc": 1.0})
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    state = fast._rnnfuse_autotune
    state.measure = timer
    state.check_gradients = lambda g, p, shape, dtype: 1e-6
    state.fit_share = None  # tiny fits time everything (the budget: test_budget.py)
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


def test_without_a_device_to_time_on_jax_keeps_the_layers():
    model = stack_model("lstm", 3)
    assert fused_layers(rnnfuse.optimize(model)) == []
