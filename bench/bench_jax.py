"""JAX backend: does one multi-layer `jax.experimental.rnn.lstm` call beat Keras?

Keras' JAX backend already runs each LSTM layer (float32, no mask, GPU) as
one single-layer `jax.experimental.rnn.lstm` call (cuDNN). rnnfuse would
replace a stack of L such layers with one call with num_layers = L. This
script measures whether that is faster (the JAX backend fuses only where
this measured a gain).

For each configuration (layers, batch, steps, units; float32, the only
dtype jax.experimental.rnn takes) it builds a Keras model of stacked
LSTM(units, return_sequences=True) layers and times, jitted, side by side
(interleaved rounds, medians):

- "keras": the model's own forward (`stateless_call`), i.e. L cuDNN calls;
- "fused": one `jax.experimental.rnn.lstm(num_layers=L)` call whose flat
  weight blob is packed inside the jitted function from the same Keras
  variables (so its gradients reach them);

in "train" (value and gradients w.r.t. the variables) and "infer" mode. It
also records the relative difference of the two (outputs, gradients), so a
layout mistake cannot pass as a speedup.

Run on the GPU machine (JAX is there; carry Keras' wheels only):

    KERAS_BACKEND=jax python3 bench/bench_jax.py --out $OUT/jax_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import csv_list, run_matrix, out_path  # noqa: E402
from jax.experimental import rnn as jax_rnn  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=out_path("jax.json"), help="JSON file to write")
    p.add_argument("--layers", type=csv_list(int), default=[2, 4])
    p.add_argument("--batch", type=csv_list(int), default=[8, 64])
    p.add_argument("--steps", type=csv_list(int), default=[100, 1000])
    p.add_argument("--units", type=csv_list(int), default=[256, 512])
    p.add_argument("--modes", type=csv_list(str), default=["train", "infer"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument(
        "--precision",
        default="highest",
        help="jax_default_matmul_precision (highest: no TF32, as the exactness tests)",
    )
    return p.parse_args(argv)


def build(layers, steps, units):
    inp = keras.Input((steps, units))
    x = inp
    for i in range(layers):
        x = keras.layers.LSTM(units, return_sequences=True, name=f"lstm_{i}")(x)
    return keras.Model(inp, x)


def keras_forward(model):
    """(forward(trainable, x) -> y, trainable values): the model itself."""
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward(trainable, x):
        y, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        return y

    return forward, [v.value for v in model.trainable_variables]


def fused_forward(model, layers, units):
    """forward(trainable, x) -> y: the stack as one jax.experimental.rnn.lstm call.

    The blob is cuDNN's canonical layout (jax.experimental.rnn's
    `_get_params_shapes_in_lstm`): per level W_ih [4H, in], W_hh [4H, H]
    row-major, then per level b_ih, b_hh. Keras' gate order i, f, c, o is
    cuDNN's; Keras' single bias goes to b_ih, b_hh = 0.
    """
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    cells = [model.get_layer(f"lstm_{i}").cell for i in range(layers)]
    slots = [(index[id(c.kernel)], index[id(c.recurrent_kernel)], index[id(c.bias)]) for c in cells]

    def forward(trainable, x):
        weights, biases = [], []
        for k, r, b in slots:
            weights += [trainable[k].T.ravel(), trainable[r].T.ravel()]
            biases += [trainable[b], jnp.zeros_like(trainable[b])]
        blob = jnp.concatenate(weights + biases)
        batch, steps = x.shape[0], x.shape[1]
        zeros = jnp.zeros((layers, batch, units), x.dtype)
        lengths = jnp.full((batch,), steps, jnp.int32)
        y, _, _ = jax_rnn.lstm(
            x, zeros, zeros, blob, lengths,
            input_size=x.shape[-1], hidden_size=units, num_layers=layers,
            dropout=0.0, bidirectional=False,
        )
        return y

    return forward


def _loss(forward):
    return lambda trainable, x: jnp.mean(jnp.square(forward(trainable, x)))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def measure(config, args):
    layers, batch, steps, units = config
    keras.utils.set_random_seed(0)
    model = build(layers, steps, units)
    forward, trainable = keras_forward(model)
    fused = fused_forward(model, layers, units)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, steps, units)), jnp.float32)

    # Exactness first: both paths, outputs and gradients.
    y_keras, y_fused = forward(trainable, x), fused(trainable, x)
    g_keras = jax.grad(_loss(forward))(trainable, x)
    g_fused = jax.grad(_loss(fused))(trainable, x)
    errors = dict(
        output=_rel(y_fused, y_keras),
        gradient=max(_rel(a, b) for a, b in zip(g_fused, g_keras)),
    )
    rows = []
    for mode in args.modes:
        if mode == "train":
            fns = {n: jax.jit(jax.value_and_grad(_loss(f))) for n, f in (("keras", forward), ("fused", fused))}
        else:
            fns = {n: jax.jit(f) for n, f in (("keras", forward), ("fused", fused))}
        for fn in fns.values():
            for _ in range(args.warmup):
                jax.block_until_ready(fn(trainable, x))
        times = {n: [] for n in fns}
        names = list(fns)
        for r in range(args.repeats):
            for name in names[r % 2:] + names[: r % 2]:
                start = time.perf_counter()
                jax.block_until_ready(fns[name](trainable, x))
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {n: statistics.median(t) for n, t in times.items()}
        rows.append(
            dict(
                layers=layers, batch=batch, steps=steps, units=units, dtype="float32", mode=mode,
                median_ms=med, speedup=med["keras"] / med["fused"], all_ms=times, errors=errors,
            )
        )
    return rows


def describe(r: dict) -> str:
    return (
        f"L{r['layers']} B{r['batch']} T{r['steps']} H{r['units']} {r['mode']:5s} "
        f"keras {r['median_ms']['keras']:8.2f} ms  fused {r['median_ms']['fused']:8.2f} ms "
        f"x{r['speedup']:.2f}  err out {r['errors']['output']:.1e} "
        f"grad {r['errors']['gradient']:.1e}"
    )


def main(argv=None):
    args = parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.precision)
    if keras.backend.backend() != "jax":
        sys.exit("bench_jax.py needs KERAS_BACKEND=jax")
    meta = dict(
        keras=keras.__version__,
        jax=jax.__version__,
        device=str(jax.devices()[0]),
        platform=jax.default_backend(),
        precision=args.precision,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    print(meta, flush=True)
    results = run_matrix(
        itertools.product(args.layers, args.batch, args.steps, args.units),
        lambda config: measure(config, args),
        describe,
        meta=meta,
        out=args.out,
        max_seconds=args.max_seconds,
    )
    speedups = [r["speedup"] for r in results if "speedup" in r]
    if speedups:
        geo = float(np.exp(np.mean(np.log(speedups))))
        print(f"cells {len(speedups)}: min x{min(speedups):.2f} max x{max(speedups):.2f} geomean x{geo:.2f}")


if __name__ == "__main__":
    main()
