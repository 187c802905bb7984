"""The online-agreement benchmark's verdicts (bench/bench_online_agreement.py):
the issue's target is read from them."""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_online_agreement as agreement  # noqa: E402

FULL = {"chosen": "fused", "timings_ms": {"fused": 10.0, "split 2+2": 10.3, "per-layer": 20.0}}


def test_a_different_choice_is_read_from_full_timings_medians():
    assert agreement.judge(FULL, {"chosen": "fused"})["verdict"] == "agrees"
    near = agreement.judge(FULL, {"chosen": "split 2+2"})
    assert near["verdict"] == "within 5%" and abs(near["ratio"] - 1.03) < 1e-9
    assert agreement.judge(FULL, {"chosen": "per-layer"})["verdict"] == "slower"
    assert agreement.judge(FULL, {"chosen": "wavefront"})["verdict"] == "unmeasured"


def test_the_target_needs_nine_in_ten_agreeing_and_no_slower_choice():
    agree = {"verdict": "agrees", "ratio": 1.0}
    near = {"verdict": "within 5%", "ratio": 1.04}
    assert agreement.summarize([agree] * 9 + [near])["met"]
    assert not agreement.summarize([agree] * 8 + [near] * 2)["met"]
    assert not agreement.summarize([agree] * 19 + [{"verdict": "slower", "ratio": 1.3}])["met"]
    assert not agreement.summarize([agree] * 19 + [{"verdict": "unmeasured", "ratio": None}])["met"]
    assert not agreement.summarize([])["met"]
