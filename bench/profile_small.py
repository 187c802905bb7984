"""Where a small model's training step goes under torch: the GPU, Keras'
loop, and rnnfuse's own host work.

For each small float32 shape of bench/bench_matrix.py (`--shapes`), three
Keras models are compiled as a user would (Adam, MSE): "original" (Keras'
layers), "optimized" (`rnnfuse.optimize(model, cache=False)`, its tuned
plan) and "fused" (`plan=rnnfuse.FUSED`: the whole run as one fused call,
whatever the tuner would choose). After a warm-up fit (traces, tuning):

- `fit_ms`, `train_on_batch_ms`, `loop_ms`: step medians, the models
  interleaved (`fit`: the gap between two batch ends; `loop`: a plain torch
  loop of forward, backward and a torch Adam step on the Keras model);
  `pytorch_ms`: bench_matrix's plain PyTorch loop (nn.LSTM/GRU/RNN);
- `host`: host milliseconds a step spent in each model's recurrent layer
  calls (forward): `rnn_calls_ms` (Keras' RNN layers' calls, outermost),
  `fused_calls_ms` (FusedRNN calls), `kernel_calls_ms` (the calls that
  launch or run the recurrent kernels: the cuDNN core's C calls on a GPU,
  `torch._VF` on the CPU) and `rnnfuse_own_ms` = fused calls minus the
  kernel calls inside them (rnnfuse's Python, packing and allocation work
  on the host; the backward's host work shows in `profile.ops`);
- `profile` (torch.profiler over `--steps` fit steps): `wall_ms` a step,
  `gpu_busy_ms` a step (the union of kernel and copy intervals), the idle
  gaps between them (count and total above 20 us, the largest), `syncs`
  (host synchronizations a step: CUDA's sync calls and torch's sync debug
  warnings), `allocations` a step (the caching allocator's count) and the
  top `ops` by self CPU time, with their calls a step;
- `knobs`: a warm whole `fit` call's seconds a step under
  `steps_per_execution` in `--spe` and with `jit_compile=True` (torch.compile;
  an error is recorded, not raised), original and optimized.

One JSON, rewritten after each piece (a run cut short keeps what it
measured).

    KERAS_BACKEND=torch python bench/profile_small.py --out /tmp/profile_small.json
    KERAS_BACKEND=torch python bench/profile_small.py --quick --out /tmp/q.json   # tiny, any machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SMALL = "gru3x64,rnn3x256,lstm8x128,lstm2x40"
# Steps a timed fit where Keras' original step is slow (SimpleRNN under
# torch runs Keras' Python loop: a third of a second a step on a Hopper
# GPU); others take --steps.
FEW_STEPS = {"rnn3x256": 5}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
GAP_US = 20.0


def union_gaps(intervals: list[tuple[float, float]], gap_us: float = GAP_US) -> tuple[float, list[float]]:
    """(busy time, gaps above `gap_us`) of [start, end) intervals, in their unit.

    >>> union_gaps([(0, 10), (5, 12), (40, 50), (51, 52)])
    (23, [28])
    """
    busy, gaps, end = 0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None and s - end > gap_us:
                gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


class HostTimers:
    """Host seconds spent in the recurrent layers' calls and the kernel
    calls, while `on()`: patches the classes' methods, undone on exit."""

    def __init__(self):
        # kernel_calls_in_fused: the kernel calls made inside a FusedRNN
        # call (its forward); the backward's run after it, from autograd.
        self.seconds = {"rnn_calls": 0.0, "fused_calls": 0.0, "kernel_calls": 0.0,
                        "kernel_calls_in_fused": 0.0}
        self.calls = {k: 0 for k in self.seconds}
        self._depth = {"layer": 0, "kernel": 0}
        self._fused_depth = 0

    def _wrap(self, owner, attr, key, depth):
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            outer = self._depth[depth] == 0
            self._depth[depth] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[depth] -= 1
                if outer:
                    took = time.perf_counter() - start
                    self.seconds[key] += took
                    self.calls[key] += 1
                    if key == "kernel_calls" and self._in_fused():
                        self.seconds["kernel_calls_in_fused"] += took
                        self.calls["kernel_calls_in_fused"] += 1

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, original)

    def _in_fused(self) -> bool:
        return self._fused_depth > 0

    @contextlib.contextmanager
    def on(self):
        import keras

        import rnnfuse.backends.torch as torch_kernels
        from rnnfuse.backends.cuda import cudnn_core
        from rnnfuse.fused import FusedRNN

        real_call = FusedRNN.__call__

        def fused_call(layer, *args, **kwargs):
            self._fused_depth += 1
            try:
                return real_call(layer, *args, **kwargs)
            finally:
                self._fused_depth -= 1

        FusedRNN.__call__ = fused_call
        undo = [lambda: setattr(FusedRNN, "__call__", real_call),
                self._wrap(FusedRNN, "__call__", "fused_calls", "layer"),
                self._wrap(keras.layers.RNN, "__call__", "rnn_calls", "layer"),
                self._wrap(torch_kernels, "torch_rnn", "kernel_calls", "kernel")]
        undo += [self._wrap(cudnn_core.CoreLibrary, name, "kernel_calls", "kernel")
                 for name in ("forward", "backward_data", "backward_weights")]
        try:
            yield self
        finally:
            for u in reversed(undo):
                u()

    def per_step(self, steps: int) -> dict:
        ms = {f"{k}_ms": 1e3 * v / steps for k, v in self.seconds.items()}
        ms["rnnfuse_own_ms"] = ms["fused_calls_ms"] - ms["kernel_calls_in_fused_ms"]
        ms["calls"] = {k: v / steps for k, v in self.calls.items()}
        return ms


def _fit(model, x, y, batch, callbacks=()):
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))


def profile_fit(model, x, y, batch: int, steps: int) -> dict:
    """torch.profiler over one fit of `steps` batches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    before = torch.cuda.memory_stats() if cuda else {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                _fit(model, x, y, batch)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    after = torch.cuda.memory_stats() if cuda else {}
    events = prof.events()
    device = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, gaps = union_gaps(device)
    sync_calls = {}
    for e in events:
        if e.name in SYNC_CALLS:
            sync_calls[e.name] = sync_calls.get(e.name, 0) + 1
    sync_warnings = {}
    for w in seen:
        text = str(w.message)
        if "synchronizing" in text:
            key = text.split(":")[0][:80]
            sync_warnings[key] = sync_warnings.get(key, 0) + 1
    ops = {}
    for a in prof.key_averages():
        if a.device_type == torch.autograd.DeviceType.CPU:
            ops[a.key] = (a.self_cpu_time_total, a.count)
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:25]
    n = steps
    allocated = "allocation.all.allocated"
    return dict(
        wall_ms=1e3 * wall / n,
        gpu_busy_ms=busy / 1e3 / n if device else None,
        gaps=dict(count=len(gaps) / n, total_ms=sum(gaps) / 1e3 / n,
                  largest_us=sorted(gaps)[-5:]) if device else None,
        syncs=dict(calls={k: v / n for k, v in sync_calls.items()},
                   warnings={k: v / n for k, v in sync_warnings.items()}),
        allocations=(after.get(allocated, 0) - before.get(allocated, 0)) / n if cuda else None,
        ops=[dict(name=k, self_cpu_ms=t / 1e3 / n, calls=c / n) for k, (t, c) in top],
    )


def host_split(model, x, y, batch: int, steps: int) -> dict:
    with HostTimers().on() as timers:
        start = time.perf_counter()
        _fit(model, x, y, batch)
        wall = time.perf_counter() - start
    row = timers.per_step(steps)
    row["fit_wall_ms"] = 1e3 * wall / steps
    return row


def knobs(build, x, y, batch: int, steps: int, settings: list[tuple], rows: list, save) -> None:
    """A warm whole fit's ms a step per (steps_per_execution, jit_compile)
    setting, original and optimized, appended to `rows` and saved one by one."""
    for k, j in settings:
        for name in ("original", "optimized"):
            row = dict(model=name, steps_per_execution=k, jit_compile=j)
            try:
                m = build(name)
                m.compile(optimizer="adam", loss="mse", steps_per_execution=k, jit_compile=j)
                _fit(m, x, y, batch)  # traces (torch.compile's too) and tuning
                start = time.perf_counter()
                _fit(m, x, y, batch)
                row["ms_a_step"] = 1e3 * (time.perf_counter() - start) / steps
            except Exception as err:  # noqa: BLE001 - record it
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
            save()
            print("knob", row, flush=True)


def measure(name: str, shape: dict, steps: int, rounds: int, save) -> tuple[dict, tuple]:
    """One shape's row (knobs apart) and what `knobs` needs for it."""
    import numpy as np

    import bench_matrix
    import rnnfuse
    from bench_user_view import _alternate, custom_loop

    base = bench_matrix.build_keras(shape)

    def build(kind):
        if kind == "original":
            return bench_matrix.build_keras(shape) if kind_fresh[0] else base
        if kind == "fused":
            return rnnfuse.optimize(base, plan=rnnfuse.FUSED)
        return rnnfuse.optimize(base, cache=False)

    kind_fresh = [False]
    models = {k: build(k) for k in ("original", "optimized", "fused")}
    for m in models.values():
        m.compile(optimizer="adam", loss="mse")
    x, y, _ = bench_matrix.data(shape)
    b = shape["batch"]
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    for m in models.values():
        _fit(m, xs, ys, b)  # traces and tuning
    from rnnfuse.fused import fused_layers

    row = dict(shape_name=name, shape=shape,
               plans={k: [f.plan.name for f in fused_layers(m)] for k, m in models.items()})
    pair = list(models.items())
    fit = _alternate(pair, rounds, lambda m, cb: m.fit(xs, ys, batch_size=b, epochs=1, verbose=0,
                                                        callbacks=[cb]))
    row["fit_ms"] = {k: 1e3 * statistics.median(v) for k, v in fit.items()}
    tob = {k: [] for k in models}
    for r in range(3 * rounds):
        for k, m in pair if r % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            float(np.asarray(m.train_on_batch(x, y)))
            tob[k].append(time.perf_counter() - start)
    row["train_on_batch_ms"] = {k: 1e3 * statistics.median(v[1:]) for k, v in tob.items()}
    loop = custom_loop(pair, x, y, steps=steps * rounds, block=steps)
    row["loop_ms"] = {k: 1e3 * statistics.median(v[1:]) for k, v in loop.items()}
    try:
        peer = bench_matrix.measure_pytorch(shape, 1, 2, rounds, steps)
        row["pytorch_ms"] = peer["fit_ms"]["pytorch"]
    except Exception as err:  # noqa: BLE001 - record it
        row["pytorch_ms"] = f"{type(err).__name__}: {err}"[:200]
    print(name, "fit_ms", row["fit_ms"], "loop_ms", row["loop_ms"], "pytorch_ms", row["pytorch_ms"],
          flush=True)
    save(row)
    row["host"] = {k: host_split(m, xs, ys, b, steps) for k, m in models.items()}
    print(name, "host", {k: round(v["rnnfuse_own_ms"], 3) for k, v in row["host"].items()},
          {k: round(v["fit_wall_ms"], 3) for k, v in row["host"].items()}, flush=True)
    save(row)
    row["profile"] = {}
    for k, m in models.items():
        try:
            p = row["profile"][k] = profile_fit(m, xs, ys, b, steps)
            print(name, "profile", k, f"wall {p['wall_ms']:.2f} ms busy {p['gpu_busy_ms']} "
                  f"syncs {p['syncs']} allocations {p['allocations']}", flush=True)
        except Exception as err:  # noqa: BLE001 - a profiler that cannot run here: record it
            row["profile"][k] = dict(error=f"{type(err).__name__}: {err}"[:300])
            print("ERROR", name, "profile", k, row["profile"][k]["error"], flush=True)
        save(row)
    kind_fresh[0] = True
    return row, (build, xs, ys, b)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file, rewritten after each piece")
    parser.add_argument("--shapes", default=SMALL, help="comma-separated names of bench_matrix.SHAPES")
    parser.add_argument("--steps", type=int, default=20, help="steps a timed fit")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--spe", default="1,8", help="steps_per_execution values of the knobs")
    parser.add_argument("--no-jit", action="store_true", help="leave jit_compile=True out of the knobs")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, any machine")
    args = parser.parse_args(argv)

    import keras
    import torch

    import bench_matrix
    import rnnfuse
    from common import out_path

    if keras.backend.backend() != "torch":
        parser.error(f"profile_small profiles the torch backend; KERAS_BACKEND is {keras.backend.backend()!r}")
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in bench_matrix.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(bench_matrix.SHAPES)}")
    out = args.out or out_path("profile_small_torch.json")
    meta = dict(backend="torch", torch=torch.__version__, keras=keras.__version__,
                rnnfuse=rnnfuse.__version__, python=platform.python_version(),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                steps=args.steps, rounds=args.rounds, quick=args.quick)
    results = []

    def save(row):
        rows = results + ([] if any(r is row for r in results) else [row])
        with open(out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)

    spe = [int(k) for k in args.spe.split(",") if k]
    later = []
    for name in names:
        shape = bench_matrix.SHAPES[name]
        shape = bench_matrix.quick(shape) if args.quick else shape
        try:
            steps = min(args.steps, FEW_STEPS.get(name, args.steps))
            row, context = measure(name, shape, steps, args.rounds, save)
            later.append((row, context))
        except Exception as err:  # noqa: BLE001 - record and go on
            row = dict(shape_name=name, error=f"{type(err).__name__}: {err}"[:500])
            print("ERROR", name, row["error"], flush=True)
        results.append(row)
        save(row)
    # The knobs last, jit_compile after every shape's steps_per_execution:
    # torch.compile's first call may take long.
    phases = [[(k, False) for k in spe]] + ([[(1, True)]] if not args.no_jit else [])
    # A SimpleRNN's Python loop compiles longest: last.
    later.sort(key=lambda pair: pair[0]["shape"]["kind"] == "simple_rnn")
    for settings in phases:
        for row, (build, xs, ys, b) in later:
            rows = row.setdefault("knobs", [])
            steps = len(xs) // row["shape"]["batch"]
            knobs(build, xs, ys, b, steps, settings, rows, lambda row=row: save(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
