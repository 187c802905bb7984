"""`optimize(model)` on a faked GPU with a fake timer, for the tuning tests
that run TensorFlow's emulated op (`emulated_op` records each call)."""

from __future__ import annotations

import tensorflow as tf

import rnnfuse
from rnnfuse.backends.tensorflow import cudnn_op
from rnnfuse.tuning import first_batch, tuner
from rnnfuse.tuning.cache import PlanCache


def timed_optimize(monkeypatch, emulated_op, tmp_path, env: dict, make_timer):
    """(make, algorithms): `make(model, medians)` optimizes `model` with the
    device `env`, the timer `make_timer(medians)`, a passing gradient check
    and no tuning budget, and returns (fast, timer); `algorithms()` lists the
    algorithm of each op call so far."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(env))
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, shape, *a, **k: {p.name: shape for p in plans})

    def make(model, medians):
        fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
        state = fast._rnnfuse_autotune
        state.environment = dict(env)
        state.measure = make_timer(medians)
        state.check_gradients = lambda group, plan, shape, dtype: 1e-6
        state.fit_share = None  # tiny fits time everything (the budget: test_budget.py)
        return fast, state.measure

    def algorithms():
        return [cudnn_op.decode_algorithm_code(tf.get_static_value(c["algorithm"]))[0] for c in emulated_op]

    return make, algorithms
