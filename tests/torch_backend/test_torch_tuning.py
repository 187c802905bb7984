"""optimize(model, tune=...) under the torch backend: the plans are measured.

The torch backend's fused call runs on the CPU as well, so the tuner times
real candidates here (tiny shapes); a fake timer pins the decisions.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, stack_model
from fake_clock import FakeTimer
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.tuner import device_environment, tune_plans


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


def _tune(model, timer, **kwargs):
    return tune_plans(
        _groups(model),
        lambda g: (4, 6, g.input_size),
        measure=timer,
        progress=False,
        **kwargs,
    )


def test_environment_names_the_torch_device_and_versions():
    import torch

    env = device_environment()
    assert env["backend"] == "torch"
    assert env["torch"] == torch.__version__
    assert env["device"].startswith("cpu") or torch.cuda.is_available()


def test_candidates_are_per_layer_whole_halves_and_one_call_per_layer():
    timer = FakeTimer({})
    _tune(stack_model("lstm", 4, units=8, input_size=4, steps=6), timer)
    # One stage: with one algorithm, staging would rule out little and
    # re-time the winners.
    assert timer.names == [sorted(["per-layer", "fused", "split 2+2", "split 1+1+1+1"])]
    # No cuDNN algorithm candidates: PyTorch picks its own.
    assert not any("@" in name for name in timer.names[0])


@pytest.mark.parametrize(
    "fastest, fused_count",
    [("per-layer", 0), ("fused", 1), ("split 1+1+1", 3)],
)
def test_the_fastest_plan_is_built(fastest, fused_count, monkeypatch):
    model = stack_model("gru", 3, units=8, input_size=4, steps=6)
    medians = {"per-layer": 2.0, "fused": 2.0, "split 1+1+1": 2.0}
    medians[fastest] = 1.0
    from rnnfuse.tuning import tuner

    real = tuner.interleaved_medians
    monkeypatch.setattr(tuner, "interleaved_medians", lambda steps, **kw: FakeTimer(medians)(steps))
    try:
        fast = rnnfuse.optimize(model, tune=rnnfuse.TuneShape(4, 6), cache=False)
    finally:
        monkeypatch.setattr(tuner, "interleaved_medians", real)
    assert len(fused_layers(fast)) == fused_count
    x = random_inputs(model, 4, np.random.default_rng(0))
    assert max_abs_diff(fast(x), model(x)) < 1e-5


def test_real_timing_on_the_cpu_picks_a_measured_plan_and_caches_it(tmp_path):
    from rnnfuse.tuning import tuner

    model = stack_model("lstm", 2, units=8, input_size=4, steps=6, head=True)
    cache = PlanCache(tmp_path / "plans.json")
    (result,) = tune_plans(
        _groups(model), lambda g: (4, 6, g.input_size), cache=cache, progress=False,
        warmup=1, repeats=3,
    )
    assert result.source == "measured"
    assert set(result.timings) == {"per-layer", "fused", "split 1+1"}
    assert all(t > 0 for t in result.timings.values())
    # The tuner's rule on whatever this CPU measured: the fastest plan, if it
    # beats the original layers by KEEP_ORIGINAL_MARGIN, else the originals.
    t = result.timings
    fastest = min(t, key=t.get)
    wins = t[fastest] <= (1 - tuner.KEEP_ORIGINAL_MARGIN) * t["per-layer"]
    assert result.plan.name == (fastest if wins else "per-layer"), t
    (again,) = tune_plans(_groups(model), lambda g: (4, 6, g.input_size), cache=cache, progress=False)
    assert again.source == "cache" and again.plan == result.plan


def test_optimize_with_a_sample_batch_stays_exact(tmp_path):
    model = stack_model("gru", 2, units=8, input_size=4, steps=6, head=True)
    x = random_inputs(model, 4, np.random.default_rng(1))
    fast = rnnfuse.optimize(model, tune=x, cache=tmp_path / "plans.json")
    assert max_abs_diff(fast(x), model(x)) < 1e-5
    # The original model is untouched and still shares its variables.
    assert {id(v) for v in fast.weights} == {id(v) for v in model.weights}


def test_training_steps_reach_every_variable():
    """The timed training step differentiates through the candidate."""
    import torch

    from rnnfuse.backends import torch as torch_backend

    model = stack_model("lstm", 2, units=8, input_size=4, steps=6)
    (group,) = _groups(model)
    variables = [w for v in group.views for w in v.layer.trainable_weights]
    x = keras.ops.convert_to_tensor(np.ones((2, 6, 4), "float32"))
    seen = []

    def run(inputs, training):
        y = inputs
        for view in group.views:
            y = view.layer(y, training=training)
        seen.append(torch.is_grad_enabled())
        return y

    train = torch_backend.timed_step(run, x, variables, training=True)
    infer = torch_backend.timed_step(run, x, variables, training=False)
    assert float(train()) > 0 and np.isfinite(float(infer()))
    assert seen == [True, False]


def test_a_candidate_whose_eager_first_call_is_clearly_slow_is_not_run_again(
    monkeypatch, fake_clock
):
    """torch's steps run eagerly: Keras' masked loop at 17 s a step is not
    given a warm-up call after its first one; that call is its time."""
    from rnnfuse.tuning import tuner

    calls, order = {}, []

    def steps(group, plans, *args, **kwargs):
        def step(name, seconds):
            def run():
                calls[name] = calls.get(name, 0) + 1
                order.append(name)
                fake_clock.advance(seconds)
                return 1.0
            return run
        return {p.name: step(p.name, 0.25 if p.name == "per-layer" else 0.001) for p in plans}

    monkeypatch.setattr(tuner, "_steps", steps)
    monkeypatch.setattr(tuner, "FIRST_CALL_PRUNE_S", 0.1)
    (result,) = tune_plans(
        _groups(stack_model("gru", 2, units=8, input_size=4, steps=6)),
        lambda g: (4, 6, g.input_size), progress=False, warmup=1, repeats=3,
        check_gradients=lambda *a: 0.0,
    )
    assert calls["per-layer"] == 1
    assert calls["fused"] == 1 + 1 + 3  # first call, warm-up, rounds
    # The original layers' first call comes after the fused plans' (the
    # first call of all may carry the process's one-time set-up).
    first_calls = list(dict.fromkeys(order))
    assert first_calls[-1] == "per-layer" and order.index("per-layer") == len(calls) - 1
    assert result.timings["per-layer"] == pytest.approx(0.25)
    assert result.plan.name != "per-layer"


def _steps_whose_original_costs(per_step_s, calls, clock):
    """A fake `tuner._steps`: the original layers take `per_step_s` a time
    step (Keras' Python loop), the fused plans 1 ms a call, on `clock` (the
    fake_clock fixture); `calls` counts the calls by (plan name, steps)."""

    def steps(group, plans, shape, *args, **kwargs):
        def step(name, seconds):
            def run():
                key = (name, shape[1])
                calls[key] = calls.get(key, 0) + 1
                clock.advance(seconds)
                return 1.0
            return run
        return {p.name: step(p.name, per_step_s * shape[1] if p.name == "per-layer" else 0.001)
                for p in plans}

    return steps


def test_a_clearly_slow_original_is_timed_from_short_first_calls_not_a_full_one(
    monkeypatch, fake_clock
):
    """Keras' masked torch loop is linear in the steps: first calls on 16 and
    32 steps extrapolate to its full-length call, which is then not made."""
    from rnnfuse.tuning import tuner

    calls = {}
    monkeypatch.setattr(tuner, "_steps", _steps_whose_original_costs(0.002, calls, fake_clock))
    monkeypatch.setattr(tuner, "FIRST_CALL_PRUNE_S", 0.1)
    length = 200  # a full call: 0.4 s
    (result,) = tune_plans(
        _groups(stack_model("gru", 2, units=8, input_size=4, steps=6)),
        lambda g: (4, length, g.input_size), progress=False, warmup=1, repeats=3,
        check_gradients=lambda *a: 0.0,
    )
    assert ("per-layer", length) not in calls, calls
    assert calls[("per-layer", tuner.PROBE_STEPS)] == calls[("per-layer", 2 * tuner.PROBE_STEPS)] == 1
    # a + (b - a) * (200 - 16) / 16 from the first calls on 16 and 32 steps.
    assert result.timings["per-layer"] == pytest.approx(0.4)
    assert "extrapolate" in result.rejected["per-layer"]
    assert result.plan.name != "per-layer"


def test_an_original_that_is_not_clearly_slow_gets_its_full_first_call_and_rounds(
    monkeypatch, fake_clock
):
    from rnnfuse.tuning import tuner

    calls = {}
    monkeypatch.setattr(tuner, "_steps", _steps_whose_original_costs(0.000005, calls, fake_clock))
    monkeypatch.setattr(tuner, "FIRST_CALL_PRUNE_S", 0.1)
    (result,) = tune_plans(
        _groups(stack_model("gru", 2, units=8, input_size=4, steps=6)),
        lambda g: (4, 200, g.input_size), progress=False, warmup=1, repeats=3,
        check_gradients=lambda *a: 0.0,
    )
    # Its first call, a warm-up and three rounds: the fused plans, as fast
    # as it, cannot beat it by the margin, so the race ends after three.
    assert calls[("per-layer", 200)] == 1 + 1 + 3, calls
    assert "per-layer" not in result.rejected


def test_the_first_step_called_is_not_judged_by_its_first_call(monkeypatch, fake_clock):
    """Whatever is called first may pay for cuDNN's libraries loading: a
    slow first call there is timed as usual, not taken as its time."""
    from rnnfuse.tuning import tuner

    calls = {}

    def steps(group, plans, *args, **kwargs):
        def step(name):
            def run():
                calls[name] = calls.get(name, 0) + 1
                # Equal steps; the process's one-time set-up on the first call.
                fake_clock.advance(0.25 if sum(calls.values()) == 1 else 0.01)
                return 1.0
            return run
        return {p.name: step(p.name) for p in plans}

    monkeypatch.setattr(tuner, "_steps", steps)
    monkeypatch.setattr(tuner, "FIRST_CALL_PRUNE_S", 0.1)
    tune_plans(
        _groups(stack_model("gru", 2, units=8, input_size=4, steps=6)),
        lambda g: (4, 6, g.input_size), progress=False, warmup=1, repeats=3,
        check_gradients=lambda *a: 0.0,
    )
    assert all(n == 1 + 1 + 3 for n in calls.values()), calls
