"""Groups of one through `fit`: lone LSTM/GRU layers and encoder-decoder links,
original vs `rnnfuse.optimize`.

Cells (each model as a user writes it, compiled with Keras' defaults apart
from the optimizer and loss the model's example uses; the optimized model
is `rnnfuse.optimize(model)` with its defaults, so its first `fit` times
each group's plans on the real batch: Keras' layer, or the fused call on
each cuDNN algorithm, which rnnfuse's TensorFlow op runs in both passes):

- `single_lstm`: one LSTM(512), batch 64, 1000 steps, 512 features,
  mixed_float16, a Dense head (the issue's anchor: raw ops measured 39.9 ->
  24.1 ms with cuDNN's persistent forward alone; target >= 1.5x on TF);
- `single_gru`: the same with a GRU;
- `seq2seq`: keras-io's lstm_seq2seq (an LSTM(256) encoder with
  return_state whose states are the decoder LSTM(256)'s initial_state,
  one-hot characters: 71 encoder and 93 decoder tokens, 16 and 59 steps,
  batch 64, float32, rmsprop, categorical cross-entropy; target >= 1.3x);
- `forecaster`: three LSTM(128) that cannot form one run (a
  LayerNormalization after the first, a Dense after the second), 168
  steps of 16 features, batch 64, float32.

Per cell, in one process (cells past `--budget` seconds are listed as
skipped in the JSON): the first optimized `fit` (tuning included) is
timed on its own; then the two models alternate `fit(steps)` rounds
(interleaved, the order flipped every round; a step is the gap between
two batch ends, bench/bench_user_view.py's StepTimes), and the per-step
medians and their ratio are reported. No cell should read below 0.97x:
the tuner keeps Keras' layer unless a plan wins by 10%. The raw JSON holds
every round, the plans chosen and the tuner's decisions (the timings the
static table can learn from).

    python bench/bench_single_layers.py --out /tmp/single_tf.json   # about 3 minutes on a Hopper GPU
    KERAS_BACKEND=torch python bench/bench_single_layers.py --out /tmp/single_torch.json
    python bench/bench_single_layers.py --quick --out /tmp/q.json   # tiny, any machine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import _alternate, _plans, _step_time, _tuning_seconds, steps_for  # noqa: E402
from common import run_matrix, out_path  # noqa: E402

L = keras.layers

# name -> the cell's settings (see the module doc).
CELLS = {
    "single_lstm": dict(model="single", kind="lstm", units=512, batch=64, steps=1000, features=512,
                        dtype="mixed_float16", optimizer="adam", loss="mse"),
    "single_gru": dict(model="single", kind="gru", units=512, batch=64, steps=1000, features=512,
                       dtype="mixed_float16", optimizer="adam", loss="mse"),
    "seq2seq": dict(model="seq2seq", kind="lstm", units=256, batch=64, steps=16, decoder_steps=59,
                    features=71, decoder_features=93, dtype="float32", optimizer="rmsprop",
                    loss="categorical_crossentropy"),
    "forecaster": dict(model="forecaster", kind="lstm", units=128, batch=64, steps=168, features=16,
                       dtype="float32", optimizer="adam", loss="mse"),
}
# --quick: the same models, tiny (any machine, seconds).
QUICK = dict(units=8, batch=4, steps=6, decoder_steps=5, features=3, decoder_features=4)


def build(cell: dict) -> keras.Model:
    """The cell's model (under its dtype policy)."""
    keras.config.set_dtype_policy(cell["dtype"])
    try:
        rnn = L.LSTM if cell["kind"] == "lstm" else L.GRU
        units = cell["units"]
        if cell["model"] == "single":
            inp = keras.Input((cell["steps"], cell["features"]))
            return keras.Model(inp, L.Dense(8, dtype="float32")(rnn(units)(inp)))
        if cell["model"] == "seq2seq":
            enc_in = keras.Input((cell["steps"], cell["features"]))
            dec_in = keras.Input((cell["decoder_steps"], cell["decoder_features"]))
            _, *states = rnn(units, return_state=True)(enc_in)
            dec = rnn(units, return_sequences=True)(dec_in, initial_state=states)
            out = L.Dense(cell["decoder_features"], activation="softmax", dtype="float32")(dec)
            return keras.Model([enc_in, dec_in], out)
        inp = keras.Input((cell["steps"], cell["features"]))
        x = L.LayerNormalization()(rnn(units, return_sequences=True)(inp))
        x = L.Dense(units // 2)(rnn(units, return_sequences=True)(x))
        return keras.Model(inp, L.Dense(1, dtype="float32")(rnn(units)(x)))
    finally:
        keras.config.set_dtype_policy("float32")


def data(cell: dict, rng) -> tuple:
    """(x, y) for one batch of the cell's model."""
    b = cell["batch"]
    if cell["model"] == "seq2seq":
        onehot = lambda t, n: np.eye(n, dtype="float32")[rng.integers(0, n, (b, t))]  # noqa: E731
        x = [onehot(cell["steps"], cell["features"]), onehot(cell["decoder_steps"], cell["decoder_features"])]
        return x, onehot(cell["decoder_steps"], cell["decoder_features"])
    x = rng.standard_normal((b, cell["steps"], cell["features"])).astype("float32")
    return x, rng.standard_normal((b, 1 if cell["model"] == "forecaster" else 8)).astype("float32")


def _repeat(arrays, n: int):
    return [np.concatenate([a] * n) for a in arrays] if isinstance(arrays, list) else np.concatenate([arrays] * n)


def measure(cell: dict, rounds: int, steps: int) -> dict:
    """One cell: the first optimized fit (tuning), then `rounds` interleaved
    fit rounds of both models; per-step medians and their ratio."""
    rng = np.random.default_rng(0)
    model = build(cell)
    x, y = data(cell, rng)
    b = cell["batch"]
    report = rnnfuse.analyze(model)
    fast = rnnfuse.optimize(model)
    model.compile(optimizer=cell["optimizer"], loss=cell["loss"])
    fast.compile(optimizer=cell["optimizer"], loss=cell["loss"])
    start = time.perf_counter()
    fast.fit(x, y, batch_size=b, epochs=1, verbose=0)  # tunes, traces
    first_fit_s = time.perf_counter() - start
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)  # traces
    x4, y4 = _repeat(x, 4), _repeat(y, 4)
    sizing = max(
        _step_time(lambda cb: m.fit(x4, y4, batch_size=b, epochs=1, verbose=0, callbacks=[cb]))
        for m in (model, fast)
    )
    steps = max(3, steps_for(sizing, steps))
    xs, ys = _repeat(x, steps), _repeat(y, steps)
    times = _alternate(
        [("original", model), ("optimized", fast)],
        rounds,
        lambda m, cb: m.fit(xs, ys, batch_size=b, epochs=1, verbose=0, callbacks=[cb]),
    )
    original, optimized = statistics.median(times["original"]), statistics.median(times["optimized"])
    return dict(
        groups=[list(g.layers) for g in report.groups],
        fit_ms=dict(original=1e3 * original, optimized=1e3 * optimized),
        fit_speedup=original / optimized,
        first_fit_s=first_fit_s,
        tuning_s=_tuning_seconds(fast),
        steps_per_round=steps,
        rounds=rounds,
        plans=_plans(fast),
        decisions=rnnfuse.tuning.first_batch.decisions(fast),
        raw=times,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=out_path("single_layers.json"), help="the raw JSON file")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved fit rounds a cell (default 15)")
    parser.add_argument("--steps", type=int, default=20, help="most fit steps a round (default 20)")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds; cells past it are left out")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds: any machine")
    args = parser.parse_args(argv)
    names = [n for n in args.cells.split(",") if n]
    unknown = sorted(set(names) - set(CELLS))
    if unknown:
        parser.error(f"--cells: unknown {', '.join(unknown)}; choose from {', '.join(CELLS)}")
    if args.quick:
        args.rounds, args.steps = 2, 3
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("rnnfuse").setLevel(logging.INFO)
    meta = dict(
        backend=keras.backend.backend(), keras=keras.__version__, rnnfuse=rnnfuse.__version__,
        python=platform.python_version(), rounds=args.rounds, steps=args.steps, quick=args.quick,
    )

    def measure_cell(config):
        (name,) = config
        keras.backend.clear_session()
        cell = dict(CELLS[name], **(QUICK if args.quick else {}))
        return [dict(cell=name, settings=cell, **measure(cell, args.rounds, args.steps))]

    def describe(row):
        plans = [(p["pieces"], p["algorithm"]) for p in row["plans"]]
        return (
            f"{row['cell']}: original {row['fit_ms']['original']:.2f} ms, optimized "
            f"{row['fit_ms']['optimized']:.2f} ms a step: {row['fit_speedup']:.2f}x "
            f"(tuning {row['tuning_s']:.1f} s; plans {plans})"
        )

    rows = run_matrix(
        [(n,) for n in names], measure_cell, describe, meta=meta, out=args.out, max_seconds=args.budget
    )
    speedups = {r["cell"]: round(r["fit_speedup"], 3) for r in rows if "fit_speedup" in r}
    print(json.dumps(dict(fit_speedup=speedups, below_0_97=sorted(k for k, v in speedups.items() if v < 0.97)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
