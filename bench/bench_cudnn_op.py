"""Benchmark: rnnfuse's own cuDNN op vs CudnnRNNV3 vs Keras, on TensorFlow.

For every cell it builds the Keras model once and times, side by side in
one process (warm-up, then interleaved rounds, medians, per step):

- "keras": the model as written (Keras' per-layer cuDNN; ProjectedLSTM's
  own fast path);
- "v3": `rnnfuse.optimize(plan=Plan(whole=True, kernel="stock"))`, the
  whole run on tf.raw_ops.CudnnRNNV3 (the "stock" kernel: no rnnfuse op);
- "op:<algorithm>": the same on rnnfuse's op, for each algorithm;

in two modes: "raw" (a tf.function of forward + gradients) and "fit"
(`model.compile(optimizer="adam", loss="mse")`, then `train_on_batch`, the
compiled train step `fit` runs). Every variant shares the model's
variables. JSON goes to --out after each cell.

    python bench/bench_cudnn_op.py --budget 240 --out $OUT/cudnn_op_h200.json
    python bench/bench_cudnn_op.py --quick --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.fused import fused_layers  # noqa: E402
from rnnfuse.layers import ProjectedLSTM  # noqa: E402
from rnnfuse.backends import tensorflow as tf_backend  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402

L = keras.layers

# (name, kind, layers, batch, steps, units, proj, policy, bidirectional,
#  dropout: a Dropout(rate) between every two layers, absorbed as cuDNN's)
CELLS = [
    ("lstm4x512 fp16", "lstm", 4, 64, 1000, 512, 0, "mixed_float16", False, 0.0),
    ("lstm4x512 bf16", "lstm", 4, 64, 1000, 512, 0, "mixed_bfloat16", False, 0.0),
    ("lstm4x512 fp32", "lstm", 4, 64, 1000, 512, 0, "float32", False, 0.0),
    ("bigru5x512 fp16 B32 T500", "gru", 5, 32, 500, 512, 0, "mixed_float16", True, 0.0),
    ("plstm4x1024/256 fp32 B32 T1000", "lstm", 4, 32, 1000, 1024, 256, "float32", False, 0.0),
    ("lstm4x256 fp32 B8 T200", "lstm", 4, 8, 200, 256, 0, "float32", False, 0.0),
    ("lstm4x512 fp16 dropout 0.2", "lstm", 4, 64, 1000, 512, 0, "mixed_float16", False, 0.2),
]
QUICK = [
    ("quick lstm", "lstm", 2, 4, 10, 16, 0, "float32", False, 0.0),
    ("quick lstm dropout", "lstm", 2, 4, 10, 16, 0, "float32", False, 0.2),
]
ALGORITHMS = ["standard", "persistent_static", "persistent_dynamic"]


def build(cell) -> keras.Model:
    _, kind, layers, batch, steps, units, proj, policy, bi, dropout = cell
    keras.config.set_dtype_policy(policy)
    try:
        inp = keras.Input((steps, proj or units))
        x = inp
        for i in range(layers):
            rs = i < layers - 1
            if proj:
                layer = ProjectedLSTM(units, proj, return_sequences=rs)
            else:
                layer = (L.LSTM if kind == "lstm" else L.GRU)(units, return_sequences=rs)
            x = L.Bidirectional(layer)(x) if bi else layer(x)
            if dropout and rs:
                x = L.Dropout(dropout, seed=i + 1)(x)
        return keras.Model(inp, L.Dense(8, dtype="float32")(x))
    finally:
        keras.config.set_dtype_policy("float32")


def raw_step(model, x):
    variables = model.trainable_variables

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
        grads = tape.gradient(loss, variables)
        return loss + 0.0 * tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])

    return lambda: float(step())


def fit_step(model, x, y):
    model.compile(optimizer="adam", loss="mse")
    return lambda: float(model.train_on_batch(x, y))


def variants(cell, model):
    """name -> model: Keras' own, CudnnRNNV3 (the "stock" kernel: no
    rnnfuse op in the graph) and rnnfuse's op on each algorithm."""
    out = {"keras": model}
    tc = "" if cell[7] == "float32" else "+tc"
    if not cell[6] and cell[7] != "mixed_bfloat16":
        out["v3"] = rnnfuse.optimize(model, plan=Plan(whole=True, kernel="stock"))
    for algo in ALGORITHMS:
        name = algo + (tc if algo != "standard" else "")
        out[f"op:{name}"] = rnnfuse.optimize(model, plan=Plan(whole=True, algorithm=name))
    return out


def measure(cell, warmup: int, repeats: int, modes) -> list[dict]:
    _, kind, layers, batch, steps, units, proj, policy, bi, _ = cell
    model = build(cell)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, steps, proj or units)).astype("float32"))
    y = tf.constant(rng.standard_normal((batch, 8)).astype("float32"))
    rows = []
    for mode in modes:
        steps_by_name, errors, kernels = {}, {}, {}
        for name, m in variants(cell, model).items():
            fn = raw_step(m, x) if mode == "raw" else fit_step(m, x, y)
            try:
                for _ in range(warmup):
                    fn()
                steps_by_name[name] = fn
                ran = sorted({f.last_path.kernel.name for f in fused_layers(m) if f.last_path.kernel})
                kernels[name] = "+".join(ran) if name != "keras" else "keras"
            except Exception as e:  # noqa: BLE001 - a refused algorithm is a row
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        times = {n: [] for n in steps_by_name}
        for _ in range(repeats):
            for n, fn in steps_by_name.items():
                t0 = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - t0)
        med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
        base = med.get("keras")
        rows.append(
            dict(
                cell=cell[0],
                mode=mode,
                median_ms=med,
                speedup_vs_keras={n: base / v for n, v in med.items()} if base else {},
                kernels=kernels,
                errors=errors,
                repeats=repeats,
            )
        )
        print(cell[0], mode, {n: round(v, 2) for n, v in med.items()}, errors or "", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=out_path("cudnn_op.json"))
    p.add_argument("--budget", type=float, default=300.0, help="seconds; later cells are skipped")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--modes", default="raw,fit")
    p.add_argument("--cells", default="", help="comma-separated indices into the matrix")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    cells = QUICK if args.quick else CELLS
    if args.cells:
        cells = [cells[int(i)] for i in args.cells.split(",")]
    tf.config.experimental.enable_tensor_float_32_execution(True)
    meta = dict(
        tensorflow=tf.__version__,
        keras=keras.__version__,
        device=tf_backend.device_environment() if tf_backend.is_available() else "cpu",
        op_loaded=tf_backend.op_loaded(),
        warmup=args.warmup,
        repeats=args.repeats,
    )
    print(json.dumps(meta), flush=True)
    results, skipped = [], []
    start = time.perf_counter()
    for cell in cells:
        if time.perf_counter() - start > args.budget:
            skipped.append(cell[0])
            continue
        try:
            results += measure(cell, args.warmup, args.repeats, args.modes.split(","))
        except Exception as e:  # noqa: BLE001
            results.append(dict(cell=cell[0], error=f"{type(e).__name__}: {e}"[:500]))
            print("ERROR", cell[0], results[-1]["error"], flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results, skipped=skipped), f, indent=1)
    if skipped:
        print("budget reached; skipped:", skipped, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
