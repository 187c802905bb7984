"""Where a fresh process's `optimize` and first `fit` go, one model a process.

A new user's whole first call is `optimize(model)` then `fit`; on a backend
whose first step compiles (JAX, TensorFlow), both pay one-time set-up:
libraries loaded, handles created, steps traced and compiled. This builds a
bench_matrix shape (`--shape`) in `--dtype` (default: the shape's), runs
`optimize` (unless `--model original`) and then one `fit(epochs=1)` of
`--epoch-steps` batches, and records each phase's seconds, its XLA compiles
(JAX) and cProfile's slowest functions by cumulative time. Run it once per
model, each in its own process:

    KERAS_BACKEND=jax python bench/diag_first_fit.py --shape lstm4x512 --model optimized
    KERAS_BACKEND=jax python bench/diag_first_fit.py --shape lstm4x512 --model original --dtype float32
    python bench/diag_first_fit.py --quick --model optimized   # tiny, any machine
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
from common import out_path  # noqa: E402


def _profiled(fn, top: int) -> tuple[dict, object]:
    """Runs `fn()`: its seconds, XLA compiles and slowest functions, and its result."""
    from diag_tuning_cost import XlaCompiles

    profiler = cProfile.Profile()
    with XlaCompiles() as compiles:
        start = time.perf_counter()
        profiler.enable()
        result = fn()
        profiler.disable()
        seconds = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    out = dict(seconds=seconds, profile=text.getvalue())
    if compiles.listening:
        out.update(compiles=compiles.count, compile_s=compiles.seconds)
    return out, result


def measure(shape_name: str, model_kind: str, dtype: str | None, epoch_steps: int,
            quick: bool, top: int) -> dict:
    """The phases of one fresh process's first call (see the module doc)."""
    import numpy as np

    import bench_matrix
    import rnnfuse

    shape = bench_matrix.SHAPES[shape_name]
    shape = bench_matrix.quick(shape) if quick else shape
    shape = dict(shape, dtype=dtype) if dtype else shape
    phases = {}
    phases["build"], model = _profiled(lambda: bench_matrix.build_keras(shape), top)
    if model_kind == "optimized":
        phases["optimize"], model = _profiled(lambda: rnnfuse.optimize(model), top)
    model.compile(optimizer="adam", loss="mse")
    x, y, _ = bench_matrix.data(shape)
    xe, ye = np.concatenate([x] * epoch_steps), np.concatenate([y] * epoch_steps)
    fit = lambda: model.fit(xe, ye, batch_size=shape["batch"], epochs=1, verbose=0,  # noqa: E731
                            shuffle=False)
    phases["first_fit"], _ = _profiled(fit, top)
    phases["second_fit"], _ = _profiled(fit, top)
    return dict(shape=shape_name, model=model_kind, dtype=shape["dtype"],
                epoch_steps=epoch_steps, phases=phases)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="lstm4x512", help="a bench_matrix shape name")
    parser.add_argument("--model", choices=("original", "optimized"), default="optimized")
    parser.add_argument("--dtype", default=None, help="the model's policy (default: the shape's)")
    parser.add_argument("--epoch-steps", type=int, default=5, help="batches in the fit")
    parser.add_argument("--quick", action="store_true", help="the shape made tiny: any machine")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows a phase")
    parser.add_argument("--out", default=None, help="the JSON file (default: common.out_path)")
    args = parser.parse_args(argv)
    row = measure(args.shape, args.model, args.dtype, args.epoch_steps, args.quick, args.top)
    for name, phase in row["phases"].items():
        compiles = f", {phase['compiles']} XLA compiles ({phase['compile_s']:.2f} s)" \
            if "compiles" in phase else ""
        print(f"first-fit {row['model']} {row['shape']} {row['dtype']} {name}: "
              f"{phase['seconds']:.2f} s{compiles}")
    for name in ("optimize", "first_fit"):
        if name in row["phases"]:
            print(f"--- {row['model']} {name} ---")
            print("\n".join(row["phases"][name]["profile"].splitlines()[:12 + args.top]))
    path = args.out or out_path(f"first_fit_{row['model']}.json")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
