"""Train steps of one stacked RNN under Keras' torch backend: Keras' own
layers against rnnfuse's fused call on its cuDNN core, per algorithm, and on
torch._VF (the core turned off), in one process.

A step is a forward and backward through the stack (sum of squares of the
outputs, gradients of every variable); medians over --repeats timed steps
after --warmup, interleaved (one step of each variant in turn), so drift
hits every variant alike.

    KERAS_BACKEND=torch python3 bench/bench_core_torch.py --kind lstm --layers 4 \\
        --units 384 --input 80 --batch 24 --steps 700 --bidirectional --policy mixed_float16

Prints one JSON object: the median ms of each variant, the ratio of Keras'
per-layer step to each, and the kernel each fused variant ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import keras
import numpy as np
import torch

import rnnfuse
from rnnfuse.fused import fused_layers
from rnnfuse.plan import Plan


def build(args) -> keras.Model:
    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[args.kind]
    inp = keras.Input((args.steps, args.input))
    x = inp
    for _ in range(args.layers):
        rnn = layer(args.units, return_sequences=True)
        x = keras.layers.Bidirectional(rnn)(x) if args.bidirectional else rnn(x)
    return keras.Model(inp, x)


def step_of(model, x, env=None):
    variables = [v.value for v in model.trainable_variables]

    def step():
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            out = model(x, training=True)
            loss = (out.float() ** 2).mean()
            torch.autograd.grad(loss, variables)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        torch.cuda.synchronize()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="lstm", choices=("lstm", "gru"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--units", type=int, default=384)
    parser.add_argument("--input", type=int, default=80)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--wavefront", action="store_true",
                        help="also the plan on rnnfuse's wavefront kernel (bidirectional "
                             "layers switched on for this process)")
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy(args.policy)
    model = build(args)
    x = torch.as_tensor(np.random.default_rng(0).standard_normal(
        (args.batch, args.steps, args.input)).astype("float32"), device="cuda")
    variants = {"keras": (model, None)}
    for algorithm in (None, "persistent_static+tc", "persistent_dynamic+tc"):
        fast = rnnfuse.optimize(model, plan=Plan((args.layers,), algorithm))
        variants[f"core {algorithm or 'standard'}"] = (fast, None)
    if args.wavefront:
        from rnnfuse.backends.cuda import library

        library.BIDIRECTIONAL = True
        variants["wavefront"] = (rnnfuse.optimize(
            model, plan=Plan((args.layers,), kernel="wavefront")), None)
    variants["torch._VF"] = (rnnfuse.optimize(model, plan=rnnfuse.FUSED),
                             {"RNNFUSE_DISABLE_CORE": "1"})
    steps = {name: step_of(m, x, env) for name, (m, env) in variants.items()}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(1e3 * (time.perf_counter() - start))
    medians = {name: statistics.median(t) for name, t in times.items()}
    ran = {}
    for name, (m, _) in variants.items():
        layers = fused_layers(m)
        if layers:
            k = layers[0].last_path.kernel
            ran[name] = f"{k.name} {k.algorithm} {k.note or ''}".strip()
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "args": vars(args),
        "median_ms": {k: round(v, 2) for k, v in medians.items()},
        "speedup_vs_keras": {k: round(medians["keras"] / v, 2) for k, v in medians.items()},
        "ran": ran}, indent=1))


if __name__ == "__main__":
    main()
