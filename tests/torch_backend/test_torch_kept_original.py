"""A group whose plan keeps the original layers costs what they cost.

Under torch every step runs eagerly, so whatever an optimized model does
around a kept-original group (its FusedRNN's Keras call, the planner's
lookups, the fused path's checks) is paid on every step. These tests pin
that such a call runs the original layers' own calls (spied) and none of
the wrapper's work, with the device faked and a fake clock choosing the
plans.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from builders import bidirectional_stack, fused_layers, max_abs_diff, spy_on, stack_model
from rnnfuse.fused import FusedRNN
from rnnfuse.tuning import per_shape
from torch_checks import FAKE_GPU_ENV, torch_ops


def _fake_clock(medians):
    """A `measure` that gives each candidate its fixed median (seconds)."""
    return lambda steps, on_step=None: {n: {"median": medians.get(n, 5.0)} for n in steps}


def _optimized(model, medians):
    fast = rnnfuse.optimize(model, cache=False)
    state = fast._rnnfuse_autotune
    state.environment = dict(FAKE_GPU_ENV)
    state.measure = _fake_clock(medians)
    state.check_gradients = lambda *args: 1e-6
    state.fit_share = None  # tiny fits time everything (the budget: test_budget.py)
    return fast


class _Spies:
    """Counts the original layers' `call`s and the wrapper's work."""

    def __init__(self, monkeypatch, layers):
        self.layer_calls = []
        self.wrapper = []
        for layer in layers:
            spy_on(monkeypatch, layer, "call", self.layer_calls, layer.name)
        for name in ("call", "_run", "_plan_for_call"):
            spy_on(monkeypatch, FusedRNN, name, self.wrapper)
        spy_on(monkeypatch, per_shape.Planner, "__call__", self.wrapper, "Planner.__call__")


def _data(model, n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *model.input_shape[1:])).astype("float32")
    return x, np.asarray(model.predict(x, verbose=0))


def _kept_and_fit(model):
    """(fast, x, y): `model` optimized on a clock where the original layers
    are faster, compiled and fit one epoch on `_data`."""
    fast = _optimized(model, {"per-layer": 1.0, "fused": 5.0})
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
    return fast, x, y


def test_a_kept_original_group_runs_the_original_calls_and_no_wrapper_work(fake_gpu, monkeypatch):
    model = stack_model("gru", 3, steps=6)
    fast, x, y = _kept_and_fit(model)
    fast.predict(x, batch_size=4, verbose=0)
    (layer,) = fused_layers(fast)
    assert all(r.plan.per_layer for r in fast._rnnfuse_autotune.decided.values())
    spies = _Spies(monkeypatch, layer.fused_layers)
    # Every entry point a torch user steps through, eagerly.
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
    fast.train_on_batch(x[:4], y[:4])
    fast.test_on_batch(x[:4], y[:4])
    out = fast.predict_on_batch(x[:4])
    fast.predict(x, batch_size=4, verbose=0)
    fast(x[:4], training=True)
    assert spies.wrapper == [], "the wrapper did work for a kept-original group"
    # 2 + 1 + 1 + 1 + 2 + 1 calls of each of the 3 layers.
    assert len(spies.layer_calls) == 8 * 3
    assert spies.layer_calls[:3] == ["gru_0", "gru_1", "gru_2"]
    assert "layers" in layer.last_path
    assert max_abs_diff(out, model.predict_on_batch(x[:4])) == 0.0


def _mixed_float16(build):
    """`build()` under mixed_float16 (the policy reset before the model is optimized)."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        return build()
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("build", [
    lambda: stack_model("gru", 3, steps=6),
    lambda: bidirectional_stack("lstm", layers=3, steps=6),
    # compile() gives both models a LossScaleOptimizer (the same ops a step).
    lambda: _mixed_float16(lambda: bidirectional_stack("lstm", layers=2, steps=6)),
], ids=["gru", "bidirectional_lstm", "bidirectional_lstm_mixed_float16"])
def test_a_kept_original_group_dispatches_the_original_modelstorch_ops(fake_gpu, build):
    model = build()
    fast, x, y = _kept_and_fit(model)
    fast.predict(x, batch_size=4, verbose=0)
    model.compile(optimizer="sgd", loss="mse")
    xb, yb = x[:4], y[:4]
    entry_points = {"train_on_batch": lambda m: m.train_on_batch(xb, yb),
                    "test_on_batch": lambda m: m.test_on_batch(xb, yb),
                    "predict_on_batch": lambda m: m.predict_on_batch(xb),
                    "fit": lambda m: m.fit(x, y, batch_size=4, epochs=1, verbose=0)}
    for name, run in entry_points.items():
        for m in (model, fast):
            run(m)  # warm: Keras makes each mode's step on its first call
        original, optimized = torch_ops(lambda: run(model)), torch_ops(lambda: run(fast))
        assert sum(original.values()) > 50, name
        assert optimized == original, f"{name}: {optimized - original} more, {original - optimized} fewer"


def test_a_mode_decided_fused_or_not_yet_decided_goes_through_the_wrapper(fake_gpu, monkeypatch):
    # Training keeps the original layers; inference is not decided before
    # the first predict, which must time it (through the planner).
    model = stack_model("lstm", 2, steps=5)
    fast, x, y = _kept_and_fit(model)
    (layer,) = fused_layers(fast)
    spies = _Spies(monkeypatch, layer.fused_layers)
    fast.train_on_batch(x[:4], y[:4])
    assert spies.wrapper == []
    fast._rnnfuse_autotune.measure = _fake_clock({"per-layer": 5.0, "fused": 1.0})
    fast.predict_on_batch(x[:4])  # a new mode, timed on its first call
    assert "Planner.__call__" in spies.wrapper
    assert any(not r.plan.per_layer for r in fast._rnnfuse_autotune.decided.values())
    spies.wrapper.clear()
    fast.predict_on_batch(x[:4])
    assert "call" in spies.wrapper and "fused" in layer.last_path
    # A batch of a bucket not decided yet asks the planner too.
    spies.wrapper.clear()
    fast.train_on_batch(np.concatenate([x] * 4), np.concatenate([y] * 4))
    assert "Planner.__call__" in spies.wrapper


def test_a_fused_layer_on_the_original_layers_plan_skips_its_own_call(monkeypatch):
    # (`optimize(plan=PER_LAYER)` leaves such a run unwrapped; a FusedRNN
    # built or loaded with that plan runs the layers the same way.)
    a = keras.layers.GRU(4, return_sequences=True, name="a")
    b = keras.layers.GRU(4, name="b")
    x = np.random.default_rng(0).standard_normal((3, 6, 5)).astype("float32")
    want = b(a(x))
    layer = FusedRNN([a, b], plan=rnnfuse.PER_LAYER)
    spies = _Spies(monkeypatch, [a, b])
    out = layer(x)
    assert spies.wrapper == [] and spies.layer_calls == ["a", "b"]
    assert max_abs_diff(out, want) == 0.0


@pytest.mark.parametrize("options", [dict(masked=True), dict(initial_state=True)])
def test_the_original_call_passes_masks_and_initial_states_as_the_model_did(
    fake_gpu, monkeypatch, options
):
    model = stack_model("lstm", 2, steps=6, **options)
    rng = np.random.default_rng(3)
    if options.get("masked"):
        x = rng.integers(1, 11, size=(4, 6))
        x[1:, 4:] = 0  # right padding
    else:
        x = [rng.standard_normal((4, 6, 5)).astype("float32"),
             rng.standard_normal((4, 6)).astype("float32"),
             rng.standard_normal((4, 6)).astype("float32")]
    fast = _optimized(model, {"per-layer": 1.0, "fused": 5.0})
    fast.compile(optimizer="sgd", loss="mse")
    y = np.asarray(model.predict(x, verbose=0))
    fast.fit(x, y, batch_size=4, verbose=0)
    fast.predict(x, batch_size=4, verbose=0)
    (layer,) = fused_layers(fast)
    spies = _Spies(monkeypatch, layer.fused_layers)
    for training in (False, True):
        got = fast(x, training=training)
        assert spies.wrapper == [] and len(spies.layer_calls) == 2
        # (The original model runs the same layer objects.)
        assert max_abs_diff(got, model(x, training=training)) == 0.0
        spies.layer_calls.clear()


def test_a_symbolic_call_keeps_the_fused_layers_node():
    a = keras.layers.GRU(4, return_sequences=True)
    b = keras.layers.GRU(4)
    a.build((None, 6, 5))
    b.build((None, 6, 4))
    layer = FusedRNN([a, b], plan=rnnfuse.PER_LAYER)
    inputs = keras.Input((6, 5))
    outputs = layer(inputs)
    rebuilt = keras.Model(inputs, outputs)
    assert layer in rebuilt.layers
