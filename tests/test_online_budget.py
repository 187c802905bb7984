"""The online race spends what offline timing may (rnnfuse/tuning/online.py):
with the call's length known, the original layers' first and warm-up steps
price every other start, and a start that would overrun the call's budget is
skipped. Steps are fake seconds; the checks advance the fake clock."""

from __future__ import annotations

import pytest

from rnnfuse.tuning import online
from rnnfuse.tuning.budget import TuningBudget

FIRST = {"per-layer": 2.0, "fused": 2.2, "fused @ps": 1.0, "wavefront": 2.0}
LATER = {"per-layer": 1.0, "fused": 0.5, "fused @ps": 0.4, "wavefront": 0.45}


def _race(fake_clock, steps, names=tuple(FIRST), failing=(), warmup=1):
    checked = []

    def check(name):
        checked.append((name, len(ran)))
        fake_clock.advance(0.1)
        return name not in failing

    race = online.OnlineRace(list(names), warmup=warmup, repeats=3, check=check,
                             budget=None if steps is None else TuningBudget(steps=steps),
                             shares_trace=lambda name: name == "fused @ps")
    ran = []
    while race.committed is None and len(ran) < 200:
        name = race.next()
        race.record(name, (LATER if name in ran else FIRST)[name])
        ran.append(name)
    return race, ran, checked


@pytest.mark.parametrize("warmup", [1, 0])  # torch, TensorFlow
def test_a_call_too_short_for_any_start_runs_the_original_layers_and_checks_nothing(fake_clock,
                                                                                   warmup):
    race, ran, checked = _race(fake_clock, steps=60, warmup=warmup)
    # 3% of 60 steps of 1 s: 1.8 s, less than a start priced at the original
    # layers' own first step (1 s over its warm step) and the checks (as much).
    assert race.committed == "per-layer" and set(ran) == {"per-layer"}
    assert checked == [] and race.check_s == {}
    assert race.skipped["fused"] == ("not run: its start (about 2.00 s) was over what is left "
                                     "of the call's budget (60 steps: 1.80 s)")
    assert set(race.skipped) == {"fused", "fused @ps", "wavefront"}


@pytest.mark.parametrize("warmup", [1, 0])
def test_each_start_is_priced_by_the_last_like_it(fake_clock, warmup):
    race, ran, checked = _race(fake_clock, steps=90, warmup=warmup)  # a budget of 2.7 s
    # The checks ran once, together, after the original layers' first two steps.
    assert ran[:3] == ["per-layer", "per-layer", "fused"]
    assert [n for n, _ in checked] == list(FIRST) and {at for _, at in checked} == {2}
    # fused's start cost 1.2 s over a step, +0.4 s of checks: 1.6 s spent.
    # fused @ps shares its trace, priced by the prior (1 s): it starts; the
    # wavefront, a new trace, priced at fused's 1.2 s, would overrun the budget.
    assert "fused @ps" in ran and "wavefront" not in ran
    assert race.skipped == {"wavefront": "not run: its start (about 1.20 s) was over what is "
                                         "left of the call's budget (90 steps: 2.70 s)"}
    assert race.committed == "fused @ps"


def test_a_long_call_starts_every_candidate_and_a_failed_check_still_rejects(fake_clock):
    race, ran, checked = _race(fake_clock, steps=100_000, failing={"fused @ps"})
    assert not race.skipped and race.rejected == {"fused @ps": "failed the exactness check"}
    assert "fused @ps" not in ran and {"fused", "wavefront"} <= set(ran)
    assert race.committed == "wavefront"
    assert sum(race.check_s.values()) == pytest.approx(0.4)


def test_a_call_of_unknown_length_races_as_before(fake_clock):
    """No budget: every candidate's first step in the first round, the
    checks before the first one after the original layers'."""
    race, ran, checked = _race(fake_clock, steps=None)
    assert ran[:4] == list(FIRST) and {at for _, at in checked} == {1}
    assert not race.skipped


@pytest.mark.parametrize("repeats", [1, 5])
def test_the_original_layers_early_timed_step_leaves_the_others_every_round(repeats):
    """TensorFlow (no warm-up): the original layers' second step is timed
    before the others' first; each other candidate still gets `repeats`."""
    race = online.OnlineRace(["per-layer", "fused"], warmup=0, repeats=repeats,
                             budget=TuningBudget(steps=10**6))
    seen = set()
    while race.committed is None:
        name = race.next()
        if race.committed is None:
            race.record(name, {"per-layer": 1.0, "fused": 0.8}[name] + (2.0 if name not in seen else 0.0))
            seen.add(name)
    assert race.committed == "fused" and len(race.times["fused"]) == repeats


def test_a_candidate_that_failed_its_check_is_not_priced(fake_clock):
    race, ran, checked = _race(fake_clock, steps=75, names=("per-layer", "fused", "wavefront"),
                               failing={"wavefront"})
    assert race.rejected == {"wavefront": "failed the exactness check"}
    assert not race.skipped and not race.cut


def test_the_first_start_is_priced_again_at_what_the_checks_took(fake_clock):
    """Checks of 2 s each (8 s) overrun a 2.7 s budget priced at 2 s: the
    start they came with does not run, nor any after it."""
    def slow_check(name):
        fake_clock.advance(2.0)
        return True

    race = online.OnlineRace(list(FIRST), warmup=1, repeats=3, check=slow_check,
                             budget=TuningBudget(steps=90))
    ran = []
    while race.committed is None:
        name = race.next()
        if race.committed is None:
            race.record(name, (LATER if name in ran else FIRST)[name])
            ran.append(name)
    assert set(ran) == {"per-layer"} and race.committed == "per-layer" and race.cut
    assert race.skipped["fused"].startswith("not run: its start (about 1.00 s)")


def test_a_fit_that_ends_before_its_race_commits_what_it_timed_uncached():
    from rnnfuse.plan import PER_LAYER, Plan

    plans = {p.name: p for p in [PER_LAYER, Plan((3,)), Plan((2, 1))]}
    records = []
    fit = online.OnlineFit([(0, None, (8, 10, 4), plans)], make=lambda: (lambda: None),
                           apply=lambda *a: None, install=lambda f: None,
                           record=lambda i, shape, result, cost: records.append((result, cost)),
                           measure_step=lambda name, run: (run(), 1.0), warmup=0, repeats=5,
                           budget=TuningBudget(steps=10**4))
    fit(), fit()  # the original layers' first two steps
    fit.finish()
    ((result, cost),) = records
    assert cost["cut"] and result.source == "measured: online, cut short by the call's length"
    assert result.rejected["fused"] == "not timed: the fit ended first"
