"""Where first-batch tuning's seconds go: per candidate plan, its trace, its
first call (graph optimisation, cuDNN's set-up, one run), and the timed
calls; then the gradient check, for one user-view cell's first `fit` and
first `predict`.

Made for the tuning-overhead target of docs/benchmarks.md (tuning of the
median drawn model against 10 epochs of it): it says which of tracing,
cuDNN's set-up, timing and the float64 gradient check to cut. It wraps the
tuner's own functions (`_first_calls`, `interleaved_medians`,
`GradientCheck`), so the figures are those of a real first-batch tuning;
`--profile` adds cProfile's top functions by cumulative time.

`--emulate` (a machine without a GPU): the tuner times the GPU's candidate
set on the CPU, as the tests do, and the device is named a GPU. Under
TensorFlow (tests/conftest.py's `emulated_op`) rnnfuse's cuDNN op is
replaced by a few differentiable ops of its output shapes (one op on the
GPU: a trace of the reference's Python loop over the steps would be
nothing like it) and CudnnRNNV3 by the reference of tests/cudnn_reference.py;
under JAX the core is made available as tests/jax_backend/core_emulation.py
does (its refusals included) and its differentiable call is likewise a few
ops of its output shapes (the emulation's unrolled equations would make
every compile that of a loop). Host seconds only (traces, graph set-up,
compiles, tuning's own Python); the timings and choices mean nothing.

The fit is one batch, so the budget rule (rnnfuse.tuning.budget) would
give it the static plan: the fit here times every candidate, as a long
fit does. Under JAX every phase also counts XLA's compiles (jax.monitoring's
backend-compile events: `compiles`, `compile_s`). `static_optimize` is a
static `optimize(model)` of the same model: its seconds, compiles and
cProfile's top functions.

    python bench/diag_tuning_cost.py --cells 15,A1 --out $OUT/tuning_cost.json
    KERAS_BACKEND=jax python bench/diag_tuning_cost.py --cells lstm4x512,bigru5x512 --out $OUT/t.json
    python bench/diag_tuning_cost.py --quick --out /tmp/t.json   # tiny, any machine
    python bench/diag_tuning_cost.py --cells 19 --compare 2 --out $OUT/pipelined.json
    python bench/diag_tuning_cost.py --cells 15 --compare 3 --arms full,cut --out $OUT/cut.json
    python bench/diag_tuning_cost.py --quick --emulate --cells 3 --out /tmp/t.json
    KERAS_BACKEND=jax python bench/diag_tuning_cost.py --quick --emulate --cells lstm4x512 --out /tmp/t.json
    python bench/diag_tuning_cost.py --table bench/results/tuning_cost_tf_h200_s17a.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from bench_user_view import _tuning_seconds, build, cell_shape, data  # noqa: E402
from report_user_view import shape_text  # noqa: E402
from rnnfuse.tuning import tuner  # noqa: E402


class XlaCompiles:
    """Counts XLA's compiles (and their seconds) inside a `with` block, from
    jax.monitoring's backend-compile events: every jit, AOT `.compile()` or
    op-by-op dispatch that compiles reports one. Under other backends it
    counts nothing (`listening` is False).

    >>> with XlaCompiles() as c:
    ...     pass
    >>> c.count
    0
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds, self.listening = 0, 0.0, False

    def _heard(self, event: str, seconds: float, **_):
        if event == self.EVENT:
            self.count += 1
            self.seconds += seconds

    def __enter__(self):
        if keras.backend.backend() == "jax":
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._heard)
            self.listening = True
        return self

    def __exit__(self, *exc):
        if self.listening:
            import jax.monitoring

            jax.monitoring.unregister_event_duration_listener(self._heard)
        return False


class Recorder:
    """Wraps the tuner's phases for one `with` block and keeps their times.

    Per candidate: its first call's seconds (`first_call_s`) and, under
    TensorFlow, the part of it spent running the step's Python body while
    tracing (`trace_s`; a shared step's trace is its first candidate's).
    Phases: building the steps (`build_s`: the fused pieces, the
    tf.functions), the first calls (traces included), the timed calls and
    the gradient check; `traces` counts the step traces. Under JAX,
    `<phase>_compiles` counts each phase's XLA compiles (`XlaCompiles`)."""

    def __init__(self, serial: bool = False, full: bool = False):
        self.serial, self.full = serial, full
        self.candidates: dict[str, dict] = {}
        self.phases = {"build_s": 0.0, "first_calls_s": 0.0, "timing_s": 0.0,
                       "gradient_check_s": 0.0, "trace_s": 0.0, "traces": 0}
        self.gradient_checks = []
        self.compiles = XlaCompiles()

    def _phase(self, name: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, its seconds added to phase `name`_s and
        its XLA compiles to `name`_compiles."""
        start, compiled = time.perf_counter(), self.compiles.count
        try:
            return fn(*args, **kwargs)
        finally:
            self.phases[f"{name}_s"] += time.perf_counter() - start
            if self.compiles.listening:
                key = f"{name}_compiles"
                self.phases[key] = self.phases.get(key, 0) + self.compiles.count - compiled

    def __enter__(self):
        self._saved = (tuner._steps, tuner._first_calls, tuner.interleaved_medians,
                       tuner.GradientCheck.__call__)
        steps_of, first_calls, medians, check = self._saved
        rec = self
        body = None
        if keras.backend.backend() == "tensorflow":
            from rnnfuse.backends import tensorflow as tf_backend

            body = tf_backend._step_body

            def traced_body(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return body(*args, **kwargs)
                finally:
                    rec._traced += time.perf_counter() - start
                    rec.phases["traces"] += 1

            tf_backend._step_body = traced_body
        self._body, self._traced = body, 0.0

        def timed_steps(*args, **kwargs):
            return rec._phase("build", steps_of, *args, **kwargs)

        def timed_first_calls(steps, plans, seconds=None):
            return rec._phase("first_calls", first_calls_of, steps, plans, seconds)

        def first_calls_of(steps, plans, seconds=None):
            # All at once, as tuning makes them (a traced step's first call
            # overlaps the next one's trace, JAX compiles them together),
            # each trace timed on its own.
            calls = {}
            wrapped = {}
            for name, step in steps.items():
                trace = getattr(step, "trace", None)
                if not callable(step) or (trace is None and not rec.serial):
                    wrapped[name] = step
                    continue
                call = (lambda step=step: step())
                if not rec.serial:  # --serial: untraceable, so traced in its first call
                    call.trace = rec._timed_trace(name, trace)
                    if callable(getattr(step, "compile", None)):
                        call.compile = step.compile
                wrapped[name] = call
            kept, refused = first_calls(wrapped, plans, calls)
            for name, took in calls.items():
                rec.candidates.setdefault(name, {})["first_call_s"] = took
            if seconds is not None:
                seconds.update(calls)
            return {n: steps[n] for n in kept}, refused

        def timed_medians(steps, **kwargs):
            if rec.full:  # a warm-up call and no margin race: every candidate's full rounds
                kwargs = {k: v for k, v in kwargs.items() if k != "beat"} | {"warmup": 1}
            stats = rec._phase("timing", medians, steps, **kwargs)
            for name, s in stats.items():
                row = rec.candidates.setdefault(name, {})
                row.update(median_ms=1e3 * s["median"], timed_calls=len(s["times"]), pruned=s["pruned"])
            return stats

        def timed_check(self_, group, plan, shape, dtype):
            start, compiled = time.perf_counter(), rec.compiles.count
            try:
                return rec._phase("gradient_check", check, self_, group, plan, shape, dtype)
            finally:
                rec.gradient_checks.append(dict(plan=plan.name, seconds=time.perf_counter() - start,
                                                compiles=rec.compiles.count - compiled))

        tuner._steps, tuner._first_calls = timed_steps, timed_first_calls
        tuner.interleaved_medians, tuner.GradientCheck.__call__ = timed_medians, timed_check
        self.compiles.__enter__()
        return self

    def _timed_trace(self, name, trace):
        def timed():
            start = time.perf_counter()
            try:
                return trace()
            finally:
                self.candidates.setdefault(name, {})["trace_s"] = time.perf_counter() - start
        return timed

    def __exit__(self, *exc):
        self.compiles.__exit__(*exc)
        if self.compiles.listening:
            self.phases.update(compiles=self.compiles.count, compile_s=self.compiles.seconds)
        (tuner._steps, tuner._first_calls, tuner.interleaved_medians,
         tuner.GradientCheck.__call__) = self._saved
        if self._body is not None:
            from rnnfuse.backends import tensorflow as tf_backend

            tf_backend._step_body = self._body
        self.phases["trace_s"] = self._traced
        return False


TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def emulate_gpu_on_cpu() -> None:
    """Makes this process's backend (TensorFlow or JAX) time the GPU
    candidate set on the CPU (see the module doc): for `--emulate` only,
    never undone."""
    import tempfile

    # Its decisions are filed in a folder of their own, never read again.
    os.environ["RNNFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="rnnfuse_emulated_")
    sys.path.insert(0, TESTS)
    if keras.backend.backend() == "jax":
        _emulate_jax_core()
    elif keras.backend.backend() == "tensorflow":
        _emulate_tensorflow_op()
    else:
        raise SystemExit(f"--emulate: TensorFlow or JAX only, not {keras.backend.backend()}; "
                         "set KERAS_BACKEND=tensorflow or jax")


class _Setter:
    """The one method of pytest's monkeypatch that core_emulation.install uses."""

    @staticmethod
    def setattr(owner, name, value):
        setattr(owner, name, value)


def _emulate_jax_core() -> None:
    """The cuDNN core available as tests/jax_backend/core_emulation.py makes
    it, its call a few ops of its output shapes, and the CPU named a GPU."""
    sys.path.insert(0, os.path.join(TESTS, "jax_backend"))
    import core_emulation
    import jax.numpy as jnp

    from rnnfuse.backends import jax as jax_backend
    from rnnfuse.backends.jax import cudnn_core

    def rnn(x, hx, cx, params, lengths, *, config, training=False):
        # A gradient to every input, as the one custom call on the GPU has.
        width = config.directions * (config.proj_size or config.units)
        mix = jnp.mean(x, -1, keepdims=True) + jnp.mean(params).astype(x.dtype)
        y = jnp.tanh(mix * jnp.ones((width,), x.dtype))
        hy = hx * 0.5 + jnp.mean(y).astype(hx.dtype)
        return y, hy, (cx * 0.5 + jnp.mean(hy).astype(cx.dtype) if config.lstm else None)

    core_emulation.install(_Setter())
    cudnn_core.rnn = rnn
    environment = jax_backend.device_environment
    jax_backend.device_environment = lambda: {**environment(), "device": "EmulatedGPU"}


def _emulate_tensorflow_op() -> None:
    """rnnfuse's cuDNN op and CudnnRNNV3 -> their CPU stand-ins (module doc)."""
    import tensorflow as tf
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.tensorflow import cudnn_op

    def call_op(module, **kw):
        # A few ops with the op's output shapes and a gradient to every
        # input, standing for one op as the real one is (the reference's
        # unrolled loop would make a fused trace grow with the steps).
        x, h0, params = kw["input"], kw["input_h"], kw["params"]
        width = h0.shape[-1] * (2 if kw["direction"] == "bidirectional" else 1)
        mix = tf.reduce_mean(x, -1, keepdims=True) + tf.cast(tf.reduce_mean(params), x.dtype)
        y = tf.tanh(mix * tf.ones([width], x.dtype))
        h = h0 * 0.5 + tf.cast(tf.reduce_mean(y), h0.dtype)
        c = (kw["input_c"] * 0.5 + h if kw["rnn_mode"] == "lstm" else tf.zeros([0], y.dtype))
        return y, h, c, tf.zeros([0], tf.uint8)

    def op_for(dtype, dropout):
        reason = cudnn_op.op_unsupported_reason(dtype, dropout)
        return (None, reason) if reason is not None else (object(), None)

    environment = tf_backend.device_environment
    cudnn_op.call_op = call_op
    tf_backend.cudnn_rnn = emulated_cudnn_rnn
    tf_backend.is_available = lambda: True
    tf_backend.op_loaded = lambda: True
    tf_backend._op_for = op_for
    tf_backend.device_environment = lambda: {**environment(), "device": "EmulatedGPU"}


def _tune(fast, run, profile: bool, serial: bool = False, full: bool = False) -> dict:
    """Runs `run()` (a first fit or predict) with its tuning recorded
    (`serial`: each step traced in its first call, one after another, as
    rather than pipelined; `full`: a warm-up call after each first call
    and no race against the original layers' margin)."""
    before = _tuning_seconds(fast)
    profiler = cProfile.Profile() if profile else None
    with Recorder(serial, full) as rec:
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        run()
        call_s = time.perf_counter() - start
        if profiler:
            profiler.disable()
    out = dict(
        tuning_s=_tuning_seconds(fast) - before,
        call_s=call_s,
        phases=rec.phases,
        candidates=rec.candidates,
        gradient_checks=rec.gradient_checks,
    )
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def static_optimize(shape: dict) -> dict:
    """A static `optimize` (tune="auto": the static table until a first
    batch) of a new model of `shape`: its seconds, XLA compiles and
    cProfile's functions by cumulative time (`profile`; `top`: the slowest
    of rnnfuse's own, with their seconds)."""
    model = build(shape)
    profiler = cProfile.Profile()
    with XlaCompiles() as compiles:
        profiler.enable()
        start = time.perf_counter()
        rnnfuse.optimize(model, cache=False)
        seconds = time.perf_counter() - start
        profiler.disable()
    out = dict(seconds=seconds)
    if compiles.listening:
        out.update(compiles=compiles.count, compile_s=compiles.seconds)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(30)
    out["profile"] = text.getvalue()
    own = [(f"{os.path.basename(file)}:{line}({name})", row[3])
           for (file, line, name), row in stats.stats.items() if "rnnfuse" in file]
    out["top"] = sorted(own, key=lambda r: -r[1])[:8]
    return out


def gradient_check_alone(shape: dict) -> dict | None:
    """The tuner's gradient check of the whole run on the first tuned
    cuDNN algorithm (else the default one), with its twin and the float64
    reference, on a new model of `shape`: seconds and XLA compiles. A fit
    checks gradients only where such a plan beats the original layers, so
    this is measured apart. None where nothing can be timed here."""
    if tuner.device_environment() is None:
        return None
    model = build(shape)
    (group, *_) = rnnfuse.analyze(model).groups
    plans = [p for p in tuner.candidates_for(keras.backend.backend())(group)
             if p.pieces == (len(group.layers),)]
    plan = next((p for p in plans if p.algorithm), plans[0])
    batch = (shape["batch"], shape["steps"], group.input_size)
    with XlaCompiles() as compiles:
        start = time.perf_counter()
        error = tuner.GradientCheck()(group, plan, batch, group.dtype)
        seconds = time.perf_counter() - start
    out = dict(plan=plan.name, seconds=seconds, error=error)
    if compiles.listening:
        out.update(compiles=compiles.count, compile_s=compiles.seconds)
    return out


def measure(shape: dict, profile: bool, serial: bool = False, full: bool = False) -> dict:
    # First: a process's first optimize pays its one-time set-up.
    static = static_optimize(shape)
    model = build(shape)
    x, y = data(shape, np.random.default_rng(0))
    fast = rnnfuse.optimize(model, cache=False)  # what a new user's first calls pay
    state = getattr(fast, "_rnnfuse_autotune", None)
    if state is not None:
        # A one-batch fit: the budget would keep the static plan; time it all.
        state.fit_share = None
    fast.compile(optimizer="adam", loss="mse")
    b = shape["batch"]
    fit = _tune(fast, lambda: fast.fit(x, y, batch_size=b, epochs=1, verbose=0), profile, serial,
                full)
    predict = _tune(fast, lambda: fast.predict(x, batch_size=b, verbose=0), profile, serial, full)
    return dict(shape=shape, fit=fit, predict=predict, serial=serial, full=full,
                decisions=rnnfuse.tuning.first_batch.decisions(fast),
                static_optimize=static, gradient_check=gradient_check_alone(shape))


# --compare's arms: name -> measure()'s keyword arguments.
ARMS = {
    "serial": {"serial": True}, "pipelined": {},  # first calls one after another, or pipelined
    "full": {"full": True}, "cut": {},  # every round, or the race against the margin
}


def compare(shape: dict, pairs: int, arms: tuple = ("serial", "pipelined")) -> dict:
    """Two arms of the tuner (`ARMS`) on one cell, in one process: a
    warm-up run (the process's one-time set-up; kept as `first_run`, what
    a new process's first tuning pays), then `pairs` pairs in alternating
    order (A B, B A, ...); medians of the tuning seconds, and each run's
    phases and decisions (the arms must decide alike)."""
    import statistics

    def summary(row):
        return ({m: row[m]["tuning_s"] for m in ("fit", "predict")}
                | {"phases": {m: row[m]["phases"] for m in ("fit", "predict")},
                   "decisions": [(d["mode"], d["chosen"]) for d in row["decisions"]],
                   "timings_ms": [d["timings_ms"] for d in row["decisions"]]})

    first = summary(measure(shape, False))
    runs = {arm: [] for arm in arms}
    for i in range(pairs):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            runs[arm].append(summary(measure(shape, False, **ARMS[arm])))
    medians = {k: {m: statistics.median(r[m] for r in v) for m in ("fit", "predict")}
               for k, v in runs.items()}
    return dict(shape=shape, first_run=first, runs=runs, medians=medians)


def table(rows: list[dict]) -> str:
    """A markdown table of saved rows: per cell and mode, the tuning's
    seconds and where they went. "first calls" is each candidate's first
    call less its trace (graph optimisation, cuDNN's set-up, one run)."""
    lines = [
        "| cell | model | mode | candidates (timed to the end) | tuning s | traces s | first calls s | timing s | gradient check s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        model = shape_text(row["shape"])
        for mode in ("fit", "predict"):
            r = row[mode]
            ph = r["phases"]
            kept = sum(1 for c in r["candidates"].values() if not c.get("pruned"))
            lines.append(
                f"| {row['cell']} | {model} | {mode} | {len(r['candidates'])} ({kept}) | {r['tuning_s']:.1f} "
                f"| {ph['trace_s']:.1f} | {ph['first_calls_s'] - ph['trace_s']:.1f} | {ph['timing_s']:.1f} "
                f"| {ph['gradient_check_s']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", help="print the markdown table of a saved --out file and stop")
    parser.add_argument("--cells", default="15", help="drawn cell numbers (A1.. for anchors, or bench_matrix's shape names), comma-separated")
    parser.add_argument("--profile", action="store_true", help="add cProfile's top 30 functions")
    parser.add_argument("--quick", action="store_true", help="the cells with 32 units, batch 4, 10 steps: any machine")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU (TensorFlow, JAX): time the GPU's candidates on the CPU, emulated")
    parser.add_argument("--compare", type=int, default=0, metavar="PAIRS",
                        help="time each cell's tuning PAIRS times in each of --arms")
    parser.add_argument("--arms", default="serial,pipelined",
                        help=f"--compare's two arms, of {', '.join(ARMS)} (serial,pipelined: "
                             "how first calls are made; full,cut: with or without the race's cut)")
    parser.add_argument("--out", default=None, help="the JSON file (default: outside the repository, common.out_path)")
    args = parser.parse_args(argv)
    arms = tuple(args.arms.split(","))
    if len(arms) != 2 or not set(arms) <= set(ARMS):
        parser.error(f"--arms takes two of {', '.join(ARMS)}, comma-separated; received {args.arms!r}")
    if args.emulate:
        emulate_gpu_on_cpu()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    args.out = args.out or out_path("tuning_cost.json")
    rows = []
    for cell in args.cells.split(","):
        shape = cell_shape(cell)
        if args.quick:
            shape = dict(shape, units=32, batch=4, steps=10)  # the layer count kept
        if args.compare:
            rows.append(dict(cell=cell, backend=keras.backend.backend(), **compare(shape, args.compare, arms)))
            first = {m: round(rows[-1]["first_run"][m], 2) for m in ("fit", "predict")}
            print(f"cell {cell} tuning s, medians of {args.compare}: {rows[-1]['medians']}; "
                  f"the process's first run: {first}")
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
            continue
        row = dict(cell=cell, backend=keras.backend.backend(), **measure(shape, args.profile))
        rows.append(row)
        for mode in ("fit", "predict"):
            r = row[mode]
            print(f"cell {cell} {mode}: tuning {r['tuning_s']:.2f} s; "
                  + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in r["phases"].items()))
            for name, c in r["candidates"].items():
                print(f"    {name}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()))
        check = row["gradient_check"]
        if check is not None:
            print(f"cell {cell} gradient check of {check['plan']} alone: {check['seconds']:.2f} s"
                  + (f", {check['compiles']} XLA compiles" if "compiles" in check else ""))
        opt = row["static_optimize"]
        print(f"cell {cell} static optimize: {opt['seconds']:.2f} s"
              + (f", {opt['compiles']} XLA compiles ({opt['compile_s']:.2f} s)" if "compiles" in opt else ""))
        for name, cumulative in opt["top"]:
            print(f"    optimize {cumulative:.3f} s in {name}")
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
