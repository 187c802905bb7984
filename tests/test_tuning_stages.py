"""The two-stage tuner with real steps: tf.functions of real candidates on
the CPU (cuDNN emulated, `emulated_cudnn`), timed by the real
`interleaved_medians`, so what tests/test_tuning.py checks with a fake timer
holds when each stage builds, traces and calls real steps."""

from __future__ import annotations

from builders import stack_model
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.tuning import tuner
from rnnfuse.plan import Plan

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow", "rnnfuse": "0.1.0"}
ALGORITHM = "persistent_static+tc"


def test_both_stages_run_real_steps_and_build_each_plan_once(emulated_cudnn, monkeypatch):
    # Without rnnfuse's op the fallback runs the standard algorithm whatever
    # is asked (so the algorithm's plans time like the default's here); the
    # stages and the step reuse are what is under test.
    monkeypatch.setenv("RNNFUSE_DISABLE_OP", "1")
    monkeypatch.setattr(tuner, "candidates_for", lambda backend: lambda group: [
        Plan(()), Plan((4,)), Plan((4,), ALGORITHM), Plan((2, 2)), Plan((2, 2), ALGORITHM),
    ])
    built, runners = [], []
    real_steps, real_runner = tuner._steps, tuner._runner
    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: (
        built.extend(p.name for p in plans) or real_steps(group, plans, *a, **k)))
    monkeypatch.setattr(tuner, "_runner", lambda group, plan, *a, **k: (
        runners.append(plan.name) or real_runner(group, plan, *a, **k)))
    model = stack_model("lstm", 4, units=4, steps=4)
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    (result,) = tuner.tune_plans(
        [group], lambda g: (2, 4, g.input_size), environment=dict(ENV), progress=False,
        warmup=1, repeats=1, check_gradients=lambda *a: 0.0,
    )
    assert result.source == "measured"
    assert len(built) == len(set(built)), f"a plan was built twice: {built}"
    assert set(built) >= {"per-layer", "fused", f"fused @{ALGORITHM}"}
    for name in ("split 2+2", f"split 2+2 @{ALGORITHM}"):
        assert (name in built) != ("not timed" in result.rejected.get(name, "")), (name, result.rejected)
    assert all(t > 0 for t in result.timings.values())
    assert set(result.timings) == set(built)
    assert result.plan.name in result.timings
    # Each plan's runner is made once for its step (the gradient check is
    # faked here), whichever stage times it.
    assert sorted(runners) == sorted(built)


def test_first_calls_record_their_seconds():
    seconds = {}
    kept, refused = tuner._first_calls({"a": lambda: 1.0, "b": None}, {}, seconds)
    assert list(kept) == ["a", "b"] and not refused
    assert set(seconds) == {"a"} and seconds["a"] >= 0.0
