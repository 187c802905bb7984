"""`fit` and the single-batch entry points plan alike (with optimize's
defaults): a `train_on_batch` is a call of as many steps as the mode's
batch calls so far, so it runs what a `fit` that short runs, and a loop of
them is timed once it could pay for it. The device is faked; a fake
`measure` gives each candidate a fixed median."""

from __future__ import annotations

import keras
import numpy as np

import rnnfuse
from builders import fused_layers, stack_model
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.tuning import first_batch, per_shape, tuner
from rnnfuse.tuning.budget import TuningBudget

MEDIANS = {"per-layer": 3.0, "fused": 2.0, "split 1+1": 1.0}


def _optimized(model):
    fast = rnnfuse.optimize(model, cache=False)
    state = fast._rnnfuse_autotune
    timed = []
    state.measure = lambda steps, on_step=None: (
        timed.append(sorted(steps)) or {n: {"median": MEDIANS.get(n, 5.0)} for n in steps})
    state.check_gradients = lambda *args: 1e-6
    fast.compile(optimizer="sgd", loss="mse")
    return fast, timed


def _data(model, rows=8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, *model.input_shape[1:])).astype("float32")
    y = rng.standard_normal((rows, *model.output_shape[1:])).astype("float32")
    return x, y


def _half_model():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        return stack_model("lstm", 2, units=8, steps=6)
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_short_fit_and_train_on_batch_run_the_same_plan(fake_gpu):
    model = _half_model()
    x, y = _data(model)
    ran = {}
    for entry in ("fit", "train_on_batch", "test_on_batch", "predict_on_batch"):
        fast, timed = _optimized(model)
        (layer,) = fused_layers(fast)
        assert layer.plan == Plan((2,)), "optimize's static plan fuses"
        if entry == "fit":
            fast.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 2 steps
        elif entry == "predict_on_batch":
            fast.predict_on_batch(x[:4])
        else:
            getattr(fast, entry)(x[:4], y[:4])
        assert timed == [], f"{entry} timed a call too short to pay for it"
        ran[entry] = (layer.plan, layer.last_path.kind.name)
    # In half precision the static table's proven plan keeps the original layers.
    assert set(ran.values()) == {(PER_LAYER, "LAYERS")}, ran


def test_a_loop_of_train_on_batch_is_timed_once_it_can_pay_for_it(fake_gpu):
    model = stack_model("lstm", 2, units=8, steps=6)
    fast, timed = _optimized(model)
    state = fast._rnnfuse_autotune
    state.fit_share = 0.5  # a short loop can pay: min_steps calls
    enough = TuningBudget(steps=0, share=0.5).min_steps(tuner.default_warmup("torch"), per_shape.REPEATS)
    (layer,) = fused_layers(fast)
    x, y = _data(model, rows=4)
    for _ in range(enough - 1):
        fast.train_on_batch(x, y)
    assert timed == [] and layer.plan == Plan(()), "float32 on Keras' cuDNN path: the proven plan keeps the original layers"
    (record,) = first_batch.decisions(fast)  # one note for the whole loop
    assert record["source"].startswith("static: a call of 1 steps")
    fast.train_on_batch(x, y)
    assert timed and "split 1+1" in timed[0]
    assert {r.plan.name for r in state.decided.values()} == {"split 1+1"}
    stages = len(timed)
    for _ in range(3):
        fast.train_on_batch(x, y)
    assert len(timed) == stages, "timed once"
    assert layer.last_path.kind.name == "FUSED"


def test_with_no_budget_train_on_batch_times_as_before(fake_gpu):
    model = stack_model("lstm", 2, units=8, steps=6)
    fast, timed = _optimized(model)
    fast._rnnfuse_autotune.fit_share = None
    x, y = _data(model, rows=4)
    fast.train_on_batch(x, y)
    assert len(timed) >= 1 and fast._rnnfuse_autotune.batch_calls == {}
