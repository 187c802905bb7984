"""Online tuning: the candidate plans race on the fit's own training steps.

Every candidate computes the same function within float tolerance, so
with online tuning on (`AutoTune.online`) a `fit` whose first batch's
bucket has no decision runs the candidates on its first steps, one a step
in rotating rounds, with real updates. The exactness checks run together,
on one set of weights, before the first candidate's first step after the
original layers'. Where the call's length is known, the race spends what
offline timing may (`budget.TuningBudget`, each race on the steps left):
the original layers take two steps first, and another candidate starts only
where its start (its first step's extra time, priced by the costliest start
like it so far, sharing a trace or not, else by the original layers' first
step; the checks, priced alike, with the first, then as they took) fits in
what the race has not spent. After `warmup` untimed steps and `repeats` timed rounds (pruned at
PRUNE from the first, at WARM_PRUNE and to the WARM_KEEP fastest on the
last warm-up step, and where an eager first step was clearly slow), the
fastest is committed once, unless the original layers come within
`KEEP_ORIGINAL_MARGIN` of it. `overhead()` is the race's cost over running
the winner on its steps.

>>> race = OnlineRace(["per-layer", "fused"], warmup=0, repeats=3)
>>> seconds = {"per-layer": 2.0, "fused": 1.0}
>>> while race.committed is None:
...     name = race.next()
...     race.record(name, seconds[name])
>>> race.committed, race.steps_run, race.overhead()
('fused', 4, 2.0)
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

from rnnfuse.plan import PER_LAYER
from rnnfuse.tuning import clock
from rnnfuse.tuning.budget import TuningBudget
from rnnfuse.tuning.plans import whole_run_twins

__all__ = ["OnlineRace"]

# As the offline tuner (`tuner.PRUNE`, `tuner.KEEP_ORIGINAL_MARGIN`).
PRUNE = 1.5
KEEP_ORIGINAL_MARGIN = 0.10
# A candidate whose last warm-up step took this many times the fastest
# one's runs no timed round: each of its steps is a slow real step.
WARM_PRUNE = 2.0
# Only the fastest few go on: each candidate's step adds to the race's cost.
WARM_KEEP = 3


class OnlineRace:
    """Which candidate each of a fit's first steps runs, and the commit:
    `names` (the original layers among them as the baseline), `warmup`
    untimed steps after each one's first, `repeats` timed rounds, `check`
    name -> whether it passes the exactness check. `later` {split: twin}:
    a split joins only if its twin was within PRUNE of the fastest warm-up
    step (the offline tuner's second stage); with no warm-up, all race.
    `budget`: the call's (None: unknown length, every candidate starts);
    `shares_trace` name -> whether its first step reuses a traced step."""

    def __init__(self, names: Sequence[str], *, warmup: int = 1, repeats: int = 5,
                 check: Callable[[str], bool] | None = None, baseline: str = PER_LAYER.name,
                 later: dict[str, str] | None = None, budget: TuningBudget | None = None,
                 shares_trace: Callable[[str], bool] | None = None):
        if not names:
            raise ValueError("OnlineRace needs at least one candidate; received none")
        self.names = list(dict.fromkeys(names))
        self.warmup, self.repeats, self.baseline = int(warmup), int(repeats), baseline
        self.check = check or (lambda name: True)
        self.budget, self.shares_trace = budget, shares_trace or (lambda name: False)
        self.check_s: dict[str, float] = {}  # each exactness check's seconds
        self._started: dict[str, bool] = {}  # name -> whether it shared a trace
        self._start_cost: dict[str, tuple[bool, float]] = {}
        self._excess = 0.0  # the other candidates' steps beyond the original layers'
        self.cut = False  # whether the call's length left a candidate out
        self.times: dict[str, list[float]] = {n: [] for n in self.names}
        self.rejected: dict[str, str] = {}
        self.pruned: set[str] = set()
        self.committed: str | None = None
        self.steps_run = 0
        self.spent = 0.0  # seconds of every step run, untimed ones included
        self.first: dict[str, float] = {}  # each candidate's first step
        self._untimed = {n: 1 + self.warmup for n in self.names}
        self._warm: dict[str, float] = {}
        self._round, self._queue = 0, []
        self.later = dict(later or {}) if self.warmup > 0 else {}
        self._waiting = set(self.later) & set(self.names)
        self.skipped: dict[str, str] = {}  # candidates left out before a step, and why
        self._warm_done = False
        self._firsts_judged = self.warmup == 0  # a compiling first step says nothing
        self._priced = budget is not None and baseline in self.names

    def running(self) -> list[str]:
        """The candidates still in the race, in their order."""
        return [n for n in self.names
                if n not in self.rejected and n not in self.pruned and n not in self._waiting]

    def next(self) -> str:
        """The candidate the next step runs (the committed one once decided)."""
        while self.committed is None:
            while not self._queue:
                self._fill()
                if self.committed is not None:
                    return self.committed
            if self._queue[0] in self._started or self._start(self._queue[0]):
                return self._queue[0]
            self._queue.pop(0)
        return self.committed

    def _start(self, name: str) -> bool:
        """Before `name`'s first step: whether the call can pay for it (and
        the checks, the first time), then whether it passed its check."""
        if name in self.rejected or not self._affordable(name):
            return False
        if name != self.baseline and not self.check_s:
            for other in [n for n in self.names if n not in self.pruned]:  # one set of weights
                start = clock.now()
                if not self.check(other):
                    self.rejected[other] = "failed the exactness check"
                self.check_s[other] = clock.now() - start
            if name in self.rejected or not self._affordable(name):  # at the checks' real cost
                return False
        self._started[name] = self.shares_trace(name)
        return True

    def _affordable(self, name: str) -> bool:
        """Whether `name`'s start fits in the budget left (else it leaves the race)."""
        cost = self._start_price(name)
        if cost is None or self._spent() + cost <= self.budget.seconds(self._base_step()):
            return True
        self.pruned.add(name)
        self.cut = True
        self.skipped[name] = (f"not run: its start (about {cost:.2f} s) was over what "
                              f"is left of the call's budget ({self.budget.steps} steps: "
                              f"{self.budget.seconds(self._base_step()):.2f} s)")
        return False

    def _start_price(self, name: str) -> float | None:
        """The seconds `name`'s start may add (None: not priced)."""
        base = self._base_step()
        if not self._priced or name == self.baseline or base is None:
            return None
        prior = max(0.0, self.first[self.baseline] - base)
        like = [cost for shared, cost in self._start_cost.values() if shared == self.shares_trace(name)]
        return (max(like) if like else prior) + (0.0 if self.check_s else prior)

    def _base_step(self) -> float | None:
        """The original layers' step after their first (warm-up or timed)."""
        timed = self.times.get(self.baseline)
        return self._warm.get(self.baseline, timed[0] if timed else None)

    def _spent(self) -> float:
        """The race's cost so far beyond running the original layers."""
        return max(0.0, self._excess) + sum(self.check_s.values())

    def record(self, name: str, seconds: float) -> None:
        """The step `next()` gave ran `name` and took `seconds`."""
        if self.committed is not None:
            return
        if not self._queue or self._queue[0] != name:
            raise ValueError(f"OnlineRace.record: expected a step of {self._queue[:1]}, "
                             f"received one of {name!r}")
        self._queue.pop(0)
        self.steps_run += 1
        self.spent += float(seconds)
        base = self._base_step()
        if name != self.baseline and base is not None:
            self._excess += float(seconds) - base
            if name not in self.first:
                self._start_cost[name] = (self._started.get(name, False), max(0.0, seconds - base))
        if self._untimed[name] > 0:
            self.first.setdefault(name, float(seconds))
            self._untimed[name] -= 1
            if self._untimed[name] == 0 and self.warmup > 0:
                self._warm[name] = float(seconds)  # a warm step, not the first call
        else:
            self.times[name].append(float(seconds))
        if not self._queue:
            self._end_of_round()

    def overhead(self) -> float:
        """Seconds beyond as many of the committed candidate's steps (0 before)."""
        median = self.medians().get(self.committed)
        if median is None:
            return 0.0
        return max(0.0, self.spent - self.steps_run * median)

    def medians(self) -> dict[str, float]:
        """name -> median seconds of its timed steps (those timed so far)."""
        return {n: statistics.median(t) for n, t in self.times.items() if t}

    def _fill(self) -> None:
        running = self.running()
        if not running:
            self.committed = self.baseline
            return
        if not self._firsts_judged and all(n in self.first for n in running):
            self._firsts_judged = True
            self._prune_slow_first_steps(running)
            running = self.running()
        warming = [n for n in running if self._untimed[n] > 0]
        if warming:
            if self._priced and self.baseline in running and self._base_step() is None:
                warming = [self.baseline]  # its step after its first prices the others' starts
            self._queue = warming
            return
        if self._round == 0 and self._warm and not self._warm_done:
            fastest = min(self._warm.values())
            self.pruned.update(n for n in running if self._warm.get(n, 0.0) > WARM_PRUNE * fastest)
            if self._waiting:
                self._admit(fastest)
                return  # the next fill queues the admitted ones' warm-ups
            by_speed = sorted(self.running(), key=lambda n: self._warm.get(n, 0.0))
            self.pruned.update(by_speed[WARM_KEEP:])
            self._warm_done = True
            running = self.running()
        if self._round >= self.repeats or (self._round >= 1 and len(running) == 1):
            self._commit()
            return
        r = self._round % len(running)
        self._queue = running[r:] + running[:r]

    def _prune_slow_first_steps(self, running) -> None:
        """As the offline tuner's eager first calls: a clearly slow first step
        ends a candidate (the race's first, the fit's set-up, not judged)."""
        from rnnfuse.tuning.tuner import PRUNE as OFFLINE_PRUNE, clearly_slow_first_calls

        judged = {n: self.first[n] for n in running}
        judged.pop(next(iter(self.first)), None)
        fastest = min(judged.values(), default=0.0)
        for n in clearly_slow_first_calls(judged):
            self.pruned.add(n)
            self.skipped[n] = (f"not timed: its first step took {judged[n]:.2f} s, over "
                               f"{OFFLINE_PRUNE**2:g}x the fastest first step ({fastest:.2f} s)")

    def _admit(self, fastest: float) -> None:
        """The second stage: splits whose twin runs, within PRUNE of `fastest`."""
        running = set(self.running())
        admitted = {n for n in self._waiting
                    if self.later[n] in running and self._warm.get(self.later[n], fastest) <= PRUNE * fastest}
        for n in self._waiting - admitted:
            twin = self.later[n]
            self.skipped[n] = (f"not run: {twin} was over {PRUNE}x the fastest on its warm-up step"
                               if twin in running else f"not run: {twin} left the race")
        self.pruned.update(self._waiting - admitted)
        self._waiting = set()

    def end(self) -> None:
        """The call ended first: commits what was timed (nothing where nothing
        was), the candidates left untimed recorded so and the race cut."""
        if self.committed is not None or not self.medians():
            return
        untimed = [n for n in self.running() + sorted(self._waiting) if not self.times[n]]
        self.skipped.update({n: "not timed: the fit ended first" for n in untimed})
        self.cut = self.cut or bool(untimed)
        self._commit()

    def _end_of_round(self) -> None:
        if any(self._untimed[n] > 0 or not self.times[n] for n in self.running()):
            return  # a warm-up round (the original layers' priced step is timed early)
        self._round += 1
        if self._round >= 1:
            medians = self.medians()
            best = min(medians.values())
            for n in self.running():
                if self.times[n] and min(self.times[n]) > PRUNE * best:
                    self.pruned.add(n)

    def _commit(self) -> None:
        medians = self.medians()
        exact = {n: t for n, t in medians.items() if n not in self.rejected}
        if not exact:
            self.committed = self.baseline
            return
        best = min(exact, key=exact.get)
        base = exact.get(self.baseline)
        if base is not None and best != self.baseline and exact[best] > (
                1 - KEEP_ORIGINAL_MARGIN) * base:
            best = self.baseline
        self.committed = best


class OnlineFit:
    """One `fit`'s online tuning: its step function while the races run, one
    member at a time, each winner committed once.

    `state` is the model's `per_shape.AutoTune`; `races` [(member, bucket,
    shape, {name: Plan})]; `make()` Keras' train function for the plans set
    now (built once per `trace_key(member, plan)`: candidates with one key,
    such as plans that differ only in a runtime cuDNN algorithm, share it;
    default: one each); `apply`, `record` and `install` set a plan, keep a
    decision and install the final train function; `check` and
    `measure_step` are the exactness check and the step timer. `record`
    also gets the race's cost: its overhead over the winner's steps and its
    exactness checks' seconds (`cost`: steps, cut, overhead_s, check_s, first_s;
    `cut`: the call's length left a candidate out, so the decision is not cached).
    `budget`: the fit's (`budget.TuningBudget`; None: unknown length).
    """

    def __init__(self, races, *, make, apply, record, install, check=None, measure_step=None,
                 warmup: int = 1, repeats: int = 5, trace_key=None, budget=None):
        self.races = list(races)
        self.make, self.apply, self.record, self.install = make, apply, record, install
        self.trace_key = trace_key or (lambda index, plan: plan.name)
        self.check = check or (lambda index, plan: True)
        self.measure_step = measure_step or _wall_clock_step
        self.warmup, self.repeats = warmup, repeats
        self.budget, self.steps_run = budget, 0
        self.functions: dict = {}
        self.switches: list = []
        self.final = None  # the train function once every race is committed
        self._start_race()

    @property
    def done(self) -> bool:
        return self.race is None

    def _start_race(self) -> None:
        if not self.races:
            self.race = None
            return
        index, bucket, shape, plans = self.races[0]
        self.functions = {}
        self.race = OnlineRace(
            list(plans), warmup=self.warmup, repeats=self.repeats,
            check=lambda name: self.check(index, plans[name]),
            later=whole_run_twins(list(plans.values())),
            budget=None if self.budget is None else dataclasses.replace(
                self.budget, steps=max(self.budget.steps - self.steps_run, 0)),
            shares_trace=lambda name: self.trace_key(index, plans[name]) in self.functions)

    def __call__(self, *args, **kwargs):
        """One step of the fit: a candidate's real step, timed, or (decided)
        the committed plan's function."""
        if self.race is None:
            return self.final(*args, **kwargs)
        name = self.race.next()
        if self.race.committed is not None:
            self._commit()
            return self(*args, **kwargs)
        index, bucket, shape, plans = self.races[0]
        function = self._function(index, bucket, name, plans[name])
        logs, seconds = self.measure_step(name, lambda: function(*args, **kwargs))
        self.steps_run += 1
        self.race.record(name, seconds)
        if self.race.committed is not None:
            self._commit()
        return logs

    def finish(self) -> None:
        """Commits what has been timed (a fit that ended before its races
        did); the races not started keep their members' current plans."""
        if self.race is None:
            return
        self.race.end()
        if self.race.committed is not None:
            self._commit(last=True)
        else:
            self.races, self.race = [], None
            self.install(None)

    def _function(self, index, bucket, name, plan):
        key = self.trace_key(index, plan)
        self.apply(index, bucket, plan)
        if key not in self.functions:
            self.functions[key] = self.make()
        return self.functions[key]

    def _commit(self, last: bool = False) -> None:
        from rnnfuse.tuning.tuner import TuneResult

        index, bucket, shape, plans = self.races.pop(0)
        name = self.race.committed
        plan = plans[name]
        rejected = dict(self.race.rejected)
        rejected.update({n: "not run: pruned in the online race" for n in self.race.pruned
                         if not self.race.times.get(n)})
        rejected.update(self.race.skipped)
        self.apply(index, bucket, plan)
        self.switches.append((index, name))
        function = self.functions.get(self.trace_key(index, plan))
        cost = dict(steps=self.race.steps_run, cut=self.race.cut, overhead_s=self.race.overhead(),
                    check_s=sum(self.race.check_s.values()), first_s=dict(self.race.first))
        self.record(index, shape, TuneResult(
            None, plan, "measured: online, cut short by the call's length" if self.race.cut
            else "measured: online, on the fit's own steps", self.race.medians(), rejected),
            cost)
        if last:
            # The fit is over: the next makes its function anew for the committed plans.
            self.races, self.race = [], None
            self.final = None
            self.install(None)
            return
        self._start_race()
        if self.race is None:
            # The one switch: the fit's later steps call the winner's own
            # function, without this wrapper.
            self.final = function if function is not None else self.make()
            self.install(self.final)


def _wall_clock_step(name, run):
    from rnnfuse.tuning import clock
    from rnnfuse.tuning.timing import sync

    start = clock.now()
    logs = run()
    sync(logs)
    return logs, clock.now() - start
