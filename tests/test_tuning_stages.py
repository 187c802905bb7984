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


def _traceable(call, trace):
    call.trace = trace
    return call


def test_a_step_traces_while_the_one_before_makes_its_first_call():
    import threading

    traced_b = threading.Event()
    seen = {}

    def call_a():
        # The first call of a waits here for b's trace: only an overlap lets it through.
        seen["b traced during a's call"] = traced_b.wait(timeout=10)
        seen["a's thread"] = threading.current_thread().name
        return 1.0

    steps = {
        "a": _traceable(call_a, lambda: None),
        "b": _traceable(lambda: 2.0, traced_b.set),
    }
    seconds = {}
    kept, refused = tuner._first_calls(steps, {}, seconds)
    assert list(kept) == ["a", "b"] and not refused and set(seconds) == {"a", "b"}
    assert seen["b traced during a's call"]
    assert seen["a's thread"] != threading.current_thread().name


def test_pipelined_first_calls_run_one_at_a_time_and_untraceable_steps_wait_their_turn():
    import threading
    import time

    lock, running, most, order = threading.Lock(), [0], [0], []

    def call(name):
        def run():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.02)
            with lock:
                running[0] -= 1
                order.append(name)
            return 1.0
        return run

    steps = {n: _traceable(call(n), lambda: None) for n in ("a", "b", "c")}
    steps["eager"] = call("eager")  # no trace: called at its turn, alone
    steps["d"] = _traceable(call("d"), lambda: None)
    tuner._first_calls(steps, {})
    assert most[0] == 1, "two first calls ran at once"
    assert order == ["a", "b", "c", "eager", "d"]


def test_a_refusal_raised_while_tracing_is_left_out_and_a_bug_still_raises():
    import pytest

    plans = {"fused on wavefront": Plan((2,), kernel="wavefront"), "fused": Plan((2,))}

    def refuse():
        raise NotImplementedError("not timed: the wavefront kernel did not run (too large)")

    kept, why = tuner._first_calls({
        "fused on wavefront": _traceable(lambda: 1.0, refuse),
        "fused": _traceable(lambda: 1.0, lambda: None),
    }, plans)
    assert list(kept) == ["fused"] and "did not run" in why["fused on wavefront"]
    with pytest.raises(ZeroDivisionError):
        tuner._first_calls({"fused": _traceable(lambda: 1.0, lambda: 1 / 0)}, plans)


def _compilable(call, trace, compile_):
    call.trace, call.compile = trace, compile_
    return call


def test_steps_compile_together_off_the_main_thread_and_a_refused_trace_never_compiles(
        monkeypatch):
    import threading

    monkeypatch.setattr(tuner, "COMPILE_THREADS", 2)
    both = threading.Barrier(2, timeout=10)  # only two compiles at once pass it
    events = []

    def event(what):
        def record():
            events.append((what, threading.current_thread().name))
        return record

    def compile_(name):
        def run():
            event(f"compile {name}")()
            both.wait()
        return run

    def refuse():
        raise NotImplementedError("not timed: standard ran for persistent_static+tc (refused)")

    plans = {"a": Plan((2,)), "b": Plan((2,), ALGORITHM), "c": Plan((2,), "persistent_dynamic+tc")}
    steps = {
        "a": _compilable(event("call a"), event("trace a"), compile_("a")),
        "b": _compilable(event("call b"), event("trace b"), compile_("b")),
        "c": _compilable(event("call c"), refuse, event("compile c")),
    }
    kept, why = tuner._first_calls(steps, plans)
    assert list(kept) == ["a", "b"] and "standard ran" in why["c"]
    threads = {what: thread for what, thread in events}
    main = threading.current_thread().name
    assert threads["trace a"] == threads["trace b"] == main
    assert all(threads[f"compile {n}"].startswith("rnnfuse-compile") for n in "ab")
    assert threads["call a"] == threads["call b"] != main
    assert not any(what.endswith(" c") for what, _ in events), "a refused trace was compiled"
    order = [what for what, _ in events]
    assert order.index("call a") > order.index("compile a")
    assert order.index("call b") > order.index("compile b")


def test_a_compile_that_fails_is_its_steps_refusal_or_raises():
    import pytest

    plans = {"fused @persistent_static+tc": Plan((2,), ALGORITHM), "fused": Plan((2,))}
    called = []

    def refuse():
        raise NotImplementedError("the kernel cannot run this shape")

    kept, why = tuner._first_calls({
        "fused @persistent_static+tc": _compilable(lambda: called.append(1), lambda: None, refuse),
        "fused": _compilable(lambda: 1.0, lambda: None, lambda: None),
    }, plans)
    assert list(kept) == ["fused"] and not called
    assert why["fused @persistent_static+tc"] == "the kernel cannot run this shape"
    with pytest.raises(ZeroDivisionError):
        tuner._first_calls({"fused": _compilable(lambda: 1.0, lambda: None, lambda: 1 / 0)}, plans)


def test_a_real_step_is_traced_once_though_its_first_call_runs_on_another_thread():
    import tensorflow as tf

    from rnnfuse.backends import tensorflow as tf_backend

    v, traces = tf.Variable(2.0), []

    def run(x, training):
        traces.append(training)  # Python runs only while tracing
        return x * v

    step = tf_backend.timed_step(run, tf.constant(3.0), [v], True)
    kept, refused = tuner._first_calls({"fused": step}, {})
    assert list(kept) == ["fused"] and not refused
    assert float(step()) == 36.0  # the loss, mean((x v)^2); its gradients add 0
    step.trace()
    assert traces == [True], "the worker's first call or a later one traced again"
