"""A group whose plan keeps the original layers, against the original model.

Where first-batch tuning keeps a group's original layers in every mode, the
optimized model should run exactly what the original runs, at its speed.
Each cell here builds a model and its optimized twin whose every run is a
FusedRNN with the tuner's decision pinned to the original layers (the
candidates' steps are built as in a real tuning, and a fixed clock makes
the original layers win in both modes), then times both models side by
side: every round runs each entry point of each model once, the order
rotating between rounds (`rnnfuse.tuning.timing.interleaved_medians`, no
pruning), after warm-up calls. Python's cyclic collector stays out of the
timed calls (what is alive before them frozen, the young generations
collected after each). An entry point's reading is the median of the
per-round ratios original / optimized (1.00x: the same speed; the target
is at least 0.99x over at least 15 rounds) with a 95% interval for it
(order statistics: no assumption on the rounds' spread), beside both
medians; each round's ms a step are kept in the JSON.

Entry points, each timed over `--steps` batches a round: `fit` (one
`fit(epochs=1)` call of that many batches, whole), `train_on_batch`,
`predict_on_batch` (that many calls).

A cell is `kind:layers:units:batch:steps[:dtype]` (kind lstm, gru, simple,
bi_lstm, bi_gru; dtype a Keras dtype policy, float32 by default).

    KERAS_BACKEND=torch python bench/bench_kept_original.py --out $OUT/kept_torch.json
    python bench/bench_kept_original.py --out $OUT/kept_tf.json --rounds 21
    python bench/bench_kept_original.py --quick   # tiny, any machine (JSON: common.out_path)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from common import csv_list, out_path, run_matrix  # noqa: E402
from rnnfuse.fused import fused_layers  # noqa: E402
from rnnfuse.plan import PER_LAYER  # noqa: E402
from rnnfuse.tuning import first_batch  # noqa: E402
from rnnfuse.tuning.per_shape import AutoTune  # noqa: E402
from rnnfuse.tuning.timing import interleaved_medians  # noqa: E402
from rnnfuse.tuning.tuner import device_environment  # noqa: E402

# A speech-style BiLSTM (a shape family whose tuned plan keeps the original
# layers under torch), and two small shapes.
CELLS = ["bi_lstm:3:256:32:400", "gru:3:64:256:100", "lstm:2:40:128:168"]
ENTRY_POINTS = ("fit", "train_on_batch", "predict_on_batch")
# Input features of every cell.
FEATURES = 8


def parse_cell(text: str) -> dict:
    """`kind:layers:units:batch:steps[:dtype]` as a dict.

    >>> parse_cell("gru:3:64:256:100")["dtype"]
    'float32'
    """
    parts = text.split(":")
    if len(parts) not in (5, 6):
        raise ValueError(
            f"a cell is kind:layers:units:batch:steps[:dtype]; received {text!r}, "
            "for example gru:3:64:256:100 or bi_lstm:3:256:32:400:mixed_float16"
        )
    kind, layers, units, batch, steps = parts[:5]
    return dict(kind=kind, layers=int(layers), units=int(units), batch=int(batch),
                steps=int(steps), dtype=parts[5] if len(parts) == 6 else "float32")


def build(cell: dict) -> keras.Model:
    """The cell's stack of recurrent layers and a Dense head."""
    keras.config.set_dtype_policy(cell["dtype"])
    try:
        kind = cell["kind"].removeprefix("bi_")
        make = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU,
                "simple": keras.layers.SimpleRNN}[kind]
        inputs = keras.Input((cell["steps"], FEATURES))
        x = inputs
        for i in range(cell["layers"]):
            layer = make(cell["units"], return_sequences=i < cell["layers"] - 1)
            x = (keras.layers.Bidirectional(layer) if cell["kind"].startswith("bi_") else layer)(x)
        outputs = keras.layers.Dense(1, dtype="float32")(x)
        return keras.Model(inputs, outputs)
    finally:
        keras.config.set_dtype_policy("float32")


def kept_original(model: keras.Model) -> keras.Model:
    """`model` optimized with every run in a FusedRNN whose first-batch
    tuning keeps the original layers in both modes: the candidates' steps
    are built as a real tuning builds them, and a fixed clock makes the
    original layers the fastest (a tuning that kept them)."""
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    state = AutoTune(cache=None)
    state.environment = device_environment() or {
        "backend": keras.backend.backend(), "device": "cpu (nothing to time)"}
    state.measure = lambda steps, on_step=None: {
        name: {"median": 1.0 if name == PER_LAYER.name else 2.0} for name in steps}
    state.fit_share = None  # the cell's short fits decide too (no call budget)
    first_batch.attach(fast, rnnfuse.analyze(model).groups, state)
    return fast


def median_interval(values, level: float = 0.95) -> tuple[float, float]:
    """An interval holding the median of the rounds' distribution with
    probability at least `level` (binomial order statistics): the k-th
    smallest to the k-th largest value; the whole range where there are
    too few values for `level`.

    >>> median_interval(range(1, 16))
    (4, 12)
    >>> median_interval([1.0, 2.0, 3.0])
    (1.0, 3.0)
    """
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= (1 - level) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


@contextlib.contextmanager
def collector_between_calls():
    """Python's cyclic collector kept out of timed calls: what is alive now
    frozen, automatic collection off; yields the `on_step` that collects
    the young generations after each timed call."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield lambda name: gc.collect(1)
    finally:
        gc.enable()
        gc.unfreeze()


def measure(config: tuple, rounds: int, steps: int, warmup: int) -> list[dict]:
    (text,) = config
    cell = parse_cell(text)
    rng = np.random.default_rng(0)
    batch = cell["batch"]
    x = rng.standard_normal((batch * steps, cell["steps"], FEATURES)).astype("float32")
    y = rng.standard_normal((batch * steps, 1)).astype("float32")
    original = build(cell)
    optimized = kept_original(original)
    models = {"original": original, "optimized": optimized}
    for model in models.values():
        model.compile(optimizer="adam", loss="mse")
        # Traces, and for the optimized model its (pinned) first-batch tuning.
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        model.predict(x[:batch], batch_size=batch, verbose=0)
    plans = sorted({r.plan.name for r in optimized._rnnfuse_autotune.decided.values()})
    if plans != [PER_LAYER.name] or not fused_layers(optimized):
        raise RuntimeError(f"the optimized model does not keep the original layers: {plans}")
    xb, yb = x[:batch], y[:batch]
    runs = {
        "fit": lambda m: m.fit(x, y, batch_size=batch, epochs=1, verbose=0).history["loss"][-1],
        "train_on_batch": lambda m: [m.train_on_batch(xb, yb) for _ in range(steps)][-1],
        "predict_on_batch": lambda m: [m.predict_on_batch(xb) for _ in range(steps)][-1],
    }
    row = dict(config=[text], cell=cell, rounds=rounds, steps_per_round=steps, plans=plans)
    for entry, run in runs.items():
        with collector_between_calls() as collect:
            timed = interleaved_medians(
                {name: (lambda m=m, run=run: run(m)) for name, m in models.items()},
                warmup=warmup, repeats=rounds, on_step=collect)
        a, b = timed["original"]["times"], timed["optimized"]["times"]
        ratios = [o / k for o, k in zip(a, b)]
        row[entry] = dict(
            original_ms=1e3 * statistics.median(a) / steps,
            optimized_ms=1e3 * statistics.median(b) / steps,
            ratio=statistics.median(ratios),
            interval_95=list(median_interval(ratios)),
            ratios=ratios,
            original_round_ms=[1e3 * t / steps for t in a],
            optimized_round_ms=[1e3 * t / steps for t in b],
        )
    keras.backend.clear_session()
    return [row]


def describe(row: dict) -> str:
    cell = row["cell"]
    parts = [f"{e} {row[e]['ratio']:.3f}x (95%: {row[e]['interval_95'][0]:.3f}-"
             f"{row[e]['interval_95'][1]:.3f}; {row[e]['original_ms']:.2f} / "
             f"{row[e]['optimized_ms']:.2f} ms)" for e in ENTRY_POINTS]
    return (f"{cell['kind']} {cell['layers']}x{cell['units']} B{cell['batch']} "
            f"T{cell['steps']} {cell['dtype']}, {row['rounds']} rounds: " + ", ".join(parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=out_path("kept_original.json"))
    parser.add_argument("--cells", type=csv_list(str), default=CELLS,
                        help="comma-separated kind:layers:units:batch:steps[:dtype]")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (15 at least)")
    parser.add_argument("--steps", type=int, default=10, help="batches an entry point runs a round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before the rounds")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds")
    parser.add_argument("--quick", action="store_true", help="one tiny cell, 3 rounds, any machine")
    args = parser.parse_args(argv)
    if args.quick:
        args.cells, args.rounds, args.steps, args.warmup = ["gru:2:8:4:6"], 3, 2, 1
    elif args.rounds < 15:
        parser.error(f"--rounds {args.rounds}: the kept-original target is read over 15 rounds "
                     "at least (--quick for a smoke run)")
    meta = dict(backend=keras.backend.backend(), keras=keras.__version__,
                rnnfuse=rnnfuse.__version__, python=platform.python_version(),
                environment=device_environment(), rounds=args.rounds, steps=args.steps,
                warmup=args.warmup)
    run_matrix([(c,) for c in args.cells],
               lambda config: measure(config, args.rounds, args.steps, args.warmup),
               describe, meta=meta, out=args.out, max_seconds=args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
