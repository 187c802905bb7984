"""Where a whole `predict` / `fit` call of an optimized model spends the
time the original model's call does not: per call wall times of both
models (interleaved, after their first calls), and cProfile's functions of
rnnfuse and of Keras' call set-up in the optimized model's calls.

Made for whole-call readings below a cell's step readings (a small model's
whole predict calls can lose a few ms a call to per-call set-up that its
steps do not show).

    python bench/diag_call_overhead.py --cells 20 --out $OUT/call_overhead.json
    python bench/diag_call_overhead.py --cells 20 --calls 3 --out /tmp/c.json  # any machine
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path  # noqa: E402

import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import CALL_STEPS, build, cell_shape, data  # noqa: E402
from report_user_view import shape_text  # noqa: E402


def _calls(models: dict, run, calls: int) -> dict:
    """name -> wall seconds of `calls` calls of `run(model)`, interleaved."""
    out = {name: [] for name in models}
    for c in range(calls):
        for name, m in (list(models.items()) if c % 2 == 0 else list(models.items())[::-1]):
            start = time.perf_counter()
            run(m)
            out[name].append(time.perf_counter() - start)
    return out


def _profile(run, model, calls: int, pattern: str, top: int = 25) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        run(model)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(pattern, top)
    return text.getvalue()


def cell_report(cell: str, calls: int) -> dict:
    shape = cell_shape(cell)
    rng = np.random.default_rng(0)
    b = shape["batch"]
    x, y = data({**shape, "batch": b * CALL_STEPS}, rng)
    models = {"original": build(shape)}
    models["optimized"] = rnnfuse.optimize(build(shape))
    for m in models.values():
        m.compile("adam", "mse")
    runs = {
        "predict": lambda m: m.predict(x, batch_size=b, verbose=0),
        "fit": lambda m: m.fit(x, y, batch_size=b, epochs=1, verbose=0),
    }
    report = {"cell": cell, "shape": shape_text(shape)}
    for kind, run in runs.items():
        first = {}
        for name, m in models.items():
            start = time.perf_counter()
            run(m)
            first[name] = time.perf_counter() - start
        times = _calls(models, run, calls)
        medians = {n: statistics.median(t) for n, t in times.items()}
        report[kind] = {
            "first_s": first,
            "calls_s": times,
            "median_s": medians,
            "ratio": medians["original"] / medians["optimized"],
            "profile_rnnfuse": _profile(run, models["optimized"], calls, "rnnfuse"),
            "profile_original_top": _profile(run, models["original"], calls, "", 20),
            "profile_optimized_top": _profile(run, models["optimized"], calls, "", 20),
        }
        print(f"cell {cell} {report['shape']} {kind}: original "
              f"{1e3 * medians['original']:.1f} ms, optimized {1e3 * medians['optimized']:.1f} ms "
              f"a call ({report[kind]['ratio']:.2f}x)")
        print(report[kind]["profile_rnnfuse"][-2500:])
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="20", help="drawn cell numbers, comma-separated")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per model and kind")
    parser.add_argument("--out", default=out_path("call_overhead.json"))
    args = parser.parse_args(argv)
    reports = [cell_report(c.strip(), args.calls) for c in args.cells.split(",") if c.strip()]
    with open(args.out, "w") as f:
        json.dump({"cells": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
