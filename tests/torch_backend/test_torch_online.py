"""Online tuning (rnnfuse.tuning.online): the candidates race on the fit's
own steps. The device is faked and each step's seconds come from a fake
clock (a fixed median per candidate); the steps themselves are real
training steps on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, stack_model
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.tuning import first_batch, online
from rnnfuse.tuning.budget import FIT_SHARE
from torch_checks import FAKE_GPU_ENV


class StepClock:
    """(name, run) -> (logs, seconds): runs the real step, reads a fixed
    median for its candidate; records the order."""

    def __init__(self, medians):
        self.medians, self.ran = medians, []

    def __call__(self, name, run):
        self.ran.append(name)
        return run(), self.medians.get(name, 5.0)


def _online(model, medians, tmp_path=None, check=None):
    fast = rnnfuse.optimize(model, cache=False if tmp_path is None else str(tmp_path / "p.json"))
    state = fast._rnnfuse_autotune
    # The whole fit its budget: a short test fit races.
    state.online, state.environment, state.fit_share = True, dict(FAKE_GPU_ENV), 1.0
    state.measure_step = StepClock(medians)
    state.check_gradients = check or (lambda *args: 1e-6)
    return fast, state


def _data(model, rows=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, *model.input_shape[1:])).astype("float32")
    return x, np.asarray(model.predict(x, verbose=0))


MEDIANS = {"per-layer": 1.8, "fused": 1.0, "split 1+1+1": 1.6}


def test_online_tuning_commits_the_fastest_plan_on_the_fits_own_steps(fake_gpu_online):
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    (layer,) = fused_layers(fast)
    x, y = _data(model)
    before = [np.array(w) for w in layer.get_weights()]
    fast.compile(optimizer="sgd", loss="mse")
    history = fast.fit(x, y, batch_size=4, epochs=4, verbose=0)  # 32 steps
    clock = state.measure_step
    assert set(clock.ran) == set(MEDIANS), "every candidate ran real steps"
    assert layer.plan == Plan((3,))
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured: online, on the fit's own steps"
    assert record["chosen"] == "fused" and record["timings_ms"]["per-layer"] == 1800.0
    # The race's steps were real training steps.
    assert all(np.isfinite(history.history["loss"]))
    assert any(not np.array_equal(a, np.array(b)) for a, b in zip(before, layer.get_weights()))
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-5


def test_the_switch_happens_once(fake_gpu_online, monkeypatch):
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    (layer,) = fused_layers(fast)
    commits = []
    real_commit = online.OnlineFit._commit

    def commit(self, *args, **kwargs):
        commits.append(self.race.committed)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(online.OnlineFit, "_commit", commit)
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    ran = list(state.measure_step.ran)
    assert commits == ["fused"]
    # After the commit the fit's steps are the winner's own function: no
    # more candidate steps, and the model's train function is not the race.
    assert len(ran) < 32 and not isinstance(fast.train_function, online.OnlineFit)
    fast.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert state.measure_step.ran == ran and commits == ["fused"], "a decided bucket races no more"
    assert layer.plan == Plan((3,))


def test_a_plan_that_fails_the_exactness_check_is_never_run_or_committed(fake_gpu_online, monkeypatch):
    inexact = Plan((3,), "persistent_static")
    monkeypatch.setattr(first_batch, "candidates_for",
                        lambda backend: lambda group: [PER_LAYER, Plan((3,)), inexact])
    errors = {inexact.name: 1e-2}
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, {**MEDIANS, inexact.name: 0.1},
                          check=lambda group, plan, shape, dtype: errors.get(plan.name, 1e-6))
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    assert inexact.name not in state.measure_step.ran
    (record,) = first_batch.decisions(fast)
    assert record["chosen"] == "fused"
    assert record["rejected"][inexact.name] == "failed the exactness check"


def test_every_candidate_is_checked_on_the_same_weights_before_the_race_steps(
        fake_gpu_online, monkeypatch):
    """A check compares a plan's gradients with a float64 reference on the
    weights of its moment: one checked after other candidates' real steps
    would be compared with a reference on stale weights, and fail (its
    default-algorithm twin's error is kept from the first check)."""
    static, dynamic = Plan((3,), "persistent_static"), Plan((3,), "persistent_dynamic")
    monkeypatch.setattr(first_batch, "candidates_for",
                        lambda backend: lambda group: [PER_LAYER, Plan((3,)), static, dynamic])
    checked_on = []

    def check(group, plan, shape, dtype):
        if not plan.algorithm:
            return 1e-6
        weights = [np.array(w) for v in group.views for w in v.layer.trainable_weights]
        checked_on.append(weights)
        same = all(np.array_equal(a, b) for a, b in zip(checked_on[0], weights))
        return 1e-6 if same else 1e-2

    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, {**MEDIANS, static.name: 0.5, dynamic.name: 0.4}, check=check)
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert len(checked_on) >= 2
    assert "failed the exactness check" not in record["rejected"].values()
    assert {static.name, dynamic.name} <= set(state.measure_step.ran)
    assert record["chosen"] == dynamic.name


def test_a_fit_too_short_for_the_race_is_timed_apart_within_its_budget(fake_gpu_online):
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    x, y = _data(model, rows=8)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 2 steps: the static table
    assert state.measure_step.ran == []
    (record,) = first_batch.decisions(fast)
    assert record["source"].startswith("static: a call of 2 steps")


def test_a_fit_long_enough_to_race_but_not_to_pay_for_timing_runs_the_static_plan(fake_gpu_online):
    """As offline: a call too short to time the two leading candidates
    within 3% of it races nothing (the static table's proven plan)."""
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    state.fit_share = FIT_SHARE
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)  # 32 steps: a race's, not a budget's
    assert state.measure_step.ran == []
    (record,) = first_batch.decisions(fast)
    assert record["source"].startswith("static: a call of 32 steps cannot pay for timing")


def test_the_race_ends_with_the_fit_where_the_fit_ends_first(fake_gpu_online):
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    state.fit_share = None  # no length known to the race: it starts
    x, y = _data(model, rows=40)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 10 steps: the race is cut
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured: online, on the fit's own steps"
    assert record["chosen"] in MEDIANS
    # The model goes on with the committed plan.
    fast.train_on_batch(x[:4], y[:4])
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not isinstance(fast.train_function, online.OnlineFit)
    assert len(first_batch.decisions(fast)) == 1


def test_a_fit_too_short_to_pay_for_a_start_keeps_the_original_layers(fake_gpu_online, tmp_path):
    """The original layers' first step (60 s, a slow trace) prices the
    others' starts, over what half a 32-step fit at 1.8 s a step pays; the
    decision, cut short, is not cached."""
    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS, tmp_path)
    state.fit_share = 0.5
    ran = []

    def step(name, run):
        seconds = 60.0 if name not in ran else MEDIANS[name]
        ran.append(name)
        return run(), seconds

    state.measure_step = step
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["chosen"] == "per-layer" and set(ran) == {"per-layer"}
    assert record["rejected"]["fused"].startswith("not run: its start (about 116.40 s)")
    assert record["race"]["check_ms"] == 0.0
    assert record["source"] == "measured: online, cut short by the call's length"
    assert state.cache.entries() == []


def test_the_race_alone():
    race = online.OnlineRace(["per-layer", "fused", "split 2+2"], warmup=1, repeats=5,
                             check=lambda name: name != "split 2+2")
    seconds = {"per-layer": 2.0, "fused": 1.9, "split 2+2": 0.1}
    while race.committed is None:
        name = race.next()
        race.record(name, seconds[name])
    # "fused" is faster but within the margin: the original layers stay.
    assert race.committed == "per-layer" and "split 2+2" not in race.times or not race.times["split 2+2"]
    assert race.rejected == {"split 2+2": "failed the exactness check"}


def test_a_candidate_far_slower_on_its_warm_up_step_runs_no_timed_round():
    """Each of a slow candidate's steps is a slow real step: one far slower
    on its last warm-up step (WARM_PRUNE) leaves the race before the timed
    rounds; one only somewhat slower is timed and pruned at PRUNE."""
    race = online.OnlineRace(["per-layer", "fused", "dynamic", "split"], warmup=1, repeats=5)
    seconds = {"per-layer": 0.1, "fused": 0.05, "dynamic": 0.9, "split": 0.09}
    ran = []
    while race.committed is None:
        name = race.next()
        ran.append(name)
        race.record(name, seconds[name])
    assert race.committed == "fused"
    assert ran.count("dynamic") == 2 and not race.times["dynamic"]  # first call, warm-up
    assert race.pruned == {"dynamic", "per-layer", "split"}
    assert 1 <= len(race.times["split"]) <= 2


def test_a_clearly_slow_eager_first_step_runs_no_warm_up_step():
    """Over a second and 2.25x the fastest first step (the race's very first
    step, which carries the fit's set-up, not judged): as the offline tuner
    does with eager first calls, no warm-up step follows."""
    race = online.OnlineRace(["per-layer", "fused", "dynamic", "split"], warmup=1, repeats=3)
    first = {"per-layer": 5.0, "fused": 0.4, "dynamic": 3.0, "split": 0.5}
    later = {"per-layer": 0.3, "fused": 0.2, "dynamic": 2.0, "split": 0.25}
    ran = []
    while race.committed is None:
        name = race.next()
        race.record(name, (later if name in ran else first)[name])
        ran.append(name)
    assert ran.count("dynamic") == 1 and ran.count("per-layer") > 1
    assert race.skipped == {"dynamic": "not timed: its first step took 3.00 s, over 2.25x "
                                       "the fastest first step (0.40 s)"}
    assert race.committed == "fused"
    # Without a warm-up step (a first step that compiles), nothing is judged on it.
    race = online.OnlineRace(["per-layer", "fused", "dynamic"], warmup=0, repeats=1)
    ran = []
    while race.committed is None:
        ran.append(race.next())
        race.record(ran[-1], (later if ran.count(ran[-1]) > 1 else first)[ran[-1]])
    assert ran.count("dynamic") == 2 and not race.skipped


def test_only_the_fastest_few_on_their_warm_up_step_run_timed_rounds():
    race = online.OnlineRace(["per-layer", "a", "b", "c", "d"], warmup=1, repeats=3)
    seconds = {"per-layer": 1.0, "a": 0.6, "b": 0.7, "c": 0.8, "d": 0.9}
    while race.committed is None:
        name = race.next()
        race.record(name, seconds[name])
    assert online.WARM_KEEP == 3 and race.committed == "a"
    assert not race.times["d"] and not race.times["per-layer"]
    assert race.times["b"] and race.times["c"]


def test_the_races_overhead_is_its_steps_beyond_as_many_of_the_winners():
    race = online.OnlineRace(["per-layer", "fused"], warmup=1, repeats=5)
    seconds = {"per-layer": 2.0, "fused": 1.0}
    assert race.overhead() == 0.0
    while race.committed is None:
        name = race.next()
        race.record(name, seconds[name])
    # Each ran its first call, its warm-up and one timed round, which pruned per-layer.
    assert race.committed == "fused" and race.steps_run == 6
    assert race.overhead() == pytest.approx(3 * 2.0 + 3 * 1.0 - 6 * 1.0)


def test_a_split_runs_only_where_its_whole_run_came_within_prune_of_the_fastest():
    later = {"split 2+2": "fused", "split 2+2 @ps": "fused @ps"}
    race = online.OnlineRace(["per-layer", "fused", "fused @ps", "split 2+2", "split 2+2 @ps"],
                             warmup=1, repeats=3, later=later)
    seconds = {"per-layer": 1.0, "fused": 0.9, "fused @ps": 0.5, "split 2+2": 0.6,
               "split 2+2 @ps": 0.4}
    ran = []
    while race.committed is None:
        ran.append(race.next())
        race.record(ran[-1], seconds[ran[-1]])
    # fused (0.9) was over 1.5x fused @ps (0.5) on its warm-up step: its split never ran.
    assert "split 2+2" not in ran and race.skipped == {
        "split 2+2": "not run: fused was over 1.5x the fastest on its warm-up step"}
    assert ran[:6] == ["per-layer", "fused", "fused @ps"] * 2  # stage one's first calls and warm-ups
    assert race.committed == "split 2+2 @ps"


def test_without_a_warm_up_step_every_candidate_races_at_once():
    race = online.OnlineRace(["fused", "split 2+2"], warmup=0, repeats=2,
                             later={"split 2+2": "fused"})
    assert race.next() == "fused" and race.running() == ["fused", "split 2+2"]


def test_the_races_own_step_timer_reads_the_clock_and_commits_the_fastest(fake_gpu_online,
                                                                         fake_clock, monkeypatch):
    """No injected step timer: the race times each step on rnnfuse's clock,
    which each step here advances by its plan's cost."""
    from rnnfuse.fused import FusedRNN

    model = stack_model("gru", 3, steps=6)
    fast, state = _online(model, MEDIANS)
    state.measure_step = None  # the race's own timer (online._wall_clock_step)
    real_run, real_original = FusedRNN._run, FusedRNN._original_call

    def run(self, plan, *args, **kwargs):
        if self.planner is not None:  # the model's layer, not a split plan's piece
            fake_clock.advance(MEDIANS[plan.name])
        return real_run(self, plan, *args, **kwargs)

    def original(self, *args, **kwargs):
        fake_clock.advance(MEDIANS["per-layer"])
        return real_original(self, *args, **kwargs)

    monkeypatch.setattr(FusedRNN, "_run", run)
    monkeypatch.setattr(FusedRNN, "_original_call", original)
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["source"] == "measured: online, on the fit's own steps"
    assert record["chosen"] == "fused"
    assert record["timings_ms"] == pytest.approx({name: 1e3 * s for name, s in MEDIANS.items()})
    # Its cost counts as tuning: three steps of each candidate (first call,
    # warm-up, one timed round that prunes the other two) beyond 9 of fused's.
    assert state.seconds == pytest.approx(3 * (1.8 + 1.6 + 1.0) - 9 * 1.0)


def _race_with_the_kernel(monkeypatch, reason):
    """A 3-layer LSTM's online race where the backend's `kernel_reason` is
    `reason` and the wavefront plan would be the fastest."""
    from rnnfuse.backends import torch as torch_backend

    monkeypatch.setattr(torch_backend, "kernel_reason", lambda *args, **kwargs: reason)
    model = stack_model("lstm", 3, steps=6)
    fast, state = _online(model, {**MEDIANS, "fused on wavefront": 0.5})
    x, y = _data(model)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    (record,) = first_batch.decisions(fast)
    return state.measure_step.ran, record


def test_the_race_includes_the_kernels_the_offline_tuner_times(fake_gpu_online, monkeypatch):
    """The wavefront kernel's plan races where the backend runs it for the
    shape, as the offline tuner times it, and wins where it is fastest."""
    ran, record = _race_with_the_kernel(monkeypatch, None)
    assert "fused on wavefront" in ran
    assert record["chosen"] == "fused on wavefront", record


def test_the_race_record_says_why_a_kernel_plan_did_not_race(fake_gpu_online, monkeypatch):
    """A plan the backend refuses for the shape is not run, and the decision
    names it with the backend's reason, as the offline tuner's does."""
    why = "the wavefront kernel refuses this shape (a test's reason)"
    ran, record = _race_with_the_kernel(monkeypatch, why)
    assert "fused on wavefront" not in ran
    assert record["chosen"] == "fused", record
    assert record["rejected"]["fused on wavefront"] == why, record["rejected"]
