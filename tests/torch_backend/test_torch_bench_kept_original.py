"""bench/bench_kept_original.py's own logic, on the CPU with a tiny cell:
both models run, the optimized one keeps the original layers through its
FusedRNN (the tuner's pinned decision), and every entry point gets its
paired ratio."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "bench")
sys.path.insert(0, BENCH)

import bench_kept_original  # noqa: E402


def test_quick_run_writes_paired_ratios_for_every_entry_point(tmp_path):
    out = tmp_path / "kept.json"
    assert bench_kept_original.main(["--quick", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert "error" not in row, row
    assert row["plans"] == ["per-layer"]
    for entry in bench_kept_original.ENTRY_POINTS:
        reading = row[entry]
        assert len(reading["ratios"]) == row["rounds"] and reading["ratio"] > 0
        lo, hi = reading["interval_95"]
        assert lo <= reading["ratio"] <= hi
        # Each round's ms a step, whose quotients are the ratios.
        pairs = zip(reading["original_round_ms"], reading["optimized_round_ms"])
        assert [o / k for o, k in pairs] == pytest.approx(reading["ratios"])


def test_the_collector_stays_out_of_the_timed_calls_and_comes_back():
    import gc

    assert gc.isenabled()
    with bench_kept_original.collector_between_calls() as collect:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collect("original")  # between timed calls: the young generations
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_examples_hold():
    import doctest

    result = doctest.testmod(bench_kept_original)
    assert result.attempted > 0 and result.failed == 0


def test_fewer_than_15_rounds_is_refused_outside_a_smoke_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_kept_original.main(["--rounds", "5", "--out", str(tmp_path / "x.json")])
    assert "15 rounds" in capsys.readouterr().err
