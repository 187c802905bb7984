"""Half-precision LSTMs whose Keras path fails on a JAX GPU run fused.

On a GPU, Keras' JAX LSTM (and Bidirectional(LSTM)) calls jaxlib's cuDNN
RNN, whose lowering takes float32 and float64 only: a mixed_float16 or
mixed_bfloat16 model's step fails to compile. rnnfuse's planner fuses such
a group without timing (`Backend.keras_path_fails`), and the tuner never
times, or rejects with a reason, the original layers there.

"A GPU is visible" is faked twice: to Keras' check (`keras_sees_gpu`) and,
through the `emulated_core` fixture, to rnnfuse's core, whose FFI targets
run as their jax.numpy emulation. The compile failure itself is faked by an
original-layers step raising what jaxlib raises.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import fake_clock
import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, stack_model
from rnnfuse.backends.jax import keras_paths
from rnnfuse.cli.output import group_records
from rnnfuse.cli.render import _runs_here
from rnnfuse.reasons import PathKind
from rnnfuse.tuning import first_batch, tuner

L = keras.layers
ENV = {"device": "FakeGPU", "jax": "0", "backend": "jax", "rnnfuse": "0.1.0"}
HALF_TOLERANCE = {"mixed_float16": 2e-3, "mixed_bfloat16": 2e-2}
REASON = "Keras' cuDNN LSTM on JAX fails in"


@pytest.fixture
def keras_sees_gpu(monkeypatch, emulated_core):
    """Keras' own layers would take jaxlib's cuDNN RNN (a GPU is visible),
    and rnnfuse's core runs (emulated)."""
    monkeypatch.setattr(keras_paths, "keras_sees_gpu", lambda: True)
    return emulated_core


def _bidirectional_lstm(policy, units=6, steps=7, features=5):
    inp = keras.Input((steps, features))
    x = L.Bidirectional(L.LSTM(units, return_sequences=True, dtype=policy), dtype=policy)(inp)
    x = L.Bidirectional(L.LSTM(units, dtype=policy), dtype=policy)(x)
    return keras.Model(inp, x)


def _model(kind, policy):
    if kind == "bidirectional lstm":
        return _bidirectional_lstm(policy)
    return stack_model(kind, 3, dtype=policy)


def _plans(model, **kwargs):
    return rnnfuse.optimize(model, return_result=True, **kwargs).plans


def _fused(plan) -> bool:
    """The whole run as one call (a plan's length spelled or not)."""
    return plan.name == "fused"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["lstm", "bidirectional lstm"])
def test_half_precision_lstm_is_fused_untimed_with_the_reason(kind, policy, keras_sees_gpu):
    model = _model(kind, policy)
    dtype = policy.removeprefix("mixed_")
    (result,) = _plans(model, tune=False)
    assert _fused(result.plan)
    assert result.source.startswith(f"static: {REASON} {dtype}"), result.source
    assert "rnnfuse's cuDNN core" in result.source
    # inspect's record and text line say how it runs and why.
    (record,) = group_records([result])
    assert record["runs"]["fused"] and record["plan"]["source"] == result.source
    assert f"{REASON} {dtype}" in _runs_here(record)
    # What runs: the core, in the compute dtype, as Keras' own loop computes.
    fast = rnnfuse.optimize(model, tune=False)
    x = random_inputs(model, 3, np.random.default_rng(4))
    assert max_abs_diff(fast(x), model(x)) < HALF_TOLERANCE[policy]
    (layer,) = fused_layers(fast)
    assert layer.last_path.kind is PathKind.FUSED
    assert keras_sees_gpu.stacks[-1]["bidirectional"] == (kind == "bidirectional lstm")
    assert {s[1] for s in keras_sees_gpu.sizes} == {dtype}


@pytest.mark.parametrize("case, fused", [
    ("float32", True), ("masked", False), ("gru", True), ("bidirectional gru", True),
    ("float32 bidirectional gru", False), ("float32 gru", True), ("float32 wide gru", False),
    ("no gpu", False)])
def test_where_keras_runs_its_own_layers_jaxs_static_table_decides(case, fused, keras_sees_gpu,
                                                                    monkeypatch):
    """Where Keras' own layers run (a float32 LSTM on jaxlib's cuDNN, a
    masked one in Keras' loop, a GRU as a lax.scan, half precision where
    Keras sees no GPU) the static plan is JAX's table's (`JAX_RULES`): a small
    float32 stack and a GRU fused, a masked stack, a float32 bidirectional
    one, a float32 GRU of over 128 units and a half-precision LSTM kept."""
    policy = None if case.startswith("float32") else "mixed_float16"
    if case == "no gpu":
        monkeypatch.setattr(keras_paths, "keras_sees_gpu", lambda: False)
    if case == "masked":
        model = stack_model("lstm", 3, masked=True, dtype=policy)
    elif case.endswith("bidirectional gru"):
        inp = keras.Input((7, 5))
        model = keras.Model(inp, L.Bidirectional(L.GRU(6, dtype=policy), dtype=policy)(inp))
    else:
        model = stack_model("gru" if case.endswith("gru") else "lstm", 3,
                            units=160 if "wide" in case else 6, dtype=policy)
    results = _plans(model, tune=False)
    want = rnnfuse.FUSED if fused else rnnfuse.PER_LAYER
    assert results and all(r.plan.for_length(1) == want.for_length(1) and r.source == "static"
                           for r in results), results
    assert bool(fused_layers(rnnfuse.optimize(model, tune=False))) == fused


@pytest.mark.parametrize("units, batch, plan, algo", [
    (160, 4, "fused @persistent_static+tc", 1), (160, 128, "fused", 0), (6, 4, "fused", 3)])
def test_a_fit_too_short_to_time_runs_fused_and_trains(units, batch, plan, algo, keras_sees_gpu,
                                                       monkeypatch, tmp_path):
    """`optimize(model)` defaults on a GPU (first-batch tuning): a one-step
    fit cannot pay for timing, so the static plan runs it, fused; nothing is
    timed and the fit's jitted step runs the core. Its algorithm: cuDNN's
    persistent one in float16 at a batch of at most 64, else the core's own
    choice (standard; small-h for a small state)."""
    from rnnfuse.tuning.cache import PlanCache

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    model = stack_model("lstm", 3, units=units, dtype="mixed_float16", head=True)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    timer = fake_clock.FakeTimer({})
    fast._rnnfuse_autotune.measure = timer
    (layer,) = fused_layers(fast)
    assert _fused(layer.plan)  # until the first batch: the static plan
    rng = np.random.default_rng(5)
    x = random_inputs(model, batch, rng)
    y = rng.standard_normal((batch, 3)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    history = fast.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert timer.calls == 0
    assert layer.plan.name == plan and layer.last_path.kind is PathKind.FUSED
    trained = [attrs for target, attrs in keras_sees_gpu.calls if "training" in target]
    assert trained and {attrs["algorithm"] // 4 for attrs in trained} == {algo}


# -- the tuner -----------------------------------------------------------------------


def _steps_raising(built, original_error=None):
    """The tuner's `_steps`, building nothing; the original layers' step
    raises `original_error` on its first call where given."""

    def steps(group, plans, shape, dtype, training, jit_baseline=False, masked=False):
        built.extend(p.name for p in plans)

        def failing():
            raise original_error

        return {p.name: failing if original_error is not None and not p.pieces else None
                for p in plans}

    return steps


def _tune(model, monkeypatch, original_error=None, medians=None):
    built = []
    monkeypatch.setattr(tuner, "_steps", _steps_raising(built, original_error))
    timer = fake_clock.FakeTimer(medians or {"fused": 1.0})
    (result,) = tuner.tune_plans(
        rnnfuse.analyze(model).groups, lambda g: (4, 7, 5), environment=dict(ENV),
        measure=timer, check_gradients=lambda *a: 0.0, progress=False)
    return result, built, timer


@pytest.mark.parametrize("kind", ["lstm", "bidirectional lstm"])
def test_the_tuner_never_times_original_layers_that_cannot_compile(kind, keras_sees_gpu,
                                                                   monkeypatch):
    result, built, timer = _tune(_model(kind, "mixed_float16"), monkeypatch)
    assert "per-layer" not in built
    assert all("per-layer" not in names for names in timer.names), timer.names
    assert result.rejected["per-layer"].startswith(f"not timed: {REASON} float16")
    assert result.source == "measured" and not result.plan.per_layer


@pytest.mark.parametrize("error", [
    ValueError("Unknown output type float16"),
    jax.errors.JaxRuntimeError("INTERNAL: cuDNN RNN failed"),
])
def test_a_failing_original_candidate_is_rejected_with_its_error(error, emulated_core,
                                                                 monkeypatch):
    """Where the original layers' step fails to compile though nothing said
    it would (a float32 LSTM here), the candidate is rejected with the error
    and a fused plan is chosen: the failure never ends the tuning."""
    result, built, timer = _tune(stack_model("lstm", 3), monkeypatch, original_error=error)
    assert "per-layer" in built
    why = result.rejected["per-layer"]
    assert why.startswith("the original layers cannot run here: ") and type(error).__name__ in why
    assert str(error).split(":")[0] in why
    assert "per-layer" not in result.timings and _fused(result.plan)


def test_a_bug_in_the_original_candidate_is_still_raised(emulated_core, monkeypatch):
    with pytest.raises(KeyError):
        _tune(stack_model("lstm", 3), monkeypatch, original_error=KeyError("a bug"))


def test_every_candidate_refused_gives_the_static_plan(keras_sees_gpu, monkeypatch):
    """Nothing timed (the original layers cannot compile, every fused step
    refused): the static plan, with what was rejected, not a crash."""
    monkeypatch.setattr(tuner, "_first_calls",
                        lambda steps, plans, seconds=None: ({}, {n: "refused" for n in steps}))
    result, _, _ = _tune(stack_model("lstm", 2, dtype="mixed_float16"), monkeypatch)
    assert _fused(result.plan) and result.source == "static: no candidate ran here"
    assert result.rejected["fused"] == "refused" and "per-layer" in result.rejected


def test_first_batch_fit_survives_an_original_candidate_that_fails(emulated_core, monkeypatch,
                                                                   tmp_path):
    """First-batch tuning under fit: the original candidate's step fails as
    jaxlib's lowering does; the fit goes on, on the fused plan."""
    from rnnfuse.tuning.cache import PlanCache

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    built = []
    monkeypatch.setattr(tuner, "_steps",
                        _steps_raising(built, ValueError("Unknown output type float16")))
    model = stack_model("lstm", 2, head=True)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    state = fast._rnnfuse_autotune
    state.measure = fake_clock.FakeTimer({"fused": 1.0})
    state.check_gradients = lambda *a: 0.0
    state.fit_share = None
    rng = np.random.default_rng(6)
    x = random_inputs(model, 8, rng)
    y = rng.standard_normal((8, 3)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert "per-layer" in built
    assert record["rejected"]["per-layer"].startswith("the original layers cannot run here")
    assert record["chosen"] != "per-layer"
    (layer,) = fused_layers(fast)
    assert layer.last_path.kind is PathKind.FUSED


class _ClockedTimer(fake_clock.FakeTimer):
    """Fixed medians; timing a candidate advances `clock` by 6 calls' worth."""

    default = 0.5

    def __init__(self, clock, medians):
        super().__init__(medians)
        self.clock = clock

    def __call__(self, steps):
        out = super().__call__(steps)
        self.clock.now += sum(6 * s["median"] for s in out.values())
        return out


@pytest.mark.parametrize("fit_steps, source", [
    (100, "measured: within the call's budget"), (100_000, "measured")])
def test_a_budget_without_the_original_layers_scales_with_the_fastest_step(
        fit_steps, source, keras_sees_gpu, monkeypatch):
    """The budget is a share of the fit's steps at the original layers'
    speed; where they cannot run, at the fastest step timed (the fit runs
    that), so a long fit times every candidate and a short one the static
    plan only."""
    from rnnfuse.tuning.budget import TuningBudget
    from rnnfuse.tuning.clock import using_clock

    clock = fake_clock.FakeClock()
    monkeypatch.setattr(tuner, "_steps", _steps_raising([]))
    timer = _ClockedTimer(clock, {"fused": 0.4})
    model = stack_model("lstm", 3, dtype="mixed_float16")
    with using_clock(clock):
        (result,) = tuner.tune_plans(
            rnnfuse.analyze(model).groups, lambda g: (4, 7, 5), environment=dict(ENV),
            measure=timer, check_gradients=lambda *a: 0.0, progress=False,
            budget=TuningBudget(steps=fit_steps))
    timed = sorted(set().union(*map(set, timer.names)))
    assert result.source == source, (result.source, result.rejected)
    assert "per-layer" not in timed and _fused(result.plan)
    assert (timed == ["fused"]) == (fit_steps == 100), timed
