"""A clock for timing tests: it moves only when a fake step says so.

Used through the `fake_clock` fixture (tests/conftest.py), which makes it
the tuner's clock (`rnnfuse.tuning.clock.using_clock`) for one test: a fake
step calls `advance(seconds)` instead of sleeping, so every prune, race and
first-call decision sees exactly the costs the test gave.
"""

from __future__ import annotations


class FakeClock:
    """Seconds since the test began, advanced only by the test's steps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def step(self, seconds: float, calls: list, name: str):
        """A step that records `name` in `calls` and costs `seconds`."""

        def run():
            calls.append(name)
            self.advance(seconds)

        return run
