"""A call's timing budget (rnnfuse.tuning.budget) on the CPU, with a fake clock.

The device is faked, the candidates' steps are never built, and the clock
the budget reads advances only when the fake timer "times" a candidate (by
its median over the rounds it would run), so every decision here is
deterministic.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, stack_model
from fake_clock import FakeClock
from rnnfuse.tuning import budget, first_batch, tuner
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.clock import using_clock

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}
MEDIANS = {"per-layer": 1.0, "fused": 0.8, "split 2+2": 0.5}
# A first call and 5 rounds a candidate (TensorFlow: no warm-up call).
CALLS = 6


class ClockedTimer:
    """Fixed medians; each candidate timed advances `clock` by its calls."""

    def __init__(self, clock, medians=MEDIANS):
        self.clock, self.medians, self.timed = clock, medians, []

    def __call__(self, steps):
        self.timed.append(sorted(steps))
        for name in steps:
            self.clock.now += CALLS * self.medians.get(name, 5.0)
        return {name: {"median": self.medians.get(name, 5.0)} for name in steps}


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: None for p in plans})


def _fit(fit_steps, tmp_path, name="plans.json"):
    """A fit of `fit_steps` steps (stopped after its first batch) of an
    optimized 4-layer LSTM; (its FusedRNN, the timer, the decision record)."""
    model = stack_model("lstm", 4, units=6, steps=9, last_return_sequences=True)
    clock = FakeClock()
    timer = ClockedTimer(clock)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / name))
    state = fast._rnnfuse_autotune
    state.measure = timer
    state.check_gradients = lambda *args: 1e-6
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 9, 5)).astype("float32")
    y = rng.standard_normal((16, 9, 6)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    stop = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: setattr(fast, "stop_training", True))
    # 16 rows at batch 8: two steps an epoch.
    with using_clock(clock):
        fast.fit(x, y, batch_size=8, epochs=fit_steps // 2, verbose=0, callbacks=[stop])
    (layer,) = fused_layers(fast)
    records = first_batch.decisions(fast)  # none for a cached decision
    return layer, timer, records[0] if records else None


def _timed(timer) -> int:
    return sum(len(names) for names in timer.timed)


def test_a_short_fit_times_less_than_a_long_one(fake_gpu, emulated_cudnn, tmp_path):
    tiny = budget.TuningBudget(steps=1).min_steps(warmup=0, repeats=5)
    assert tiny == math.ceil(2 * CALLS / budget.FIT_SHARE)
    seen = {}
    for steps in (tiny - 2, 800, 100_000):
        layer, timer, record = _fit(steps, tmp_path, f"{steps}.json")
        seen[steps] = (_timed(timer), record["chosen"], record["source"])
    # Too short to pay for timing: nothing timed, the static table's proven plan.
    assert seen[tiny - 2][0] == 0 and seen[tiny - 2][2].startswith("static: a call of")
    # Short: the original layers and the static table's plan, then the budget ends.
    assert seen[800][0] == 2 and seen[800][2] == "measured: within the call's budget"
    # Long: every candidate (the two leading ones again beside the rest).
    assert seen[100_000][0] > seen[800][0] and seen[100_000][1] == "split 2+2"
    assert seen[100_000][2] == "measured"


def test_the_budget_scales_with_the_original_layers_step(fake_gpu, emulated_cudnn, tmp_path):
    # The leading pair cost 6 x (1.0 + 0.8) = 10.8 s; stage one's three
    # candidates are projected at 16.2 s more: 27 s, 3% of 900 steps of
    # the original layers' 1.0 s.
    _, timer, record = _fit(880, tmp_path, "a.json")
    assert _timed(timer) == 2, record
    _, timer, record = _fit(920, tmp_path, "b.json")
    assert _timed(timer) == 5 and record["source"] == "measured", record


def test_a_decision_cut_short_is_not_cached_and_a_full_one_is(fake_gpu, emulated_cudnn, tmp_path):
    _fit(800, tmp_path, "cut.json")
    assert not list(PlanCache(tmp_path / "cut.json").entries())
    _fit(100_000, tmp_path, "full.json")
    assert len(list(PlanCache(tmp_path / "full.json").entries())) == 1
    # A cached decision serves the shortest fit: nothing timed.
    layer, timer, record = _fit(2, tmp_path, "full.json")
    assert _timed(timer) == 0 and record is None and layer.plan.name == "split 2+2"


def test_no_budget_where_the_call_length_is_unknown(fake_gpu, emulated_cudnn, tmp_path):
    model = stack_model("lstm", 4, units=6, steps=9, last_return_sequences=True)
    clock = FakeClock()
    timer = ClockedTimer(clock)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "p.json"))
    state = fast._rnnfuse_autotune
    state.measure, state.check_gradients = timer, lambda *a: 1e-6
    x = np.zeros((8, 9, 5), "float32")
    with using_clock(clock), first_batch.keras_call(fast, x, 8, training=True, steps=None):
        assert state.budget is None
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured" and record["chosen"] == "split 2+2"
    assert budget.call_steps(iter([]), None, epochs=3) is None


@pytest.mark.parametrize(
    "args, want",
    [
        (dict(x=np.zeros((100, 5, 2)), batch_size=8), 13),
        (dict(x=np.zeros((100, 5, 2)), batch_size=None), 4),
        (dict(x=np.zeros((100, 5, 2)), batch_size=8, epochs=3, validation_split=0.2), 30),
        (dict(x=np.zeros((100, 5, 2)), batch_size=8, epochs=10, initial_epoch=8), 26),
        (dict(x=[np.zeros((64, 5, 2)), np.zeros((64, 1))], batch_size=16, epochs=2), 8),
        (dict(x={"a": np.zeros((64, 5, 2))}, batch_size=32), 2),
        (dict(x=np.zeros((100, 5, 2)), batch_size=8, epochs=4, steps=7), 28),
        (dict(x=iter([]), batch_size=8), None),
    ],
)
def test_call_steps(args, want):
    assert budget.call_steps(**args) == want


def test_call_steps_of_a_dataset():
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices(np.zeros((20, 3, 2), "float32")).batch(6)
    assert budget.call_steps(data, None, epochs=2) == 8
    assert budget.call_steps(data.repeat(), None, epochs=2) is None


def test_spend_allows_what_the_projection_fits():
    clock = FakeClock()
    with using_clock(clock):
        spend = budget.TuningBudget(steps=1000).start()
        assert not spend.allows(3, 1.0), "nothing timed yet: nothing to project"
        clock.now, spend.timed = 10.0, 2
        assert spend.allows(4, 1.0)  # 10 + 4 x 5 = 30 <= 3% of 1000 x 1.0
        assert not spend.allows(5, 1.0)
        assert not spend.allows(1, None)
