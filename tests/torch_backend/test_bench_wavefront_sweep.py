"""bench/bench_wavefront.py's `sweep` mode on the CPU: the shapes it draws
cover the ranges it promises (1-8 layers, 64-1024 units, batch 1-256,
T 1-2000, lengths, both directions, both kinds and dtypes) within the
float64 reference's caps, and its one-line summary counts each outcome,
groups the refusals by kind and names the worst error over its tolerance.
The cases themselves need a Hopper GPU: `tools/gpu/batch.sh wavefront-sweep`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_wavefront.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_wavefront_sweep_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    saved = dict(sys.modules)
    try:
        spec.loader.exec_module(module)
    finally:  # the bench installs stand-in packages for rnnfuse's modules
        for name in set(sys.modules) - set(saved):
            if name.startswith("rnnfuse"):
                del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if k.startswith("rnnfuse")})
    return module


def test_the_cases_cover_the_promised_ranges_within_the_reference_caps(bench):
    cases = bench.sweep_cases(600, seed=3)
    assert len(cases) == 600
    kinds, directions, layers, units, batch, steps, inputs, dtypes, lengths = zip(*cases)
    assert set(kinds) == {"lstm", "gru"} and set(directions) == {1, 2}
    assert set(dtypes) == {"float16", "bfloat16"} and set(lengths) == {True, False}
    assert set(layers) == set(range(1, 9))
    assert 64 <= min(units) and max(units) <= 1024
    assert any(u % 8 for u in units) and sum(u % 8 == 0 for u in units) > 400
    assert min(batch) == 1 and max(batch) <= 256 and max(batch) > 200
    assert min(steps) == 1 and max(steps) <= 2000 and max(steps) > 1000
    for kind, d, l, u, b, t, *_ in cases:
        assert t * b * d * u <= bench.SWEEP_MAX_ELEMENTS or t == 1
        assert t * l <= bench.SWEEP_MAX_LAYER_STEPS
        assert d * l * t * b * u * u <= bench.SWEEP_MAX_WORK or t == 1
    assert bench.sweep_cases(50, seed=3) == cases[:50]  # a seed replays its cases


def test_refusals_that_differ_only_in_their_numbers_are_one_kind(bench):
    a = bench._reason_key("the stack's weights do not fit on chip for the wavefront kernel: "
                          "8 layers of 512 units need at least 256 CTAs")
    b = bench._reason_key("the stack's weights do not fit on chip for the wavefront kernel: "
                          "2 layers of 1024 units need at least 256 CTAs")
    assert a == b == "the stack's weights do not fit on chip for the wavefront kernel"
    assert bench._reason_key("the wavefront kernel needs units a multiple of 8, not 100") != a


def _row(status, path, ratio=None, reason=None, layers=4):
    row = dict(status=status, path=path, kind="lstm", directions=1, layers=layers, units=512,
               batch=64, steps=100, dtype="float16")
    if ratio is not None:
        row.update(ratio=ratio, tol=1e-3, err_vs_f64={"y": ratio * 1e-3})
    if reason:
        row["reason"] = reason
    return row


def test_the_summary_counts_each_outcome_and_names_the_worst_case(bench):
    rows = [
        _row("ok", "kernel", 0.2),
        _row("ok", "segments 4+4", 0.3, "the stack's weights do not fit on chip: 8 layers",
             layers=8),
        _row("fallback", "cudnn", 0.1, "the wavefront kernel needs units a multiple of 8, not 9"),
        _row("FAIL", "kernel", 2.5, layers=2),
        dict(case=[], status="ERROR", error="RuntimeError: boom"),
    ]
    line = bench.sweep_summary(rows, 12.0)
    assert line.startswith("sweep: 5 cases in 12 s, 2 passed on the kernel (kernel 1, segments 1)")
    assert "1 refused and exact on cuDNN, 2 FAILED" in line
    assert "1x the stack's weights do not fit on chip" in line
    assert "1x the wavefront kernel needs units a multiple of" in line
    assert "worst error 2.50e-03 vs tol 1.00e-03 (x2.50; lstm 1d 2x512" in line
