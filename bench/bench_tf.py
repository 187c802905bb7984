"""Benchmark: the original Keras model vs rnnfuse on the TensorFlow backend.

For every cell of the matrix (cell kind, layers, batch, time steps, units,
dtype, train step or inference) it builds the model once and times, side by
side in one process (warm-up, then interleaved rounds, medians):

- "original": the Keras model as written (Keras' per-layer cuDNN for
  LSTM/GRU, its generic loop for SimpleRNN and RNN(cell));
- every candidate plan of the tuner (`rnnfuse.tuning.plans`): the whole run
  fused, split in two (4+ layers), each with TensorFlow's default and the
  persistent cuDNN algorithm.

For training cells, plans with a non-default algorithm are checked against
a float64 reference first (as the tuner does) and marked rejected when their
gradients are worse than the default algorithm's. "tuned" is the fastest
candidate that is not rejected, the original included (so a tuned model is
never slower, up to noise); "static" is what the rule table picks.

Results go to a JSON file after every cell, so an interrupted run keeps what
it measured. bench/report.py turns the JSON into docs/benchmarks.md and the
plot.

    python bench/bench_tf.py --out /tmp/tf.json   # default: rnnfuse-bench/tf.json in the temp folder
    python bench/bench_tf.py --quick --out /tmp/q.json   # tiny, any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.passes import build_layer_graph, plan_fusion  # noqa: E402
from rnnfuse.tuning.plans import candidate_plans  # noqa: E402
from rnnfuse.tuning.table import regime_of, static_plan  # noqa: E402
from rnnfuse.tuning.timing import interleaved_medians  # noqa: E402
from rnnfuse.tuning.tuner import _default_gradient_check, gradient_tolerance  # noqa: E402

L = keras.layers


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str  # lstm, gru, bilstm, bigru, simple_rnn, rnn_lstmcell
    layers: int
    batch: int
    steps: int
    units: int
    dtype: str  # float32 or mixed_float16
    mode: str  # train or infer

    @property
    def name(self) -> str:
        dt = "fp16" if self.dtype == "mixed_float16" else "fp32"
        return f"{self.kind} L{self.layers} B{self.batch} T{self.steps} H{self.units} {dt} {self.mode}"


def _c(kind, layers, batch, steps, units, dtype="float32", mode="train"):
    return Cell(kind, layers, batch, steps, units, dtype, mode)


MATRIX = [
    # LSTM / GRU: Keras already runs each layer on cuDNN.
    _c("lstm", 4, 64, 1000, 512),
    _c("lstm", 4, 64, 1000, 512, "mixed_float16"),
    _c("lstm", 4, 32, 1000, 1024),
    _c("lstm", 4, 32, 1000, 1024, "mixed_float16"),
    _c("lstm", 4, 8, 100, 256),
    _c("lstm", 4, 8, 100, 256, "mixed_float16"),
    _c("lstm", 2, 64, 100, 512),
    _c("lstm", 8, 64, 100, 256, "mixed_float16"),
    _c("lstm", 8, 8, 1000, 256),
    _c("gru", 4, 64, 1000, 512),
    _c("gru", 4, 64, 1000, 512, "mixed_float16"),
    _c("gru", 4, 8, 100, 256),
    _c("gru", 2, 32, 1000, 1024, "mixed_float16"),
    _c("gru", 8, 64, 100, 512),
    _c("lstm", 4, 64, 1000, 512, mode="infer"),
    _c("lstm", 4, 64, 1000, 512, "mixed_float16", mode="infer"),
    _c("gru", 4, 8, 100, 256, mode="infer"),
    _c("lstm", 2, 8, 1000, 1024, mode="infer"),
    # Bidirectional stacks.
    _c("bilstm", 4, 32, 1000, 512),
    _c("bigru", 5, 32, 1000, 512, "mixed_float16"),
    _c("bilstm", 4, 8, 100, 256, mode="infer"),
    # Stacks Keras runs in its generic loop.
    _c("simple_rnn", 4, 64, 200, 512),
    _c("simple_rnn", 4, 8, 100, 256, mode="infer"),
    _c("simple_rnn", 2, 64, 100, 256, "mixed_float16"),
    _c("rnn_lstmcell", 4, 64, 200, 512),
    _c("rnn_lstmcell", 2, 8, 100, 256, "mixed_float16"),
]

QUICK = [
    _c("lstm", 2, 2, 6, 8),
    _c("gru", 4, 2, 6, 8, mode="infer"),
    _c("simple_rnn", 2, 2, 6, 8, "mixed_float16"),
    _c("bigru", 2, 2, 6, 8),
]


def build_model(cell: Cell) -> keras.Model:
    keras.config.set_dtype_policy(cell.dtype)
    try:
        inp = keras.Input((cell.steps, cell.units))
        x = inp
        for i in range(cell.layers):
            rs = i < cell.layers - 1
            x = _layer(cell, rs)(x)
        return keras.Model(inp, L.Dense(8, dtype="float32")(x))
    finally:
        keras.config.set_dtype_policy("float32")


def _layer(cell: Cell, return_sequences: bool):
    u = cell.units
    kind = cell.kind
    if kind == "lstm":
        return L.LSTM(u, return_sequences=return_sequences)
    if kind == "gru":
        return L.GRU(u, return_sequences=return_sequences)
    if kind == "bilstm":
        return L.Bidirectional(L.LSTM(u, return_sequences=return_sequences))
    if kind == "bigru":
        return L.Bidirectional(L.GRU(u, return_sequences=return_sequences))
    if kind == "simple_rnn":
        return L.SimpleRNN(u, return_sequences=return_sequences)
    if kind == "rnn_lstmcell":
        return L.RNN(L.LSTMCell(u), return_sequences=return_sequences)
    raise ValueError(kind)


def make_step(model: keras.Model, x, mode: str):
    variables = model.trainable_variables

    @tf.function(jit_compile=False)
    def step():
        if mode == "infer":
            return tf.reduce_sum(tf.cast(model(x, training=False), tf.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
        grads = tape.gradient(loss, variables)
        return loss + 0.0 * tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])

    return step


def run_cell(cell: Cell, warmup: int, repeats: int) -> dict:
    model = build_model(cell)
    (group,) = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    dtype = group.dtype
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((cell.batch, cell.steps, cell.units)).astype("float32"))
    plans = [p for p in candidate_plans(group) if p.pieces]
    rejected, errors = {}, {}
    if cell.mode == "train":
        check_shape = (cell.batch, min(cell.steps, 200), cell.units)
        for p in plans:
            errors[p.name] = _default_gradient_check(group, p, check_shape, dtype)
        for p in plans:
            if p.algorithm:
                base = errors[[q for q in plans if q.pieces == p.pieces and not q.algorithm][0].name]
                if errors[p.name] > gradient_tolerance(base, dtype):
                    rejected[p.name] = f"gradient error {errors[p.name]:.2e} vs {base:.2e}"
    steps = {"original": make_step(model, x, cell.mode)}
    for p in plans:
        steps[p.name] = make_step(rnnfuse.optimize(model, plan=p), x, cell.mode)
    start = time.perf_counter()
    stats = interleaved_medians(steps, warmup=warmup, repeats=repeats)
    elapsed = time.perf_counter() - start
    medians = {k: v["median"] for k, v in stats.items()}
    allowed = {k: v for k, v in medians.items() if k not in rejected}
    tuned = min(allowed, key=allowed.get)
    static = static_plan(group, dtype, cell.mode == "train").for_length(len(group.layers))
    static_name = "original" if not static.pieces else static.name
    base = medians["original"]
    return {
        "cell": dataclasses.asdict(cell),
        "regime": dataclasses.asdict(regime_of(group, dtype, cell.mode == "train")),
        "layers_in_group": len(group.layers),
        "name": cell.name,
        "medians_s": medians,
        "times_s": {k: v["times"] for k, v in stats.items()},
        "speedup": {k: base / v for k, v in medians.items()},
        "fused_default_speedup": base / medians["fused"],
        "tuned": tuned,
        "tuned_speedup": base / medians[tuned],
        "static": static_name,
        "static_speedup": base / medians.get(static_name, base),
        "gradient_errors": errors,
        "rejected": rejected,
        "timing_wall_s": elapsed,
    }


def tuner_wall_time(quick: bool) -> dict:
    """optimize(tune=...) on a 10-layer model, no cache: seconds spent."""
    units, steps, batch = (8, 6, 2) if quick else (256, 200, 32)
    inp = keras.Input((steps, units))
    x = inp
    for i in range(5):
        x = L.LSTM(units, return_sequences=True)(x)
    x = L.Dense(units)(x)
    for i in range(5):
        x = L.GRU(units, return_sequences=i < 4)(x)
    model = keras.Model(inp, x)
    start = time.perf_counter()
    fast = rnnfuse.optimize(model, tune=rnnfuse.TuneShape(batch, steps), cache=False)
    wall = time.perf_counter() - start
    plans = [
        f"{l.name}: {len(l.fused_layers)} layers @{l.algorithm or 'default'}"
        for l in fast.layers
        if isinstance(l, rnnfuse.FusedRNN)
    ]
    return {"layers": 10, "wall_s": wall, "fused": plans}


def environment() -> dict:
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    build = tf.sysconfig.get_build_info()
    return {
        "device": details.get("device_name", platform.processor() or "cpu"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cudnn_build": str(build.get("cudnn_version")),
        "cuda_build": str(build.get("cuda_version")),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=out_path("tf.json"))
    ap.add_argument("--quick", action="store_true", help="tiny cells, any machine")
    ap.add_argument("--only", default="", help="comma-separated substrings of cell names")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; no new cell after this")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-tuner", action="store_true")
    args = ap.parse_args(argv)
    cells = QUICK if args.quick else MATRIX
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        cells = [c for c in cells if any(k in c.name for k in keys)]
    result = {"environment": environment(), "cells": [], "skipped": []}
    start = time.perf_counter()

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for cell in cells:
        if time.perf_counter() - start > args.budget:
            result["skipped"].append({"name": cell.name, "why": "time budget"})
            continue
        try:
            row = run_cell(cell, args.warmup, args.repeats)
        except Exception as err:  # noqa: BLE001 - record and go on
            row = {"cell": dataclasses.asdict(cell), "name": cell.name, "error": f"{type(err).__name__}: {err}"}
        result["cells"].append(row)
        if "error" in row:
            print(f"{cell.name:48s} ERROR {row['error'][:200]}", flush=True)
        else:
            print(
                f"{cell.name:48s} orig {row['medians_s']['original'] * 1e3:8.1f} ms  "
                f"fused {row['fused_default_speedup']:5.2f}x  tuned {row['tuned_speedup']:5.2f}x "
                f"({row['tuned']})  static {row['static_speedup']:5.2f}x  rej {list(row['rejected'])}",
                flush=True,
            )
        save()
    if not args.skip_tuner and time.perf_counter() - start < args.budget:
        try:
            result["tuner"] = tuner_wall_time(args.quick)
            print("tuner:", result["tuner"], flush=True)
        except Exception as err:  # noqa: BLE001
            result["tuner"] = {"error": f"{type(err).__name__}: {err}"}
    result["wall_s"] = time.perf_counter() - start
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
