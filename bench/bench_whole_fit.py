"""Whole `fit` calls as a new user's wall clock sees them: each from a fresh
process with an empty plan cache, original against `rnnfuse.optimize`.

For each shape of bench/bench_matrix.py (`--shapes`) and each epoch count
(`--epochs`, default 1 and 10), a pair is two fresh processes, one training
Keras' own model and one its optimized twin (`optimize(model)` with its
defaults: first-batch tuning, the plan cache in a new empty folder,
RNNFUSE_CACHE_DIR); each builds its model, compiles it (Adam, MSE) and
times one whole `fit(epochs=E)` call of `--epoch-steps` batches an epoch.
Pairs are interleaved: pair 1 of every shape and epoch count first, then
pair 2, ..., the order within a pair flipped every time, so a run cut short
by `--budget` still has the first pairs of everything.

A child records `fit_s` (the fit call), `epoch_end_s` (seconds from the
call's start to each epoch's end), `optimize_s` (the `optimize` call),
`tuning_s`, the plans and the final loss, and `original_failed`: Keras'
own error where its model fails in the shape's policy (its LSTM in
mixed_float16 on JAX), the original then timed in float32, as bench_matrix
does, from another fresh process; the parent adds `process_s`
(the child's whole life). rnnfuse's native libraries are built once
first (`rnnfuse build-ops`, its seconds in `meta.prebuild`) and shared by
the children, so no fit pays a compiler (`--child-builds`: each does). The summary gives, per shape and epoch count,
the median `fit_s` of each model and `fit_speedup` = original / optimized
(above 1: the optimized fit was faster), `call_speedup` the same with
`optimize` counted (its user waits for it too), the per-pair ratios, and
`tuning_share`: the median over the optimized fits of first-batch tuning's
seconds (every candidate's first call included: on JAX its step's
compile) over the fit's, which includes them. At 10 epochs this is the
tuning-cost target's figure; `--shares` compares two backends' runs.

Fresh processes: under torch a fork server (multiprocessing's
"forkserver") imports torch, Keras and rnnfuse once, without starting CUDA,
and forks a child per measurement (a child starts CUDA, loads the libraries
and traces everything itself; module imports are not counted in any
reading). The server is a new interpreter, not the caller: a process that
has run torch's OpenMP pool (a test session) cannot fork a child that uses
it (the child hangs). Under TensorFlow and JAX each child is a new
interpreter (`--start exec`).

    KERAS_BACKEND=torch python bench/bench_whole_fit.py --out /tmp/whole_torch.json
    python bench/bench_whole_fit.py --shapes gru3x64,lstm2x40 --pairs 3 --out /tmp/whole_tf.json
    KERAS_BACKEND=torch python bench/bench_whole_fit.py --quick --out /tmp/q.json   # tiny, any machine
    python bench/bench_whole_fit.py --shares /tmp/whole_jax.json /tmp/whole_tf.json  # tuning's shares
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import share_table, tuning_share  # noqa: E402

# The four small float32 shapes and two large ones of bench_matrix.SHAPES.
DEFAULT_SHAPES = "gru3x64,rnn3x256,lstm8x128,lstm2x40,lstm4x512,bilstm4x384"
# Batches an epoch per shape (others: DEFAULT_EPOCH_STEPS): fewer where
# the original step is slow (SimpleRNN under torch runs Keras' Python loop;
# the large shapes), so six shapes' pairs fit in a few minutes. 50 batches
# make fit(epochs=10) long enough for first-batch tuning (the budget's
# floor, docs/guide.md) and fit(epochs=1) too short.
EPOCH_STEPS = {"rnn3x256": 5, "lstm4x512": 5, "bilstm4x384": 5, "lstm3x768": 5,
               "bigru5x512": 5, "plstm4x1024": 5, "masked_lstm2x256": 5}
DEFAULT_EPOCH_STEPS = 50
RESULT = "WHOLE_FIT_RESULT "


def epoch_steps_for(name: str, override: int | None) -> int:
    """`--epoch-steps` where given, else the shape's default.

    >>> epoch_steps_for("gru3x64", None), epoch_steps_for("rnn3x256", None), epoch_steps_for("rnn3x256", 3)
    (50, 5, 3)
    """
    return override or EPOCH_STEPS.get(name, DEFAULT_EPOCH_STEPS)


# -- one measurement (in the child) ---------------------------------------------


def measure(job: dict) -> dict:
    """One whole fit: `job` = {shape_name, model ("original"/"optimized"),
    epochs, epoch_steps, quick, online}."""
    import keras
    import numpy as np

    import bench_matrix
    import rnnfuse
    from rnnfuse.tuning.clock import now

    shape = bench_matrix.SHAPES[job["shape_name"]]
    shape = bench_matrix.quick(shape) if job["quick"] else shape
    shape = dict(shape, dtype=job["dtype"]) if job.get("dtype") else shape
    model = bench_matrix.build_keras(shape)
    optimize_s = 0.0
    if job["model"] == "optimized":
        start = now()
        model = rnnfuse.optimize(model, online=bool(job.get("online")))
        optimize_s = now() - start
    model.compile(optimizer="adam", loss="mse")
    x, y, _ = bench_matrix.data(shape)
    n = job["epoch_steps"]
    xe, ye = np.concatenate([x] * n), np.concatenate([y] * n)
    ends = []

    class EpochEnds(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            ends.append(now())

    def fit(model):
        return model.fit(xe, ye, batch_size=shape["batch"], epochs=job["epochs"], verbose=0,
                         shuffle=False, callbacks=[EpochEnds()])

    start = now()
    try:
        history = fit(model)
    except Exception as err:  # noqa: BLE001 - Keras' own failure in this policy, recorded
        if job["model"] != "original" or job.get("dtype"):
            raise
        # As bench_matrix, the baseline is what its user can run, the model in
        # float32, but from a fresh process (`run_child`): this one has traced.
        return dict(job, original_failed=f"{type(err).__name__}: {err}")
    fit_s = now() - start
    from rnnfuse.backends.cuda import build

    row = dict(job, fit_s=fit_s, epoch_end_s=[e - start for e in ends], optimize_s=optimize_s,
               loss=float(history.history["loss"][-1]), libraries=str(build.cache_dir().resolve()),
               original_failed=None)
    if job["model"] == "optimized":
        from rnnfuse.fused import fused_layers
        from rnnfuse.tuning.first_batch import decisions

        row["tuning_s"] = getattr(getattr(model, "_rnnfuse_autotune", None), "seconds", 0.0)
        row["plans"] = [dict(layers=len(f.fused_layers), plan=f.plan.name, kernel=f.plan.kernel)
                        for f in fused_layers(model)]
        # An online race's record says where its seconds went.
        row["decisions"] = [dict(mode=d.get("mode"), chosen=d.get("chosen"), source=d.get("source"),
                                 **({"race": d["race"]} if "race" in d else {}))
                            for d in decisions(model)]
    return row


def _child_main(job: dict) -> None:
    try:
        row = measure(job)
    except Exception as err:  # noqa: BLE001 - the parent records it
        row = dict(job, error=f"{type(err).__name__}: {err}"[:500])
    print(RESULT + json.dumps(row), flush=True)


# -- the parent ------------------------------------------------------------------


def _can_fork(backend: str) -> bool:
    """Forking from a fork server is safe under torch only (TensorFlow's
    and JAX's runtimes start threads at import)."""
    return backend == "torch" and "forkserver" in multiprocessing.get_all_start_methods()


def _fork_server():
    """multiprocessing's fork server with torch, Keras and rnnfuse imported,
    started now, so that no child's `process_s` includes the imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "keras", "rnnfuse", "bench_matrix", "bench_whole_fit"])
    warm = ctx.Process(target=_nothing)
    warm.start()
    warm.join()
    return ctx


def _nothing() -> None:
    pass


def _stop_fork_server() -> None:
    # The server would otherwise live until the caller exits (a test session).
    stop = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def run_child(job: dict, start: str, timeout_s: float, ops: str | None = None,
              forks=None, run=None) -> dict:
    """`job` in a fresh process with an empty plan cache (forked by `forks`,
    a multiprocessing context, or a new interpreter): its row, with
    `process_s`; an `error` row where it failed or ran past `timeout_s`.
    `ops`: the folder of built native libraries the child uses (none: it
    builds them itself). An original that fails in its policy is timed in
    float32 in another fresh process, its row keeping Keras' error (`run`:
    the one-process runner, `_run_once`).

    >>> fails = lambda job, *a: dict(job, original_failed="E") if "dtype" not in job else dict(job, fit_s=1.0)
    >>> row = run_child(dict(model="original"), "exec", 60.0, run=fails)
    >>> row["dtype"], row["fit_s"], row["original_failed"]
    ('float32', 1.0, 'E')
    """
    run = run or _run_once
    row = run(job, start, timeout_s, ops, forks)
    if row.get("original_failed") and "fit_s" not in row and "error" not in row:
        row = dict(run(dict(job, dtype="float32"), start, timeout_s, ops, forks),
                   original_failed=row["original_failed"])
    return row


def _run_once(job: dict, start: str, timeout_s: float, ops: str | None, forks) -> dict:
    cache = tempfile.mkdtemp(prefix="rnnfuse-whole-fit-")
    if ops is not None:
        os.symlink(ops, os.path.join(cache, "ops"))
    began = time.perf_counter()
    if start == "fork":
        row = _forked(job, cache, timeout_s, forks)
    else:
        env = dict(os.environ, RNNFUSE_CACHE_DIR=cache)
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
                                  env=env, capture_output=True, text=True, timeout=timeout_s)
            lines = [l for l in done.stdout.splitlines() if l.startswith(RESULT)]
            row = (json.loads(lines[-1][len(RESULT):]) if lines else
                   dict(job, error=f"exit {done.returncode}: {done.stderr.strip()[-400:]}"))
        except subprocess.TimeoutExpired:
            row = dict(job, error=f"timed out after {timeout_s:.0f} s")
    row["process_s"] = time.perf_counter() - began
    return row


def _forked(job: dict, cache: str, timeout_s: float, forks) -> dict:
    out = os.path.join(cache, "row.json")
    child = forks.Process(target=_forked_child, args=(job, cache, out))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        return dict(job, error=f"timed out after {timeout_s:.0f} s")
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return dict(job, error=f"the child exited with status {child.exitcode} and no result")


def _forked_child(job: dict, cache: str, out: str) -> None:
    os.environ["RNNFUSE_CACHE_DIR"] = cache
    try:
        row = measure(job)
    except Exception as err:  # noqa: BLE001 - the parent records it
        row = dict(job, error=f"{type(err).__name__}: {err}"[:500])
    with open(out, "w") as f:
        json.dump(row, f)


MODELS = ("original", "optimized")


def prebuild() -> tuple[str, dict]:
    """Builds rnnfuse's native libraries once (`rnnfuse build-ops`, in a
    process of its own: the parent starts no CUDA), so that no child's fit
    pays a compiler; returns their folder and what the build took."""
    from rnnfuse.backends.cuda import build

    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rnnfuse", "build-ops"], capture_output=True,
                          text=True)
    ops = build.cache_dir()
    ops.mkdir(parents=True, exist_ok=True)
    return str(ops), dict(seconds=round(time.perf_counter() - began, 2), rc=done.returncode,
                          note=(done.stderr.strip() or done.stdout.strip())[-300:])


def jobs(shapes: list[str], epochs: list[int], pairs: int, epoch_steps: int | None,
         quick: bool, online: bool, models: tuple = MODELS) -> list[dict]:
    """Every measurement, pair-major: pair 1 of every shape and epoch count,
    then pair 2, ...; within a pair the model order flips every time.
    `models=("optimized",)` leaves the originals out (tuning shares only).

    >>> js = jobs(["a", "b"], [1], 2, 5, True, False)
    >>> [(j["pair"], j["shape_name"], j["model"]) for j in js][:4]
    [(0, 'a', 'original'), (0, 'a', 'optimized'), (0, 'b', 'optimized'), (0, 'b', 'original')]
    >>> len(js), len(jobs(["a", "b"], [1], 2, 5, True, False, ("optimized",)))
    (8, 4)
    """
    out, flip = [], 0
    for pair in range(pairs):
        for name in shapes:
            for e in epochs:
                order = ("original", "optimized") if flip % 2 == 0 else ("optimized", "original")
                flip += 1
                for model in (m for m in order if m in models):
                    out.append(dict(pair=pair, shape_name=name, model=model, epochs=e,
                                    epoch_steps=epoch_steps_for(name, epoch_steps), quick=quick,
                                    online=online))
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per (shape, epochs): each model's median fit_s, `fit_speedup` =
    original / optimized medians, `call_speedup` the same with each
    process's `optimize_s` added (the user's whole call), the ratio of each
    complete pair, and the optimized fits' median tuning seconds and
    `tuning_share` (median of each fit's tuning_s / fit_s).

    >>> rows = [dict(shape_name="a", epochs=1, pair=p, model=m, fit_s=s)
    ...         for p, (o, f) in enumerate([(2.0, 1.0), (3.0, 2.0)])
    ...         for m, s in (("original", o), ("optimized", f))]
    >>> for r, t in zip(rows[1::2], (0.1, 0.4)):
    ...     r["tuning_s"] = t
    >>> s = summarize(rows)[0]
    >>> s["fit_s"], s["fit_speedup"], s["pair_ratios"]
    ({'original': 2.5, 'optimized': 1.5}, 1.667, [2.0, 1.5])
    >>> s["tuning_s"], s["tuning_share"]
    (0.25, 0.15)
    >>> rows[1]["optimize_s"] = rows[3]["optimize_s"] = 1.0
    >>> summarize(rows)[0]["call_speedup"]
    1.0
    """
    groups: dict = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["shape_name"], r["epochs"]), []).append(r)
    out = []
    for (name, e), rs in groups.items():
        fit = {m: [r["fit_s"] for r in rs if r["model"] == m] for m in ("original", "optimized")}
        med = {m: statistics.median(v) for m, v in fit.items() if v}
        by_pair = {(r["pair"], r["model"]): r["fit_s"] for r in rs}
        pairs = sorted({r["pair"] for r in rs})
        ratios = [round(by_pair[p, "original"] / by_pair[p, "optimized"], 3) for p in pairs
                  if (p, "original") in by_pair and (p, "optimized") in by_pair]
        row = dict(shape_name=name, epochs=e, fit_s=med, pair_ratios=ratios, pairs=len(ratios))
        if len(med) == 2:
            row["fit_speedup"] = round(med["original"] / med["optimized"], 3)
            call = {m: statistics.median(r["fit_s"] + r.get("optimize_s", 0.0) for r in rs
                                         if r["model"] == m) for m in med}
            row["call_speedup"] = round(call["original"] / call["optimized"], 3)
        tuned = [r for r in rs if r["model"] == "optimized" and "tuning_s" in r and r["fit_s"] > 0]
        if tuned:
            row["tuning_s"] = round(statistics.median(r["tuning_s"] for r in tuned), 4)
            row["tuning_share"] = round(statistics.median(
                tuning_share(r["tuning_s"], r["fit_s"])["share"] for r in tuned), 4)
        out.append(row)
    return out


def shares_of(files: list[str], epochs: int = 10) -> list[tuple[str, dict]]:
    """[(backend, {shape: tuning share at `epochs`})] of result files, for
    `share_table`."""
    runs = []
    for path in files:
        with open(path) as f:
            run = json.load(f)
        shares = {s["shape_name"]: s["tuning_share"] for s in run["summary"]
                  if s["epochs"] == epochs and "tuning_share" in s}
        runs.append((run["meta"]["backend"], shares))
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file, rewritten after each child")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated names of bench_matrix.SHAPES")
    parser.add_argument("--epochs", default="1,10", help="comma-separated epoch counts")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of fresh processes per shape and epoch count")
    parser.add_argument("--epoch-steps", type=int, default=None,
                        help=f"batches an epoch (default: {DEFAULT_EPOCH_STEPS}, fewer for slow shapes)")
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds; no child starts after this (the first pairs go first)")
    parser.add_argument("--child-timeout", type=float, default=120.0, help="seconds a child may run")
    parser.add_argument("--start", choices=("auto", "fork", "exec"), default="auto",
                        help="how a fresh process starts (auto: forked by a fork server under torch, else exec)")
    parser.add_argument("--online", action="store_true", help="turn online tuning on in the optimized fit")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated models to run (optimized alone: tuning shares only)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--child-builds", action="store_true",
                        help="each child builds rnnfuse's native libraries itself (a first install); "
                             "by default they are built once first and shared")
    parser.add_argument("--shares", nargs="+", metavar="JSON",
                        help="print the tuning shares of 10-epoch fits in these results "
                             "(two: the first over the second)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.shares:
        print(share_table(shares_of(args.shares)))
        return 0
    if args.child:
        _child_main(json.loads(args.child))
        return 0

    if args.start != "exec":
        # Keras' torch backend asks torch.cuda.is_available() at import;
        # asked through NVML it starts no CUDA driver in the parent.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import keras

    import bench_matrix
    import rnnfuse
    from common import out_path

    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in bench_matrix.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(bench_matrix.SHAPES)}")
    epochs = [int(e) for e in args.epochs.split(",") if e]
    models = tuple(m for m in args.models.split(",") if m)
    if not models or set(models) - set(MODELS):
        parser.error(f"--models: {args.models!r}; choose from {', '.join(MODELS)}")
    backend = keras.backend.backend()
    start_mode = args.start
    if start_mode == "auto":
        start_mode = "fork" if _can_fork(backend) else "exec"
    out = args.out or out_path(f"whole_fit_{backend}.json")
    meta = dict(backend=backend, keras=keras.__version__, rnnfuse=rnnfuse.__version__,
                python=platform.python_version(), start=start_mode, pairs=args.pairs,
                epochs=epochs, budget_s=args.budget, quick=args.quick, online=args.online,
                models=list(models))
    began = time.perf_counter()  # the budget counts the build too
    ops = None
    if not args.child_builds:
        if args.quick:  # tiny shapes on any machine: nothing to build first
            from rnnfuse.backends.cuda import build

            ops = str(build.cache_dir())
            os.makedirs(ops, exist_ok=True)
        else:
            ops, meta["prebuild"] = prebuild()
            print(f"native libraries built once in {meta['prebuild']['seconds']} s "
                  f"(rc {meta['prebuild']['rc']}): {ops}", flush=True)
    rows, skipped = [], []
    forks = None  # the fork server, started for the first forked child
    try:
        for job in jobs(names, epochs, args.pairs, args.epoch_steps, args.quick, args.online, models):
            left = args.budget - (time.perf_counter() - began)
            if left <= 0:
                skipped.append(job)
                continue
            if start_mode == "fork" and forks is None:
                forks = _fork_server()
            row = run_child(job, start_mode, min(args.child_timeout, left + 30), ops, forks)
            if start_mode == "fork" and "error" in row and not any("error" not in r for r in rows):
                # No forked child has worked yet (a CUDA runtime that refuses a
                # forked process): new interpreters from here on.
                print("a forked child failed; each child is a new interpreter from now:",
                      row["error"], flush=True)
                start_mode = meta["start"] = "exec"
                row = run_child(job, start_mode, min(args.child_timeout, left + 30), ops)
            rows.append(row)
            if "error" in row:
                print("ERROR", row["shape_name"], row["model"], row["epochs"], row["error"], flush=True)
            else:
                print(f"pair {row['pair']} {row['shape_name']} epochs {row['epochs']} {row['model']}: "
                      f"fit {row['fit_s']:.2f} s (process {row['process_s']:.1f} s)"
                      f"{' tuning %.2f s' % row['tuning_s'] if 'tuning_s' in row else ''}", flush=True)
            with open(out, "w") as f:
                json.dump(dict(meta=meta, summary=summarize(rows), results=rows,
                               skipped=len(skipped)), f, indent=1)
    finally:
        if forks is not None:
            _stop_fork_server()
    summary = summarize(rows)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, summary=summary, results=rows, skipped=len(skipped)), f, indent=1)
    for s in summary:
        share = ("" if "tuning_share" not in s else
                 f" tuning {s['tuning_s']:.2f} s = {100 * s['tuning_share']:.1f}% of the fit")
        print(f"whole {s['shape_name']} epochs={s['epochs']}: fit_s {s['fit_s']} "
              f"speedup {s.get('fit_speedup')} (with optimize {s.get('call_speedup')}) "
              f"pairs {s['pair_ratios']}{share}", flush=True)
    if skipped:
        print(f"budget reached: {len(skipped)} children not run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
