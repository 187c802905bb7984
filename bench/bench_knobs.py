"""Keras' own knobs on the small shapes, on the process's backend.

For each shape of bench/bench_matrix.py (`--shapes`, the small float32
ones by default) and each (`steps_per_execution`, `jit_compile`) setting,
Keras' model ("original") and `rnnfuse.optimize(model)` ("optimized") are
compiled with it (Adam, MSE), fitted once untimed (traces, tuning), then
timed over one warm whole `fit` of `--steps` batches: ms a step. A
setting refused before any step (by `compile()` or the making of the train
step: Keras' torch trainer takes one step an execution; rnnfuse refuses
`jit_compile=True` where a cuDNN kernel runs) is recorded as not available,
with the reason; Keras' model refusing it skips the optimized one. One
backend a process; `--table` sets the optimized model's best setting on
each backend (and Keras' model's best) beside the plain PyTorch loop
(bench_matrix.py `--backend pytorch`), with the ratio to it, and lists
what was not available or failed below it.

    KERAS_BACKEND=jax python bench/bench_knobs.py --out /tmp/knobs_jax.json
    KERAS_BACKEND=torch python bench/bench_knobs.py --jit auto --out /tmp/knobs_torch.json
    python bench/bench_matrix.py --backend pytorch --shapes gru3x64,rnn3x256,lstm8x128,lstm2x40 --out /tmp/pt.json
    python bench/bench_knobs.py --table /tmp/knobs_jax.json /tmp/knobs_torch.json --peer /tmp/pt.json
    python bench/bench_knobs.py --quick --spe 1,2 --out /tmp/q.json   # tiny, any machine
    KERAS_BACKEND=jax python bench/bench_knobs.py --tuned --spe 1 --jit auto --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SMALL = "gru3x64,rnn3x256,lstm8x128,lstm2x40"
JIT = {"auto": "auto", "true": True, "false": False}
# The clock of the timed fits (tests replace it with a fake one).
clock = time.perf_counter
XLA_REFUSAL = "not available (cuDNN ops do not compile under XLA)"
# Refusals recorded as error text by earlier runs of this bench.
_REFUSALS_AS_ERRORS = {"must be 1 with the PyTorch backend": None,
                       "XLA cannot compile cuDNN ops": XLA_REFUSAL}


def settings(spe: str, jit: str) -> list[tuple[int, object]]:
    """(steps_per_execution, jit_compile) pairs: every --spe value with each
    --jit value.

    >>> settings("1,8", "auto,true")
    [(1, 'auto'), (8, 'auto'), (1, True), (8, True)]
    """
    try:
        values = [JIT[j.strip().lower()] for j in jit.split(",") if j.strip()]
        return [(int(k), j) for j in values for k in spe.split(",") if k.strip()]
    except (KeyError, ValueError) as err:
        raise ValueError(f"--spe takes integers and --jit auto, true or false, comma-separated; "
                         f"received --spe {spe!r} --jit {jit!r}") from err


def refusal(model, setting: tuple) -> dict | None:
    """{"not_available": why} where `model` refuses `setting` before any step
    runs (`compile()` or Keras making the train step raises ValueError), or None."""
    import keras

    from rnnfuse.fused import fused_layers

    spe, jit = setting
    try:
        model.compile(optimizer="adam", loss="mse", steps_per_execution=spe, jit_compile=jit)
        model.make_train_function()
    except ValueError as err:
        if jit is True and any(f.fused_call_blocks_xla for f in fused_layers(model)):
            return {"not_available": XLA_REFUSAL}
        return {"not_available": f"not available on {keras.backend.backend()}: {err}"}
    return None


def measure(shape: dict, setting: tuple, steps: int, tuned: bool = False) -> dict:
    """{model: ms a step} of one warm whole fit per model under `setting`
    (`tuned`: the optimized model times every candidate on a batch first,
    the plan a long fit commits to; "plans" then names what it runs);
    `refusal`'s record where a model refuses the setting (Keras' model
    refusing it: both, the optimized model not built), "Error: ..." text
    where a fit fails; "plans": the optimized model's plan names."""
    import keras
    import numpy as np

    import bench_matrix
    import rnnfuse
    from rnnfuse.fused import fused_layers

    x, y, _ = bench_matrix.data(shape)
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    out = {}
    # Each built apart: a fit that fails leaves its model's variables unusable.
    for name in ("original", "optimized"):
        model = bench_matrix.build_keras(shape)
        if name == "optimized":
            model = rnnfuse.optimize(model, cache=False, tune=x if tuned else "auto")
        refused = refusal(model, setting)
        if refused is not None:
            out[name] = refused
            if name == "original":
                out["optimized"] = refused
                break
            continue
        try:
            model.fit(xs, ys, batch_size=shape["batch"], epochs=1, verbose=0)  # traces, tuning
            start = clock()
            model.fit(xs, ys, batch_size=shape["batch"], epochs=1, verbose=0)
            out[name] = 1e3 * (clock() - start) / steps
            if name == "optimized":
                out["plans"] = [f.plan.name for f in fused_layers(model)]
        except Exception as err:  # noqa: BLE001 - a failing fit is a result
            out[name] = f"{type(err).__name__}: {err}"[:300]
    keras.backend.clear_session()
    return out


def not_available(value, backend: str) -> str | None:
    """The reason a recorded value says the setting was not available, or
    None (a time or a failure); reads earlier runs' error text too.

    >>> not_available({"not_available": "not available on torch: no"}, "torch")
    'not available on torch: no'
    >>> not_available("ValueError: `steps_per_execution` must be 1 with the PyTorch backend.", "torch")
    'not available on torch: `steps_per_execution` must be 1 with the PyTorch backend.'
    >>> not_available(4.0, "jax") is None
    True
    """
    if isinstance(value, dict):
        return value.get("not_available")
    if not isinstance(value, str):
        return None
    for text, note in _REFUSALS_AS_ERRORS.items():
        if text in value:
            return note or f"not available on {backend}: {value.partition(': ')[2]}"
    return None


def best(row: dict, model: str) -> tuple[str, float] | None:
    """(the setting, its ms a step) where `model` ran fastest in `row`.

    >>> row = {"settings": [{"spe": 1, "jit": "auto", "ms": {"original": 4.0, "optimized": 3.0}},
    ...                     {"spe": 8, "jit": "auto", "ms": {"original": 2.0, "optimized": "E"}}]}
    >>> best(row, "optimized"), best(row, "original")
    (('steps_per_execution=1, jit_compile=auto', 3.0), ('steps_per_execution=8, jit_compile=auto', 2.0))
    """
    found = [(s["ms"][model], f"steps_per_execution={s['spe']}, jit_compile={s['jit']}")
             for s in row.get("settings", []) if isinstance(s["ms"].get(model), float)]
    if not found:
        return None
    ms, where = min(found)
    return where, ms


def table(files: list[str], peer: str | None) -> str:
    """A markdown table: per shape, the optimized model's best setting and
    ms on each backend, its ratio to the PyTorch loop's `fit` step, and
    Keras' model's best ms."""
    runs = []
    for path in files:
        with open(path) as f:
            run = json.load(f)
        runs.append((run["meta"]["backend"], {r["shape_name"]: r for r in run["results"]}))
    loop = {}
    if peer:
        with open(peer) as f:
            loop = {r["shape_name"]: r["fit_ms"]["pytorch"] for r in json.load(f)["results"]
                    if "fit_ms" in r}
    names = list(dict.fromkeys(n for _, rows in runs for n in rows))
    lines = ["| shape | " + " | ".join(b for b, _ in runs) + " | PyTorch loop |",
             "|---|" + "---|" * len(runs) + "---:|"]
    for name in names:
        cells = []
        for _, rows in runs:
            found, keras_best = (best(rows.get(name, {}), m) for m in ("optimized", "original"))
            if found is None:
                cells.append("-")
                continue
            where, ms = found
            ratio = f", {ms / loop[name]:.2f}x the loop" if name in loop else ""
            keras_ms = f"; Keras' model at best {keras_best[1]:.2f}" if keras_best else ""
            cells.append(f"{ms:.2f} ms ({where}{ratio}{keras_ms})")
        ref = f"{loop[name]:.2f} ms" if name in loop else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ref} |")
    return "\n".join(lines + notes(runs))


def notes(runs: list) -> list[str]:
    """Lines below the table: per backend, the settings not available (with
    the reason) and the fits that failed, grouped by reason."""
    grouped: dict = {}
    for backend, rows in runs:
        for name, row in rows.items():
            for s in row.get("settings", []):
                ms = s["ms"]
                found = {m: not_available(ms.get(m), backend) for m in ("original", "optimized")}
                for m, value in ms.items():
                    why = found.get(m)
                    if why is None and isinstance(value, float):
                        continue
                    who = ("both models" if why is not None and len(set(found.values())) == 1
                           else "Keras' model" if m == "original" else "the optimized model")
                    why = why or f"failed: {value}"
                    where = f"steps_per_execution={s['spe']}, jit_compile={s['jit']}"
                    grouped.setdefault((backend, who, why.split(" Received:")[0]), {}).setdefault(
                        where, set()).add(name)
    every = {n for _, rows in runs for n in rows}
    lines = []
    for (backend, who, why), settings in grouped.items():
        by_shapes: dict = {}
        for where, shapes in settings.items():
            by_shapes.setdefault(frozenset(shapes), []).append(where)
        for shapes, wheres in by_shapes.items():
            on = "every shape" if shapes == every else ", ".join(sorted(shapes))
            lines.append(f"- {backend}, {who}, on {on}: {'; '.join(wheres)}: {why}")
    return [""] + lines if lines else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file, rewritten after each setting")
    parser.add_argument("--shapes", default=SMALL, help="comma-separated names of bench_matrix.SHAPES")
    parser.add_argument("--spe", default="1,8,32", help="steps_per_execution values")
    parser.add_argument("--jit", default="auto,true", help="jit_compile values: auto, true, false")
    parser.add_argument("--steps", type=int, default=64, help="batches of a timed fit")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--tuned", action="store_true",
                        help="optimize(model, tune=batch): a long fit's plan, not a short one's")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these runs")
    parser.add_argument("--peer", default=None, help="with --table: bench_matrix's PyTorch loop JSON")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table, args.peer))
        return 0
    try:
        chosen = settings(args.spe, args.jit)
    except ValueError as err:
        parser.error(str(err))
    import keras

    import bench_matrix
    import rnnfuse
    from common import out_path

    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in bench_matrix.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(bench_matrix.SHAPES)}")
    backend = keras.backend.backend()
    out = args.out or out_path(f"knobs_{backend}.json")
    meta = dict(backend=backend, keras=keras.__version__, rnnfuse=rnnfuse.__version__,
                python=platform.python_version(), steps=args.steps, quick=args.quick,
                tuned=args.tuned)
    results = []
    for name in names:
        shape = bench_matrix.SHAPES[name]
        shape = bench_matrix.quick(shape) if args.quick else shape
        row = dict(shape_name=name, shape=shape, settings=[])
        results.append(row)
        for spe, jit in chosen:
            ms = measure(shape, (spe, jit), args.steps, args.tuned)
            row["settings"].append(dict(spe=spe, jit=jit, plans=ms.pop("plans", None), ms=ms))
            print(f"knob {backend} {name} steps_per_execution={spe} jit_compile={jit}: {ms}",
                  flush=True)
            with open(out, "w") as f:
                json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
