"""rnnfuse.tuning.timing: interleaved medians."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_prune_stops_running_a_clearly_slower_step_and_keeps_its_times(fake_clock):
    calls = []
    steps = {
        "fast": fake_clock.step(0.001, calls, "fast"),
        "close": fake_clock.step(0.0012, calls, "close"),
        "slow": fake_clock.step(0.03, calls, "slow"),
    }
    result = interleaved_medians(steps, warmup=1, repeats=6, prune=1.5)
    # The slow step ran its warm-up call only (30x > 1.5**2): its median is that call.
    assert calls.count("slow") == 1 and result["slow"]["pruned"]
    assert result["slow"]["times"] == [0.03] and result["slow"]["median"] == 0.03
    # The close ones raced every round.
    assert calls.count("fast") == calls.count("close") == 7
    assert not result["fast"]["pruned"] and len(result["close"]["times"]) == 6


def test_prune_after_a_timed_round_uses_the_smaller_factor(fake_clock):
    calls = []
    # 2x slower: within 1.5**2 after the warm-up, over 1.5x after round two.
    steps = {"fast": fake_clock.step(0.005, calls, "fast"), "slower": fake_clock.step(0.01, calls, "slower")}
    result = interleaved_medians(steps, warmup=1, repeats=6, prune=1.5)
    assert calls.count("slower") == 1 + 2 and result["slower"]["pruned"]
    # Alone after two rounds: nothing is left to race, so timing ends.
    assert calls.count("fast") == 1 + 2 and result["fast"]["median"] == pytest.approx(0.005)


def test_race_stops_a_step_clearly_behind_from_the_third_round(fake_clock):
    calls = []
    steps = {
        "best": fake_clock.step(0.010, calls, "best"),
        "close": fake_clock.step(0.0105, calls, "close"),
        "behind": fake_clock.step(0.0125, calls, "behind"),  # 1.25x: within prune, over race
    }
    interleaved_medians(steps, warmup=1, repeats=7, prune=1.5)
    assert calls.count("behind") == 1 + 7, "without race a 1.25x step runs every round"
    calls.clear()
    raced = interleaved_medians(steps, warmup=1, repeats=7, prune=1.5, race=1.2)
    assert calls.count("behind") == 1 + 3 and raced["behind"]["pruned"]
    assert calls.count("best") == calls.count("close") == 1 + 7


def _noisy(fake_clock, calls, name, mean, noise):
    """A step whose i-th call costs mean * (1 + noise[i]): the same calls
    whatever the schedule, so a raced session sees a prefix of a full one's."""
    count = [0]

    def run():
        calls.append(name)
        fake_clock.advance(mean * (1 + noise[count[0]]))
        count[0] += 1

    return run


def test_racing_keeps_what_full_timing_chooses(fake_clock):
    """Early stopping never drops the fastest: over 300 drawn sessions (five
    candidates, per-call noise up to 8%), the raced session chooses what the
    full one chooses wherever the two best differ by more than the noise,
    and never prunes the truly fastest step."""
    rng = np.random.default_rng(7)
    agree = clear = 0
    for _ in range(300):
        means = rng.uniform(1.0, 3.0, size=5) * 1e-3
        noise = {f"c{i}": rng.uniform(-0.08, 0.08, size=16) for i in range(5)}
        results = []
        for kwargs in ({}, {"prune": 1.5, "race": 1.2}):
            calls = []
            steps = {n: _noisy(fake_clock, calls, n, m, noise[n]) for n, m in zip(noise, means)}
            results.append(interleaved_medians(steps, warmup=1, repeats=7, **kwargs))
        full, raced = results
        fastest = f"c{int(np.argmin(means))}"
        assert not raced[fastest]["pruned"]
        first, second = sorted(means)[:2]
        if second > first * 1.17:  # beyond what 8% noise either way can swap
            clear += 1
            agree += min(full, key=lambda n: full[n]["median"]) == min(raced, key=lambda n: raced[n]["median"])
    assert clear > 100 and agree == clear


def test_without_prune_every_step_runs_every_round(fake_clock):
    calls = []
    steps = {"fast": fake_clock.step(0.0, calls, "fast"), "slow": fake_clock.step(0.01, calls, "slow")}
    result = interleaved_medians(steps, warmup=1, repeats=3)
    assert calls.count("slow") == 4 and not result["slow"]["pruned"]


def test_prune_must_be_above_one():
    with pytest.raises(ValueError, match="prune must be > 1"):
        interleaved_medians({"a": lambda: 1}, prune=1.0)
    with pytest.raises(ValueError, match=r"race must be in \(1, prune\]"):
        interleaved_medians({"a": lambda: 1}, prune=1.5, race=2.0)


def test_a_kept_step_is_not_raced_but_still_pruned(fake_clock):
    """`keep` (the tuner's baseline): a step 30% behind the best is raced
    out after three rounds, unless kept; a kept step 2x behind is still
    pruned."""
    def steps(calls):
        return {"fast": fake_clock.step(0.001, calls, "fast"),
                "base": fake_clock.step(0.0013, calls, "base"),
                "other": fake_clock.step(0.0013, calls, "other")}

    calls = []
    out = interleaved_medians(steps(calls), warmup=1, repeats=7, prune=1.5, race=1.2,
                              keep=("base",))
    assert len(out["base"]["times"]) == 7 and not out["base"]["pruned"]
    assert len(out["other"]["times"]) == 3 and out["other"]["pruned"]
    calls = []
    slow = {"fast": fake_clock.step(0.001, calls, "fast"), "base": fake_clock.step(0.002, calls, "base")}
    out = interleaved_medians(slow, warmup=1, repeats=7, prune=1.5, race=1.2, keep=("base",))
    assert out["base"]["pruned"] and len(out["base"]["times"]) < 7


def test_without_a_warmup_the_first_round_prunes_as_the_warmup_did(fake_clock):
    """warmup=0 (the tuner on TensorFlow, whose first call already ran the
    step): a step 3x slower than the best in the first timed round stops
    there, as its warm-up call would have stopped it; one 2x slower runs a
    second round before PRUNE stops it."""
    calls = []
    steps = {"fast": fake_clock.step(0.001, calls, "fast"), "twice": fake_clock.step(0.002, calls, "twice"),
             "thrice": fake_clock.step(0.003, calls, "thrice")}
    out = interleaved_medians(steps, warmup=0, repeats=7, prune=1.5, race=1.2)
    assert calls.count("thrice") == 1 and out["thrice"]["pruned"]
    assert calls.count("twice") == 2 and out["twice"]["pruned"]
    assert out["thrice"]["median"] == pytest.approx(0.003)


def test_beat_stops_a_step_that_cannot_beat_the_baseline_by_the_margin(fake_clock):
    """`beat` (0.9, with `keep`): a step 5% faster than the kept baseline
    cannot beat it by 10%; it stops after three rounds, and the race ends
    with the baseline alone. A step 15% faster runs every round, and so
    does the baseline."""
    calls = []
    steps = {"base": fake_clock.step(0.001, calls, "base"), "close": fake_clock.step(0.00095, calls, "close")}
    out = interleaved_medians(steps, warmup=0, repeats=7, prune=1.5, race=1.2, keep=("base",),
                              beat=0.9)
    assert out["close"]["pruned"] and not out["base"]["pruned"]
    assert calls.count("close") == 3 and calls.count("base") == 3
    calls = []
    steps = {"base": fake_clock.step(0.001, calls, "base"), "winner": fake_clock.step(0.00085, calls, "winner"),
             "close": fake_clock.step(0.00095, calls, "close")}
    out = interleaved_medians(steps, warmup=0, repeats=7, prune=1.5, race=1.2, keep=("base",),
                              beat=0.9)
    assert calls.count("winner") == 7 and calls.count("base") == 7 and calls.count("close") == 3
    assert not out["winner"]["pruned"] and out["close"]["pruned"]


def test_beat_needs_prune_and_a_baseline():
    with pytest.raises(ValueError, match=r"beat must be in \(0, 1\] with prune and keep set"):
        interleaved_medians({"a": lambda: 1}, prune=1.5, beat=0.9)
    with pytest.raises(ValueError, match=r"beat must be in \(0, 1\].*received beat=1.1"):
        interleaved_medians({"a": lambda: 1}, prune=1.5, keep=("a",), beat=1.1)


def _decision(stats: dict, base: str = "base", margin: float = 0.9) -> str:
    """The tuner's rule: the fastest other step, if it beats `base` by the
    margin, else `base`."""
    best = min((n for n in stats if n != base), key=lambda n: stats[n]["median"])
    return best if stats[best]["median"] < margin * stats[base]["median"] else base


def test_the_cut_timing_decides_what_full_timing_decides(fake_clock):
    """No warm-up call, the first round pruning, the race and `beat`
    together choose what seven full rounds after a warm-up choose: over 300
    drawn sessions (a baseline and four candidates 0.6-1.4x of it, per-call
    noise up to 8%), wherever the decision is clear beyond the noise (the
    best candidate 17% from the margin's line and from the runner-up), and
    they never stop the truly fastest step where it is the baseline or
    clearly beats it. (A candidate that cannot beat the baseline by the
    margin is stopped even where it is the fastest: the baseline is kept.)"""
    rng = np.random.default_rng(11)
    agree = clear = 0
    for _ in range(300):
        base = 1e-3
        means = dict(zip(["base", "c0", "c1", "c2", "c3"],
                         [base, *(rng.uniform(0.6, 1.4, size=4) * base)]))
        noise = {n: rng.uniform(-0.08, 0.08, size=16) for n in means}
        results = []
        for kwargs in ({"warmup": 1}, {"warmup": 0, "prune": 1.5, "race": 1.2,
                                        "keep": ("base",), "beat": 0.9}):
            calls = []
            steps = {n: _noisy(fake_clock, calls, n, m, noise[n]) for n, m in means.items()}
            results.append(interleaved_medians(steps, repeats=7, **kwargs))
        full, cut = results
        fastest = min(means, key=means.get)
        line = 0.9 * base
        if fastest == "base" or means[fastest] < line / 1.17:
            assert not cut[fastest]["pruned"]
        ranked = sorted(m for n, m in means.items() if n != "base")
        if not 1 / 1.17 < ranked[0] / line < 1.17 and ranked[1] > ranked[0] * 1.17:
            clear += 1
            agree += _decision(full) == _decision(cut)
    assert clear > 100 and agree == clear


def test_timing_reads_the_callers_clock_and_the_real_one_after():
    import time

    from rnnfuse.tuning.clock import current_clock, using_clock

    ticks = iter(float(i) for i in range(100))
    with using_clock(lambda: next(ticks)):
        out = interleaved_medians({"a": lambda: 1}, warmup=0, repeats=3)
    # Each call is read between two consecutive ticks.
    assert out["a"]["times"] == [1.0, 1.0, 1.0]
    assert current_clock() is time.perf_counter
