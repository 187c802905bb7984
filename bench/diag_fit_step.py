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

Each figure is a median, the two models interleaved: `fit` steps over
rounds whose order flips every round (after one untimed `fit`), and
`train_step` calls through `rnnfuse.tuning.timing.interleaved_medians`
(after one untimed call).

    python bench/diag_fit_step.py --cell 17 --out $OUT/diag_cell17.json
    python bench/diag_fit_step.py --cell 19 --plan fused --trace $OUT/trace19
    python bench/diag_fit_step.py --quick --out /tmp/d.json   # tiny, any machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import _alternate, _plans, build, cell_shape, data  # noqa: E402
from rnnfuse.tuning.timing import interleaved_medians  # noqa: E402

PLANS = {"fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER, "auto": None}


def _models(shape: dict, plan: str, mask_known: bool = False):
    """([(name, model)...], {name: train_step}, x, y): the cell's model and it `optimize`d with
    `plan` (first-batch tuning's choice for "auto"), and one batch. With
    `mask_known` (a masked cell), a second optimized model whose fused
    layers are called with `mask_is_right_padded=True`: they have no
    per-layer branch for a mask that is not right-padded, as the tuner's
    timed steps have none."""
    model = build(shape)
    x, y = data(shape, np.random.default_rng(0))
    models = [("original", model)]
    kwargs = {} if PLANS[plan] is None else {"plan": PLANS[plan]}
    models.append(("optimized", rnnfuse.optimize(model, **kwargs)))
    if mask_known and shape["masked"]:
        models.append(("optimized, mask known", rnnfuse.optimize(model, **kwargs)))
    train_steps = {}
    for name, m in models:
        m.compile(optimizer="adam", loss="mse")
        with _mask_known(m) if name.endswith("mask known") else contextlib.nullcontext():
            m.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)  # traces; tunes for "auto"
            # Keras' train_step alone, traced here too (its first call).
            train_steps[name] = _train_step_fn(m, x, y)
            keras.tree.map_structure(keras.ops.convert_to_numpy, train_steps[name]())
    return models, train_steps, x, y


@contextlib.contextmanager
def _mask_known(model):
    """While traced inside it, `model`'s fused layers are called with
    `mask_is_right_padded=True` (this diagnosis's masks are right-padded)."""
    from rnnfuse.fused import fused_layers

    layers = fused_layers(model)
    calls = [layer.call for layer in layers]
    for layer, call in zip(layers, calls):
        layer.call = lambda *a, _call=call, **k: _call(*a, **{**k, "mask_is_right_padded": True})
    try:
        yield
    finally:
        for layer, call in zip(layers, calls):
            layer.call = call


def _train_step_fn(model, x, y):
    """Keras' own `train_step` on one device-resident batch, in one tf.function."""
    import tensorflow as tf

    xb, yb = tf.constant(x), tf.constant(y)
    return tf.function(lambda: model.train_step((xb, yb)))


def measure(shape: dict, plan: str, rounds: int, calls: int, mask_known: bool = False) -> dict:
    models, train_steps, x, y = _models(shape, plan, mask_known)
    fast = models[1][1]
    b = shape["batch"]
    xs, ys = np.concatenate([x] * 8), np.concatenate([y] * 8)
    fit = _alternate(models, rounds, lambda m, cb: m.fit(
        xs, ys, batch_size=b, epochs=1, verbose=0, callbacks=[cb]))
    train = interleaved_medians(
        train_steps, warmup=1, repeats=rounds * calls,
    )
    fit_ms = {k: 1e3 * statistics.median(v) for k, v in fit.items()}
    train_ms = {k: 1e3 * v["median"] for k, v in train.items()}
    return dict(
        shape=shape,
        plan=plan,
        plans=_plans(fast),
        fit_ms=fit_ms,
        train_step_ms=train_ms,
        fit_speedup=fit_ms["original"] / fit_ms["optimized"],
        train_step_speedup=train_ms["original"] / train_ms["optimized"],
        fit_minus_train_step_ms={k: fit_ms[k] - train_ms[k] for k in fit_ms},
        mask_known_fit_speedup=(
            fit_ms["original"] / fit_ms["optimized, mask known"] if len(models) > 2 else None
        ),
        decisions=rnnfuse.tuning.first_batch.decisions(fast),
        raw=dict(fit=fit, train_step={k: v["times"] for k, v in train.items()}),
    )


def trace(shape: dict, plan: str, out_dir: str, steps: int = 5) -> None:
    """A TensorFlow profile of `steps` fit steps of each model."""
    import tensorflow as tf

    models, _, x, y = _models(shape, plan)
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    for name, m in models:
        tf.profiler.experimental.start(os.path.join(out_dir, name))
        m.fit(xs, ys, batch_size=shape["batch"], epochs=1, verbose=0)
        tf.profiler.experimental.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="17", help="a drawn cell number, or A1.. for an anchor")
    parser.add_argument("--plan", choices=sorted(PLANS), default="fused",
                        help="the optimized model's plan (auto: first-batch tuning decides)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8,
                        help="train_step calls per round (rounds x calls, interleaved)")
    parser.add_argument("--mask-known", action="store_true",
                        help="a masked cell: add an optimized model traced without the per-layer branch")
    parser.add_argument("--trace", help="also write a TensorFlow profile here")
    parser.add_argument("--quick", action="store_true", help="a tiny model, any machine")
    parser.add_argument("--out", default=out_path("fit_step.json"))
    args = parser.parse_args(argv)
    shape = cell_shape(args.cell)
    if args.quick:
        shape = dict(shape, layers=2, units=32, batch=4, steps=10)
        args.rounds, args.calls = 2, 2
    row = dict(cell=args.cell, backend=keras.backend.backend(),
               **measure(shape, args.plan, args.rounds, args.calls, args.mask_known))
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps({k: v for k, v in row.items() if k != "raw"}, indent=1))
    if args.trace:
        trace(shape, args.plan, args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
