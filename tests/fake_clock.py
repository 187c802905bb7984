"""A clock for timing tests: it moves only when a fake step says so.

Used through the `fake_clock` fixture (tests/conftest.py), which makes it
the tuner's clock (`rnnfuse.tuning.clock.using_clock`) for one test: a fake
step calls `advance(seconds)` instead of sleeping, so every prune, race and
first-call decision sees exactly the costs the test gave.
"""

from __future__ import annotations


class FakeClock:
    """Seconds since the test began (from `start`), advanced by the test's
    steps and by `tick` at each read (a whole timed call reads it twice).

    >>> clock = FakeClock(tick=0.5)
    >>> clock(), clock()
    (0.5, 1.0)
    """

    def __init__(self, start: float = 0.0, tick: float = 0.0):
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def step(self, seconds: float, calls: list, name: str):
        """A step that records `name` in `calls` and costs `seconds`."""

        def run():
            calls.append(name)
            self.advance(seconds)

        return run


class FakeTimer:
    """A tuner `measure` that times nothing: fixed medians per candidate
    name (`default` seconds for the others); records the names of each
    call, and with `fail` raises as a device that went away would.

    >>> timer = FakeTimer({"fused": 0.5})
    >>> timer(["per-layer", "fused"]), timer.calls, timer.names
    ({'per-layer': {'median': 1.0}, 'fused': {'median': 0.5}}, 1, [['fused', 'per-layer']])
    """

    default = 1.0

    def __init__(self, medians, fail=False):
        self.medians, self.fail, self.names = medians, fail, []

    @property
    def calls(self) -> int:
        return len(self.names)

    def __call__(self, steps):
        self.names.append(sorted(steps))
        if self.fail:
            raise RuntimeError("the device went away")
        return {name: {"median": self.medians.get(name, self.default)} for name in steps}
