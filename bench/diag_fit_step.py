"""Where a `fit` step's time goes: the whole `fit` step and Keras' `train_step`
alone on a device-resident batch, for the original and the optimized model
of one user-view cell (with `--plan auto`, also what first-batch tuning
measured for the group alone: `decisions`).

Made for the user-view cells whose fused plan ran slower through `fit`
than on the tuner's clock (docs/benchmarks.md: TF cells 17 and 19, masked
float16, and 15): if `train_step` alone keeps the tuner's ratio and `fit`
does not, the cost is in what `fit` adds around the step; if `train_step`
already loses it, the cost is in the model around the group (the mask, the
casts, the loss-scale optimizer). `--trace DIR` also writes a TensorFlow
profile of a few `fit` steps of each model, for TensorBoard's profile
plugin.

Each figure is a median over interleaved rounds (the models alternate,
their order flipped every round), after one untimed round.

    python bench/diag_fit_step.py --cell 17 --out $OUT/diag_cell17.json
    python bench/diag_fit_step.py --cell 19 --plan fused --trace $OUT/trace19
    python bench/diag_fit_step.py --quick --out /tmp/d.json   # tiny, any machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import ANCHORS, _alternate, _step_time, build, data, draw_shapes  # noqa: E402

PLANS = {"fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER, "auto": None}


def _sync(value) -> None:
    keras.ops.convert_to_numpy(keras.tree.flatten(value)[0])


def _median_call_s(fn, calls: int) -> float:
    """Median seconds of `calls` calls of fn (each waits for its result)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        _sync(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train_step_fn(model, x, y):
    """Keras' own `train_step` on one device-resident batch, in one tf.function."""
    import tensorflow as tf

    xb, yb = tf.constant(x), tf.constant(y)
    step = tf.function(lambda: model.train_step((xb, yb)))
    return lambda: step()


def measure(shape: dict, plan: str, rounds: int, calls: int) -> dict:
    rng = np.random.default_rng(0)
    model = build(shape)
    x, y = data(shape, rng)
    b = shape["batch"]
    fast = rnnfuse.optimize(model, **({} if PLANS[plan] is None else {"plan": PLANS[plan]}))
    model.compile(optimizer="adam", loss="mse")
    fast.compile(optimizer="adam", loss="mse")
    for m in (model, fast):  # traces; tunes where plan="auto"
        m.fit(x, y, batch_size=b, epochs=1, verbose=0)
    steps = 8
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    models = [("original", model), ("optimized", fast)]
    fit = _alternate(models, rounds, lambda m, cb: m.fit(
        xs, ys, batch_size=b, epochs=1, verbose=0, callbacks=[cb]))
    train_steps = {name: _train_step_fn(m, x, y) for name, m in models}
    for fn in train_steps.values():
        _sync(fn())  # traces
    train = {name: [] for name in train_steps}
    for r in range(rounds):
        order = list(train_steps.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            train[name].append(_median_call_s(fn, calls))
    med = lambda d: {k: 1e3 * statistics.median(v) for k, v in d.items()}
    fit_ms, train_ms = med(fit), med(train)
    return dict(
        shape=shape,
        plan=plan,
        plans=[dict(layers=[l.name for l in f.fused_layers], pieces=f.pieces, algorithm=f.algorithm)
               for f in rnnfuse.tuning.first_batch.fused_layers(fast)],
        fit_ms=fit_ms,
        train_step_ms=train_ms,
        fit_speedup=fit_ms["original"] / fit_ms["optimized"],
        train_step_speedup=train_ms["original"] / train_ms["optimized"],
        fit_minus_train_step_ms={k: fit_ms[k] - train_ms[k] for k in fit_ms},
        decisions=rnnfuse.tuning.first_batch.decisions(fast),
        raw=dict(fit=fit, train_step=train),
    )


def trace(shape: dict, plan: str, out_dir: str, steps: int = 5) -> None:
    """A TensorFlow profile of `steps` fit steps of each model."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    model = build(shape)
    x, y = data(shape, rng)
    fast = rnnfuse.optimize(model, **({} if PLANS[plan] is None else {"plan": PLANS[plan]}))
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    for name, m in (("original", model), ("optimized", fast)):
        m.compile(optimizer="adam", loss="mse")
        m.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)
        tf.profiler.experimental.start(os.path.join(out_dir, name))
        m.fit(xs, ys, batch_size=shape["batch"], epochs=1, verbose=0)
        tf.profiler.experimental.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="17", help="a drawn cell number, or A1.. for an anchor")
    parser.add_argument("--plan", choices=sorted(PLANS), default="fused",
                        help="the optimized model's plan (auto: first-batch tuning decides)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8, help="train_step calls per round")
    parser.add_argument("--trace", help="also write a TensorFlow profile here")
    parser.add_argument("--quick", action="store_true", help="a tiny model, any machine")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cell.startswith("A"):
        shape = dict(ANCHORS[int(args.cell[1:]) - 1])
    else:
        shape = draw_shapes(30)[int(args.cell) - 1]
    if args.quick:
        shape = dict(shape, layers=2, units=32, batch=4, steps=10)
        args.rounds, args.calls = 2, 2
    row = dict(cell=args.cell, backend=keras.backend.backend(),
               **measure(shape, args.plan, args.rounds, args.calls))
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps({k: v for k, v in row.items() if k != "raw"}, indent=1))
    if args.trace:
        trace(shape, args.plan, args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
