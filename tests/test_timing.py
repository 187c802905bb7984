"""rnnfuse.tuning.timing: interleaved medians."""

from __future__ import annotations

import numpy as np

from rnnfuse.tuning.timing import interleaved_medians, sync


def test_every_step_runs_warmup_plus_repeats_times_interleaved():
    order = []
    steps = {name: (lambda name=name: order.append(name) or np.zeros(2)) for name in "abc"}
    seen = []
    result = interleaved_medians(steps, warmup=1, repeats=4, on_step=seen.append)
    assert sorted(result) == ["a", "b", "c"]
    assert all(len(r["times"]) == 4 and r["median"] >= 0 for r in result.values())
    assert order[:3] == ["a", "b", "c"]  # the warm-up calls
    # Timed rounds start at a different step each time.
    assert seen[:6] == ["a", "b", "c", "b", "c", "a"]
    assert len(order) == 3 * (1 + 4)


def test_sync_accepts_nested_results_and_plain_values():
    sync({"x": np.ones(3), "y": [np.zeros(1), 2.0]})
