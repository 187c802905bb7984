"""Benchmark ProjectedLSTM's fast path against the same maths in Keras' loop.

In one process (TensorFlow backend), after warm-up, interleaved (each round
times every model of a configuration once), medians:

- "stack" configurations: L stacked layers (L = 1 and 4), units 1024,
  proj 256, B=32, T=1000, float32 and mixed_float16, train step (forward,
  backward, SGD update) and inference. Models:
    plstm:<variant>     ProjectedLSTM on each fast-path variant
                        (custom_xla, custom_xla/u4 (4 steps per loop
                        iteration), custom, while_xla, while; after the
                        first configuration only the --keep fastest)
    plstm:custom@jit    ProjectedLSTM with the whole step XLA-compiled
                        (what Keras' fit does on a GPU: jit_compile="auto")
    cell                keras.layers.RNN(ProjectedLSTMCell): the same maths
                        in a custom cell on Keras' generic loop
    cell@jit            the same, whole step XLA-compiled
    lstm                keras.layers.LSTM(1024) (cuDNN, no projection): a
                        reference point, not the same maths
  The projected models share one set of weights, so their first-step
  losses ("loss0") must agree: a cheap check that every variant computes
  the same thing.
- "acoustic": Input(T, 80) -> 4 x Bidirectional(ProjectedLSTM(1024, 256))
  -> Dense(64), original vs `rnnfuse.optimize` (the TF backend refuses
  projections, so FusedRNN runs the original layers; expect ~1.0x).
- "wavefront" (experimental, float32 and mixed, train and inference): a
  prototype that runs a 4-layer unidirectional stack as ONE loop of T+L-1
  steps (layer l at time s-l, all layers in one batched GEMM per step),
  XLA-compiled with autodiff, against the per-layer loops (hand-written
  gradient) under the same whole-step XLA compile. It decides whether a multi-layer loop is worth
  building into the backend. `--quick` checks it against the per-layer
  stack numerically.

Each configuration appends rows to --out (JSON) as soon as it is measured,
so a run cut short keeps what it has. Configurations run in priority order
and none starts after --max-seconds.

GPU machine:

    python3 bench/bench_projected_lstm.py --out $OUT/bench_projected_lstm.json

CPU check (small sizes):

    python bench/bench_projected_lstm.py --quick --out /tmp/bp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import csv_list, out_path  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.layers import ProjectedLSTM, ProjectedLSTMCell  # noqa: E402
from rnnfuse.layers import projected_lstm as plstm  # noqa: E402

FULL = dict(batch=32, steps=1000, features=256, units=1024, proj=256, acoustic_features=80, vocab=64)
QUICK = dict(batch=2, steps=12, features=8, units=16, proj=4, acoustic_features=6, vocab=5)
# "<fast path>" or "<fast path>/u<k>": k time steps per loop iteration.
VARIANTS = ["custom_xla", "custom_xla/u4", "custom", "while_xla", "while"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=out_path("projected_lstm.json"), help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="small sizes (CPU check)")
    p.add_argument(
        "--variants", type=csv_list(str), default=VARIANTS,
        help="fast-path variants timed in the first stack configuration; later "
        "stack configurations time the --keep fastest of them",
    )
    p.add_argument("--keep", type=int, default=2, help="variants kept after the first configuration")
    p.add_argument("--sections", type=csv_list(str), default=["stack", "acoustic", "wavefront"])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds at most")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per model")
    p.add_argument(
        "--model-budget", type=float, default=3.0,
        help="a model leaves the rounds once its timed calls add up to this "
        "many seconds (with at least --min-repeats samples)",
    )
    p.add_argument("--min-repeats", type=int, default=2)
    p.add_argument(
        "--max-seconds", type=float, default=150.0,
        help="start no configuration after this long",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 float32 matmuls (TF's default)")
    args = p.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    for v in args.variants:
        name, _, unroll = v.partition("/u")
        if name not in plstm.FAST_PATHS or (unroll and not unroll.isdigit()):
            p.error(f"--variants: bad variant {v!r}; e.g. {VARIANTS}")
    return args


# -- models ---------------------------------------------------------------------------------


def _with_policy(policy, build):
    keras.config.set_dtype_policy(policy)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy("float32")


def stack_model(kind, layers, s, policy):
    """Input (T, F) -> `layers` recurrent layers, all returning sequences."""

    def build():
        inp = keras.Input((s["steps"], s["features"]))
        x = inp
        for i in range(layers):
            if kind == "plstm":
                layer = ProjectedLSTM(s["units"], s["proj"], return_sequences=True, name=f"plstm_{i}")
            elif kind == "cell":
                layer = keras.layers.RNN(
                    ProjectedLSTMCell(s["units"], s["proj"]), return_sequences=True, name=f"cell_{i}"
                )
            else:
                layer = keras.layers.LSTM(s["units"], return_sequences=True, name=f"lstm_{i}")
            x = layer(x)
        return keras.Model(inp, x)

    return _with_policy(policy, build)


def acoustic_model(s, policy):
    def build():
        inp = keras.Input((s["steps"], s["acoustic_features"]))
        x = inp
        for i in range(4):
            x = keras.layers.Bidirectional(
                ProjectedLSTM(s["units"], s["proj"], return_sequences=True), name=f"bi_{i}"
            )(x)
        return keras.Model(inp, keras.layers.Dense(s["vocab"], name="logits")(x))

    return _with_policy(policy, build)


class WavefrontStack(keras.layers.Layer):
    """Prototype: L unidirectional LSTMP layers as one loop of T + L - 1 steps.

    At loop step s, layer l runs time step t = s - l (when 0 <= t < T),
    reading layer l-1's output of the previous loop step. All layers' gate
    pre-activations come from one batched GEMM per step:
    [x_in_l, h_l] @ [kernel_l; recurrent_l] (layer 0's input part is the
    precomputed x @ kernel_0 + bias_0, so its kernel slot is zero), then
    one batched projection GEMM. Reads the variables of `layers` (built
    ProjectedLSTMs of one width); no masks, no initial state.
    """

    def __init__(self, layers, **kwargs):
        super().__init__(**kwargs)
        self.plstm_layers = list(layers)
        self.built = True

    def call(self, x):
        cells = [l.cell for l in self.plstm_layers]
        dtype = x.dtype
        L, U, P = len(cells), cells[0].units, cells[0].proj_size
        cast = lambda v: tf.cast(v, dtype)
        xt = tf.transpose(x, [1, 0, 2])
        steps, batch = tf.shape(xt)[0], tf.shape(xt)[1]
        xw0 = tf.einsum("tbf,fg->tbg", xt, cast(cells[0].kernel)) + cast(cells[0].bias)
        w = tf.stack(
            [tf.concat([tf.zeros([P, 4 * U], dtype), cast(cells[0].recurrent_kernel)], 0)]
            + [tf.concat([cast(c.kernel), cast(c.recurrent_kernel)], 0) for c in cells[1:]]
        )  # [L, 2P, 4U]
        bias = tf.stack([tf.zeros([4 * U], dtype)] + [cast(c.bias) for c in cells[1:]])[:, None, :]
        proj = tf.stack([cast(c.projection_kernel) for c in cells])  # [L, U, P]
        layer_ids = tf.range(L)
        xs = tf.TensorArray(dtype, size=steps, clear_after_read=False).unstack(xw0)
        # Loop step s writes the top layer's h to slot s; slots L-1.. are
        # time steps 0.. (earlier slots hold the still-idle top layer).
        out = tf.TensorArray(dtype, size=steps + L - 1, element_shape=tf.TensorShape([None, P]))

        def body(s, h, c, out):
            # h: [L, B, P]; c: [L, B, U]. Layer l's input: layer l-1's h.
            x_in = tf.concat([tf.zeros_like(h[:1]), h[:-1]], 0)
            z = tf.matmul(tf.concat([x_in, h], -1), w) + bias
            first = xs.read(tf.minimum(s, steps - 1))
            z = tf.concat([z[:1] + first[None], z[1:]], 0)
            zi, zf, zg, zo = tf.split(z, 4, axis=-1)
            c_new = tf.sigmoid(zf) * c + tf.sigmoid(zi) * tf.tanh(zg)
            h_new = tf.matmul(tf.sigmoid(zo) * tf.tanh(c_new), proj)
            t = s - layer_ids
            active = tf.logical_and(t >= 0, t < steps)[:, None, None]
            h = tf.where(active, h_new, h)
            c = tf.where(active, c_new, c)
            return s + 1, h, c, out.write(s, h[-1])

        h0 = tf.zeros(tf.stack([L, batch, P]), dtype)
        c0 = tf.zeros(tf.stack([L, batch, U]), dtype)
        _, _, _, out = tf.while_loop(
            lambda s, *_: s < steps + L - 1,
            body,
            (tf.constant(0), h0, c0, out),
            maximum_iterations=steps + L - 1,
        )
        return tf.transpose(out.stack()[L - 1 :], [1, 0, 2])


# -- timing ---------------------------------------------------------------------------------


def make_step(model, mode, jit, target):
    """A tf.function running one train step (loss) or one inference (sum)."""
    if mode == "train":
        opt = keras.optimizers.SGD(1e-4)
        opt.build(model.trainable_variables)

        @tf.function(jit_compile=jit)
        def train(x):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                loss = tf.reduce_mean(tf.square(tf.cast(out, "float32") - target))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        return train

    @tf.function(jit_compile=jit)
    def infer(x):
        return tf.reduce_mean(tf.cast(model(x, training=False), "float32"))

    return infer


class Entry:
    """One model of a configuration: its step function and measurements."""

    def __init__(self, name, model, step, variant="auto", probe=None):
        self.name, self.model, self.step, self.variant = name, model, step, variant
        self.probe = probe  # () -> path string, read after the first call
        self.times: list[float] = []
        self.first_call_s = None
        self.loss0 = None
        self.error = None

    def call(self, x):
        name, _, unroll = self.variant.partition("/u")
        with plstm.fast_path(name, int(unroll or 1)):
            return float(self.step(x))  # float() waits for the device


def run_config(entries, x, args):
    for e in entries:
        try:
            start = time.perf_counter()
            e.loss0 = e.call(x)
            e.first_call_s = time.perf_counter() - start
            for _ in range(args.warmup - 1):
                e.call(x)
        except Exception as err:  # noqa: BLE001 - record it, time the rest
            e.error = f"{type(err).__name__}: {str(err)[:400]}"
    live = [e for e in entries if e.error is None]
    for _ in range(args.repeats):
        active = [
            e for e in live
            if len(e.times) < args.min_repeats or sum(e.times) / 1e3 < args.model_budget
        ]
        if not active:
            break
        for e in active:  # interleaved
            start = time.perf_counter()
            e.call(x)
            e.times.append((time.perf_counter() - start) * 1e3)


def rows_of(config, entries, reference="cell"):
    med = {e.name: statistics.median(e.times) for e in entries if e.times}
    rows = []
    for e in entries:
        row = dict(config, model=e.name, variant=e.variant)
        if e.error:
            row["error"] = e.error
        else:
            row.update(
                median_ms=med[e.name],
                times_ms=[round(t, 3) for t in e.times],
                first_call_s=round(e.first_call_s, 3),
                loss0=e.loss0,
                path=e.probe() if e.probe else None,
            )
            if reference in med:
                row[f"speedup_vs_{reference}"] = med[reference] / med[e.name]
        rows.append(row)
    return rows


def _paths(model):
    """The fast-path names the model's ProjectedLSTMs took on their last call."""
    found = []
    for layer in model._flatten_layers(include_self=False):
        for part in (getattr(layer, "forward_layer", None), getattr(layer, "backward_layer", None), layer):
            if isinstance(part, ProjectedLSTM) and part.last_path not in found:
                found.append(part.last_path)
    fused = [l.last_path for l in model._flatten_layers(include_self=False) if isinstance(l, rnnfuse.FusedRNN)]
    return ", ".join(found + [f"FusedRNN: {p}" for p in fused])


def stack_entries(layers, policy, mode, args, variants):
    s = args.sizes
    target = tf.random.normal([s["batch"], s["steps"], s["proj"]])
    base = stack_model("plstm", layers, s, policy)
    weights = base.get_weights()
    entries = []
    for v in variants:
        m = base if not entries else stack_model("plstm", layers, s, policy)
        m.set_weights(weights)
        entries.append(Entry(f"plstm:{v}", m, make_step(m, mode, False, target), v, lambda m=m: _paths(m)))
    m = stack_model("plstm", layers, s, policy)
    m.set_weights(weights)
    entries.append(Entry("plstm:custom@jit", m, make_step(m, mode, True, target), "custom", lambda m=m: _paths(m)))
    for name, jit in (("cell", False), ("cell@jit", True)):
        m = stack_model("cell", layers, s, policy)
        m.set_weights(weights)
        entries.append(Entry(name, m, make_step(m, mode, jit, target), "off"))
    m = stack_model("lstm", layers, s, policy)
    lstm_target = tf.random.normal([s["batch"], s["steps"], s["units"]])
    entries.append(Entry("lstm", m, make_step(m, mode, False, lstm_target)))
    return entries


def acoustic_entries(policy, mode, args):
    s = args.sizes
    target = tf.random.normal([s["batch"], s["steps"], s["vocab"]])
    model = acoustic_model(s, policy)
    fast = rnnfuse.optimize(model)
    return [
        Entry("original", model, make_step(model, mode, False, target), probe=lambda: _paths(model)),
        Entry("optimized", fast, make_step(fast, mode, False, target), probe=lambda: _paths(fast)),
    ]


def wavefront_entries(policy, mode, args, layers=4):
    s = args.sizes
    target = tf.random.normal([s["batch"], s["steps"], s["proj"]])
    base = stack_model("plstm", layers, s, policy)
    entries = []
    entries.append(
        Entry("plstm:custom@jit", base, make_step(base, mode, True, target), "custom", lambda: _paths(base))
    )
    inp = keras.Input((s["steps"], s["features"]))
    wave = _with_policy(
        policy, lambda: keras.Model(inp, WavefrontStack([l for l in base.layers if isinstance(l, ProjectedLSTM)])(inp))
    )
    entries.append(Entry("wavefront@jit", wave, make_step(wave, mode, True, target)))
    if args.quick:
        _check_wavefront(wave, base, s, policy)
    return entries


def _check_wavefront(wave, base, s, policy):
    """The prototype computes what the per-layer stack computes (outputs and
    gradients of every variable)."""
    x = tf.random.normal([s["batch"], s["steps"], s["features"]])
    r = tf.random.normal([s["batch"], s["steps"], s["proj"]])
    results = []
    for model in (wave, base):
        with plstm.fast_path("custom"), tf.GradientTape() as tape:
            out = tf.cast(model(x), "float32")
            loss = tf.reduce_sum(out * r)
        results.append([out] + tape.gradient(loss, base.trainable_variables))
    diff = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(*results))
    tol = 1e-4 if policy == "float32" else 5e-2
    if diff > tol:
        raise AssertionError(f"wavefront prototype differs from the per-layer stack: {diff}")
    print(f"wavefront prototype == per-layer stack ({policy}): max diff {diff:.2e}", flush=True)


def configurations(args):
    """(section, layers, policy, mode) in priority order."""
    order = [
        ("stack", 1, "float32", "train"),
        ("stack", 4, "float32", "train"),
        ("acoustic", 4, "float32", "train"),
        ("wavefront", 4, "float32", "train"),
        ("stack", 4, "mixed_float16", "train"),
        ("stack", 1, "mixed_float16", "train"),
        ("stack", 4, "float32", "infer"),
        ("wavefront", 4, "float32", "infer"),
        ("stack", 1, "float32", "infer"),
        ("stack", 4, "mixed_float16", "infer"),
        ("stack", 1, "mixed_float16", "infer"),
        ("acoustic", 4, "mixed_float16", "train"),
        ("acoustic", 4, "float32", "infer"),
        ("wavefront", 4, "mixed_float16", "train"),
        ("acoustic", 4, "mixed_float16", "infer"),
    ]
    return [c for c in order if c[0] in args.sections]


def main(argv=None):
    args = parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        sys.exit("bench_projected_lstm.py needs KERAS_BACKEND=tensorflow")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.enable_tensor_float_32_execution(args.tf32)
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    meta = dict(
        tensorflow=tf.__version__,
        keras=keras.__version__,
        device=details.get("device_name") or platform.processor() or "cpu",
        sizes=args.sizes,
        repeats=args.repeats,
        warmup=args.warmup,
        model_budget_s=args.model_budget,
        tf32=args.tf32,
        auto_variant=plstm.get_fast_path(resolve=True),
    )
    results, skipped = [], []
    start = time.perf_counter()
    s = args.sizes
    variants = list(args.variants)
    for section, layers, policy, mode in configurations(args):
        config = dict(section=section, layers=layers, policy=policy, mode=mode)
        elapsed = time.perf_counter() - start
        if elapsed > args.max_seconds:
            skipped.append(config)
            continue
        print(f"[{elapsed:6.1f}s] {section} L{layers} {policy} {mode}", flush=True)
        keras.utils.set_random_seed(0)
        entries = []
        try:
            if section == "stack":
                entries = stack_entries(layers, policy, mode, args, variants)
                x = tf.random.normal([s["batch"], s["steps"], s["features"]])
                reference = "cell"
            elif section == "acoustic":
                entries = acoustic_entries(policy, mode, args)
                x = tf.random.normal([s["batch"], s["steps"], s["acoustic_features"]])
                reference = "original"
            else:
                entries = wavefront_entries(policy, mode, args, layers)
                x = tf.random.normal([s["batch"], s["steps"], s["features"]])
                reference = "plstm:custom@jit"
            run_config(entries, x, args)
            rows = rows_of(config, entries, reference)
            if section == "stack" and len(variants) > args.keep:
                timed = [e for e in entries if e.times and e.name.split(":")[-1] in variants]
                timed.sort(key=lambda e: statistics.median(e.times))
                variants = [e.name.split(":")[-1] for e in timed[: args.keep]] or variants
                print(f"    later stack configurations time: {variants}", flush=True)
        except Exception as err:  # noqa: BLE001 - record it, go on
            rows = [dict(config, error=f"{type(err).__name__}: {str(err)[:400]}")]
        for r in rows:
            if "error" in r:
                print(f"    {r.get('model', '-'):18s} ERROR {r['error']}", flush=True)
            else:
                sp = next((v for k, v in r.items() if k.startswith("speedup_vs_")), None)
                print(
                    f"    {r['model']:18s} {r['median_ms']:10.2f} ms  "
                    f"(first {r['first_call_s']:6.2f} s, n={len(r['times_ms'])}, loss0 {r['loss0']:.6g})"
                    + (f"  x{sp:.2f} vs {reference}" if sp else "")
                    + (f"  [{r['path']}]" if r.get("path") else ""),
                    flush=True,
                )
        results += rows
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results, skipped=skipped), f, indent=1)
        del entries
        gc.collect()
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results, skipped=skipped), f, indent=1)
    print(f"done in {time.perf_counter() - start:.1f} s; {len(skipped)} configurations skipped", flush=True)


if __name__ == "__main__":
    main()
