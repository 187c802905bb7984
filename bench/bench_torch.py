"""Benchmark under Keras' torch backend: the original model vs rnnfuse.optimize.

For each configuration (cell kind, layers, batch, time steps, units, dtype
policy) it builds one Keras model (Input -> `layers` stacked LSTM/GRU layers,
all returning sequences), rewrites it with `rnnfuse.optimize` (the two share
their variables) and times, in one process:

- "train": forward + backward (torch autograd into the Keras variables),
- "infer": forward under `torch.no_grad()`,

for the original and the optimized model, interleaved (original, fused,
original, fused, ...) after warm-up calls, and reports medians, the
fused/original speedup and which path FusedRNN took. The optimized model is
timed once per torch-backend call mode (`--call-modes`, default
"auto,one,per_level": rnnfuse's choice, always one multi-layer call, one
call per level; see rnnfuse.backends.torch.levels_per_call), so the table
shows whether "auto" picks the faster of the two. `--tuned` adds the plan
that `optimize(model, tune=...)` measures and picks (timed beside them).

Run on the GPU machine (writes JSON after every configuration, so a run cut
short keeps what it measured):

    KERAS_BACKEND=torch python3 bench/bench_torch.py --out $OUT/bench_torch.json

A small matrix for a CPU:

    KERAS_BACKEND=torch python bench/bench_torch.py --quick --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import csv_list, run_matrix, out_path  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.fused import fused_layers  # noqa: E402
from rnnfuse.api import choose_plans  # noqa: E402
from rnnfuse.backends import torch as torch_backend  # noqa: E402

FULL = dict(
    kinds=["lstm", "gru"],
    layers=[2, 4],
    batch=[8, 64],
    steps=[100, 1000],
    units=[256, 512],
    policies=["float32", "mixed_float16"],
)
QUICK = dict(
    kinds=["lstm", "gru"],
    layers=[2, 4],
    batch=[16],
    steps=[100],
    units=[64, 128],
    policies=["float32"],
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=out_path("torch.json"), help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="small CPU matrix")
    p.add_argument("--kinds", type=csv_list(str))
    p.add_argument("--layers", type=csv_list(int))
    p.add_argument("--batch", type=csv_list(int))
    p.add_argument("--steps", type=csv_list(int))
    p.add_argument("--units", type=csv_list(int))
    p.add_argument("--policies", type=csv_list(str))
    p.add_argument("--modes", type=csv_list(str), default=["train", "infer"])
    p.add_argument("--call-modes", type=csv_list(str), default=["auto", "one", "per_level"])
    p.add_argument(
        "--tuned",
        action="store_true",
        help="also time optimize(model, tune=...) (the plan the tuner measures and picks)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--max-seconds", type=float, default=540.0,
        help="stop starting new configurations after this long",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (CPU runs)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build(kind, layers, steps, units, policy):
    keras.config.set_dtype_policy(policy)
    try:
        cls = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[kind]
        inp = keras.Input((steps, units))
        x = inp
        for i in range(layers):
            x = cls(units, return_sequences=True, name=f"{kind}_{i}")(x)
        model = keras.Model(inp, x)
    finally:
        keras.config.set_dtype_policy("float32")
    return model


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_fn(model, x, mode):
    variables = [v.value for v in model.trainable_variables]

    def train():
        for v in variables:
            v.grad = None
        y = model(x, training=True)
        loss = torch.mean(torch.square(y.float()))
        loss.backward()

    def infer():
        with torch.no_grad():
            model(x, training=False)

    return train if mode == "train" else infer


def time_once(fn):
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def _with_mode(fn, mode):
    def run():
        with torch_backend.call_mode(mode):
            fn()

    return run


def _calls_per_step(fn, mode):
    """(number of torch._VF calls, num_layers of each) in one step."""
    seen = []
    real = torch_backend.torch_rnn

    def spy(kind, *args):
        packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64
        seen.append(args[5] if packed else args[4])  # num_layers
        return real(kind, *args)

    torch_backend.torch_rnn = spy
    try:
        with torch_backend.call_mode(mode):
            fn()
    finally:
        torch_backend.torch_rnn = real
    return seen


def fast_groups(model):
    """The fusion groups of `model` (what optimize would fuse)."""
    return rnnfuse.analyze(model).groups


def measure(config, args):
    kind, layers, batch, steps, units, policy = config
    keras.utils.set_random_seed(0)
    model = build(kind, layers, steps, units, policy)
    fast = rnnfuse.optimize(model)
    fused = fused_layers(fast)
    x = keras.ops.convert_to_tensor(
        np.random.default_rng(0).standard_normal((batch, steps, units)).astype("float32")
    )
    rows = []
    for mode in args.modes:
        fns = {"original": step_fn(model, x, mode)}
        calls = {}
        for call_mode in args.call_modes:
            fns[f"fused:{call_mode}"] = _with_mode(step_fn(fast, x, mode), call_mode)
            calls[call_mode] = _calls_per_step(step_fn(fast, x, mode), call_mode)
        tuned_plan = tuner_ms = None
        if args.tuned:
            (result,) = choose_plans(
                model, fast_groups(model), tune=rnnfuse.TuneShape(batch, steps),
                training=mode == "train", cache=False,
            )
            tuned_plan = result.plan.name
            tuner_ms = {n: t * 1e3 for n, t in result.timings.items()}
            tuned = rnnfuse.optimize(model, plan=result.plan)
            fns["tuned"] = step_fn(tuned, x, mode)
        for fn in fns.values():
            for _ in range(args.warmup):
                fn()
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():  # interleaved
                times[name].append(time_once(fn))
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append(
            dict(
                kind=kind, layers=layers, batch=batch, steps=steps, units=units,
                policy=policy, mode=mode,
                median_ms=med,
                speedup={n: med["original"] / m for n, m in med.items() if n != "original"},
                all_ms=times,
                # num_layers of each torch._VF call in one step, per call mode
                vf_calls=calls,
                fused_groups=len(fused),
                fused_path=[l.last_path for l in fused],
                tuned_plan=tuned_plan,
                tuner_ms=tuner_ms,
            )
        )
    return rows


def describe(r: dict) -> str:
    fused = "  ".join(
        f"{n} {m:8.2f} (x{r['speedup'][n]:.2f})"
        for n, m in r["median_ms"].items()
        if n != "original"
    )
    return (
        f"{r['kind']} L{r['layers']} B{r['batch']} T{r['steps']} H{r['units']} "
        f"{r['policy']:14s} {r['mode']:5s} original {r['median_ms']['original']:8.2f} ms  "
        f"{fused}  {r['fused_path']} calls={r['vf_calls']}"
        + (f" tuned={r['tuned_plan']}" if r["tuned_plan"] else "")
    )


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    meta = dict(
        keras_backend=keras.backend.backend(),
        keras=keras.__version__,
        torch=torch.__version__,
        cuda=torch.cuda.is_available(),
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        cpu_threads=torch.get_num_threads(),
        repeats=args.repeats,
        warmup=args.warmup,
        tf32=args.tf32,
    )
    if meta["keras_backend"] != "torch":
        sys.exit("bench_torch.py needs KERAS_BACKEND=torch")
    configs = list(
        itertools.product(args.kinds, args.layers, args.batch, args.steps, args.units, args.policies)
    )
    run_matrix(
        configs,
        lambda config: measure(config, args),
        describe,
        meta=meta,
        out=args.out,
        max_seconds=args.max_seconds,
    )

if __name__ == "__main__":
    main()
