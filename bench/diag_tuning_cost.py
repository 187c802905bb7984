"""Where first-batch tuning's seconds go: per candidate plan, its trace, its
first call (graph optimisation, cuDNN's set-up, one run), and the timed
calls; then the gradient check, for one user-view cell's first `fit` and
first `predict`.

Made for the tuning-overhead target of docs/benchmarks.md (tuning of the
median drawn model against 10 epochs of it): it says which of tracing,
cuDNN's set-up, timing and the float64 gradient check to cut. It wraps the
tuner's own functions (`_first_calls`, `interleaved_medians`,
`GradientCheck`), so the figures are those of a real first-batch tuning;
`--profile` adds cProfile's top functions by cumulative time.

    python bench/diag_tuning_cost.py --cells 15,A1 --out $OUT/tuning_cost.json
    python bench/diag_tuning_cost.py --quick --out /tmp/t.json   # tiny, any machine
    python bench/diag_tuning_cost.py --table bench/results/tuning_cost_tf_h200_s6.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import _tuning_seconds, build, cell_shape, data  # noqa: E402
from report_user_view import shape_text  # noqa: E402
from rnnfuse.tuning import tuner  # noqa: E402


class Recorder:
    """Wraps the tuner's phases for one `with` block and keeps their times."""

    def __init__(self):
        self.candidates: dict[str, dict] = {}
        self.phases = {"first_calls_s": 0.0, "timing_s": 0.0, "gradient_check_s": 0.0}
        self.gradient_checks = []

    def __enter__(self):
        self._saved = (tuner._first_calls, tuner.interleaved_medians, tuner.GradientCheck.__call__)
        first_calls, medians, check = self._saved
        rec = self

        def timed_first_calls(steps, plans):
            start = time.perf_counter()
            for name, step in steps.items():
                row = rec.candidates.setdefault(name, {})
                concrete = getattr(step, "get_concrete_function", None)
                if concrete is not None:
                    t = time.perf_counter()
                    concrete()
                    row["trace_s"] = time.perf_counter() - t
            out = first_calls(steps, plans)  # each step's first call, as tuning runs it
            rec.phases["first_calls_s"] += time.perf_counter() - start
            return out

        def timed_medians(steps, **kwargs):
            start = time.perf_counter()
            stats = medians(steps, **kwargs)
            rec.phases["timing_s"] += time.perf_counter() - start
            for name, s in stats.items():
                row = rec.candidates.setdefault(name, {})
                row.update(median_ms=1e3 * s["median"], timed_calls=len(s["times"]), pruned=s["pruned"])
            return stats

        def timed_check(self_, group, plan, shape, dtype):
            start = time.perf_counter()
            try:
                return check(self_, group, plan, shape, dtype)
            finally:
                seconds = time.perf_counter() - start
                rec.phases["gradient_check_s"] += seconds
                rec.gradient_checks.append(dict(plan=plan.name, seconds=seconds))

        tuner._first_calls, tuner.interleaved_medians = timed_first_calls, timed_medians
        tuner.GradientCheck.__call__ = timed_check
        return self

    def __exit__(self, *exc):
        tuner._first_calls, tuner.interleaved_medians, tuner.GradientCheck.__call__ = self._saved
        return False


def _tune(fast, run, profile: bool) -> dict:
    """Runs `run()` (a first fit or predict) with its tuning recorded."""
    before = _tuning_seconds(fast)
    profiler = cProfile.Profile() if profile else None
    with Recorder() as rec:
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        run()
        call_s = time.perf_counter() - start
        if profiler:
            profiler.disable()
    out = dict(
        tuning_s=_tuning_seconds(fast) - before,
        call_s=call_s,
        phases=rec.phases,
        candidates=rec.candidates,
        gradient_checks=rec.gradient_checks,
    )
    out["phases"]["trace_s"] = sum(c.get("trace_s", 0.0) for c in rec.candidates.values())
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def measure(shape: dict, profile: bool) -> dict:
    model = build(shape)
    x, y = data(shape, np.random.default_rng(0))
    fast = rnnfuse.optimize(model)
    fast.compile(optimizer="adam", loss="mse")
    b = shape["batch"]
    fit = _tune(fast, lambda: fast.fit(x, y, batch_size=b, epochs=1, verbose=0), profile)
    predict = _tune(fast, lambda: fast.predict(x, batch_size=b, verbose=0), profile)
    return dict(shape=shape, fit=fit, predict=predict,
                decisions=rnnfuse.tuning.first_batch.decisions(fast))


def table(rows: list[dict]) -> str:
    """A markdown table of saved rows: per cell and mode, the tuning's
    seconds and where they went. "first calls" is each candidate's first
    call less its trace (graph optimisation, cuDNN's set-up, one run)."""
    lines = [
        "| cell | model | mode | candidates (timed to the end) | tuning s | traces s | first calls s | timing s | gradient check s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        model = shape_text(row["shape"])
        for mode in ("fit", "predict"):
            r = row[mode]
            ph = r["phases"]
            kept = sum(1 for c in r["candidates"].values() if not c.get("pruned"))
            lines.append(
                f"| {row['cell']} | {model} | {mode} | {len(r['candidates'])} ({kept}) | {r['tuning_s']:.1f} "
                f"| {ph['trace_s']:.1f} | {ph['first_calls_s'] - ph['trace_s']:.1f} | {ph['timing_s']:.1f} "
                f"| {ph['gradient_check_s']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", help="print the markdown table of a saved --out file and stop")
    parser.add_argument("--cells", default="15", help="drawn cell numbers (A1.. for anchors), comma-separated")
    parser.add_argument("--profile", action="store_true", help="add cProfile's top 30 functions")
    parser.add_argument("--quick", action="store_true", help="a tiny model, any machine")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if not args.out:
        parser.error("--out is required (or --table FILE)")
    rows = []
    for cell in args.cells.split(","):
        shape = cell_shape(cell)
        if args.quick:
            shape = dict(shape, layers=2, units=32, batch=4, steps=10)
        row = dict(cell=cell, backend=keras.backend.backend(), **measure(shape, args.profile))
        rows.append(row)
        for mode in ("fit", "predict"):
            r = row[mode]
            print(f"cell {cell} {mode}: tuning {r['tuning_s']:.2f} s; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
            for name, c in r["candidates"].items():
                print(f"    {name}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()))
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
