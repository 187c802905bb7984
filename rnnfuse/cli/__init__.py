"""The `rnnfuse` command line: what fuses in a model, how fast, how exact.

Commands (MODEL is a `.keras` file, or `module:function` / `path/to/file.py:fn`
naming a function that takes no arguments and returns a built keras.Model):

    rnnfuse inspect MODEL [--json] [--plot FILE.png]
    rnnfuse bench   MODEL [--batch N] [--steps T] [--train] [--mixed-precision]
                          [--repeats K] [--warmup W] [--plan P] [--tune] [--json]
    rnnfuse check   MODEL [--tolerance X] [--batch N] [--steps T] [--seed S]
                          [--mixed-precision] [--plan P] [--json]

Options every command takes: `--min-layers N`, `--import MODULE` (import a
module first, for example the one that registers a model's custom layers;
repeatable), `--unsafe` (load a `.keras` file with `safe_mode=False`, for
Lambda layers you trust) and `--debug` (warnings, and the traceback of an
error). `--plan auto|fused|per-layer` picks how each group runs: auto is
`rnnfuse.optimize`'s own choice.

Exit codes: 0 success; 1 `check` found a difference above the tolerance;
2 a problem with the input (a missing or unreadable file, a file that is not
a Keras model, custom objects that cannot be found, a bad option, a function
that does not return a model): one line on stderr saying what and how to fix
it; 3 an unexpected internal error (also one line; `--debug` shows the
traceback). TensorFlow may print its own start-up lines on stderr first.

Random inputs (`bench`, `check`) follow each model input's shape and dtype:
the batch size from `--batch`; the time axis (axis 1) from the input's shape,
or from `--steps` where the shape leaves it open; floats are standard
normal; integer inputs that feed an `Embedding` get token ids below its
`input_dim` (from 1 when `mask_zero=True`, and then right-padded with 0 to
random lengths, so masks take the sequence-length path).

`bench` and `check` run on the TensorFlow and torch Keras backends.

Example:

    >>> from rnnfuse.cli import main
    >>> main(["inspect", "examples/text_classifier.py:build_model", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import traceback
import warnings
from typing import Sequence

from rnnfuse.cli.inputs import (
    _backend,
    _caveat,
    _run_model,
    random_inputs,
)
from rnnfuse.cli.errors import CliError, _first_line, _one_line
from rnnfuse.cli.loading import load_model

__all__ = ["CliError", "load_model", "main", "random_inputs"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

# Default `check` tolerances (max abs difference), by compute dtype.
DEFAULT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


# -- entry point ---------------------------------------------------------------


def _cmd_build_ops(args) -> int:
    """`rnnfuse build-ops`: compile the TensorFlow op, print its path."""
    from rnnfuse.backends.tensorflow import op_build

    try:
        path = op_build.build_op(force=args.force)
    except op_build.BuildError as err:
        raise CliError(f"building the op failed: {err}") from err
    print(path)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code.

    Args:
        argv: the arguments after the program name (default: sys.argv[1:]).

    Returns:
        0 on success, 1 when `check` finds a difference above the tolerance,
        2 for a problem with the input, 3 for an unexpected error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help, --version
        return int(done.code or 0)
    except CliError as err:
        return _fail(err, debug, EXIT_USAGE)
    try:
        with _quiet(debug):
            return args.run(args)
    except CliError as err:
        return _fail(err, debug, EXIT_USAGE)
    except KeyboardInterrupt:
        print("rnnfuse: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the last resort: one line, no traceback
        wrapped = CliError(
            f"unexpected {type(err).__name__}: {_first_line(err)}. This may be "
            "a bug in rnnfuse: run again with --debug and report the traceback"
        )
        wrapped.__cause__ = err
        return _fail(wrapped, debug, EXIT_INTERNAL)


def _fail(err: CliError, debug: bool, code: int) -> int:
    if debug:
        traceback.print_exception(err.__cause__ or err)
    print(f"rnnfuse: error: {_one_line(str(err))}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _quiet(debug: bool):
    """Hides Python warnings from Keras/TF (shown with --debug)."""
    with warnings.catch_warnings():
        if not debug:
            warnings.simplefilter("ignore")
        yield


# -- arguments -----------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option as a one-line CliError."""

    def error(self, message):
        raise CliError(f"{message}. Run '{self.prog} --help' for the options")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, received {text!r}"
        )
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected a non-negative number such as 1e-4, received {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    from rnnfuse import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or module:function (or path/to/file.py:function) "
        "returning a built keras.Model",
    )
    common.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a name or path/to/file.py) first, e.g. the one "
        "that registers the model's custom layers; repeatable",
    )
    common.add_argument(
        "--unsafe",
        action="store_true",
        help="load the .keras file with safe_mode=False (Lambda layers); only "
        "for files you trust",
    )
    common.add_argument(
        "--min-layers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the least number of recurrent levels worth fusing (default: 1 "
        "for SimpleRNN/RNN(cell) layers, 2 for LSTM/GRU)",
    )
    plan = argparse.ArgumentParser(add_help=False)
    plan.add_argument(
        "--plan",
        choices=("auto", "fused", "per-layer"),
        default="auto",
        help="how each group runs: optimize()'s choice (auto, the default), "
        "every group fused whole (fused), or its original layers (per-layer)",
    )
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show Python warnings, and the traceback of an error",
    )

    parser = _Parser(
        prog="rnnfuse",
        description="See which stacked recurrent layers of a Keras 3 model "
        "fuse into one cuDNN call, how much faster that is here, and that "
        "it computes the same thing.",
        epilog="examples:\n"
        "  rnnfuse inspect model.keras --plot graph.png\n"
        "  rnnfuse check model.keras\n"
        "  rnnfuse bench model.keras --batch 32 --steps 200 --train\n"
        "  rnnfuse inspect examples/speech_encoder.py:build_model\n\n"
        "exit codes: 0 ok, 1 check above tolerance, 2 bad input (one line on "
        "stderr),\n3 internal error. Run 'rnnfuse COMMAND --help' for a "
        "command's options.\nDocs: docs/guide.md (the fusion rules), "
        "docs/api.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rnnfuse {__version__}")
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="list the fused groups and why each other recurrent layer is not fused",
    )
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--plot", metavar="FILE.png", help="draw the layer graph, fused groups highlighted"
    )
    inspect.set_defaults(run=_cmd_inspect)

    bench = commands.add_parser(
        "bench",
        parents=[common, plan],
        help="time the original and the optimized model on this machine",
    )
    bench.add_argument("--batch", type=_positive_int, default=32, metavar="N", help="batch size (default 32)")
    bench.add_argument(
        "--steps",
        type=_positive_int,
        metavar="T",
        help="time steps, for inputs whose time dimension is None",
    )
    bench.add_argument(
        "--train",
        action="store_true",
        help="time a training step (forward and gradients) instead of inference",
    )
    bench.add_argument(
        "--mixed-precision",
        action="store_true",
        help="run both models under the mixed_float16 dtype policy",
    )
    bench.add_argument("--repeats", type=_positive_int, default=10, metavar="K", help="timed runs of each model (default 10)")
    bench.add_argument("--warmup", type=_positive_int, default=2, metavar="W", help="untimed runs first (default 2)")
    bench.add_argument(
        "--tune",
        action="store_true",
        help="let optimize() time each group's candidate plans on this device "
        "for this batch and length (cached on disk) instead of its rule table",
    )
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.set_defaults(run=_cmd_bench)

    check = commands.add_parser(
        "check",
        parents=[common, plan],
        help="compare outputs and gradients of the original and optimized model",
    )
    check.add_argument(
        "--tolerance",
        type=_tolerance,
        metavar="X",
        help="largest allowed max abs difference (default 1e-4; 2e-2 for float16)",
    )
    check.add_argument("--batch", type=_positive_int, default=4, metavar="N", help="batch size (default 4)")
    check.add_argument(
        "--steps",
        type=_positive_int,
        default=16,
        metavar="T",
        help="time steps, for inputs whose time dimension is None (default 16)",
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    check.add_argument(
        "--mixed-precision",
        action="store_true",
        help="run both models under the mixed_float16 dtype policy",
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    check.set_defaults(run=_cmd_check)

    build_ops = commands.add_parser(
        "build-ops",
        help="compile rnnfuse's cuDNN RNN op for TensorFlow now (no GPU needed) "
        "and print where the library went",
    )
    build_ops.add_argument("--force", action="store_true", help="rebuild even if cached")
    build_ops.set_defaults(run=_cmd_build_ops)

    parser.set_defaults(run=_no_command)
    return parser


def _no_command(args) -> int:
    raise CliError(
        "choose a command: inspect, bench or check (for example "
        "'rnnfuse inspect model.keras'). Run 'rnnfuse --help' for more"
    )


# -- analysis helpers ----------------------------------------------------------


def _analyze(model, min_layers: int):
    import rnnfuse

    try:
        return rnnfuse.analyze(model, min_layers=min_layers)
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def _optimize(model, args, *, tune=None, training=True):
    """The `rnnfuse.OptimizeResult` of one `optimize` call, and the summary
    [(group, plan name, how it was chosen)].

    The plan of each group (fused whole, split, per layer) comes from
    `--plan`: "auto" is `optimize`'s own choice (the static rule table, or
    timing on this device with `tune`), "fused" forces every group fused.
    """
    import rnnfuse

    forced = {"auto": None, "fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER}[args.plan]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rnnfuse.FusionWarning)
        try:
            result = rnnfuse.optimize(
                model,
                min_layers=args.min_layers,
                tune=tune,
                training=training,
                plan=forced,
                return_result=True,
            )
        except (TypeError, ValueError) as err:
            raise CliError(_first_line(err, limit=600)) from err
    for w in caught:
        if issubclass(w.category, rnnfuse.FusionWarning):
            print(f"rnnfuse: warning: {_one_line(str(w.message))}", file=sys.stderr)
    summary = [(" -> ".join(r.group.layers), r.plan.name, r.source) for r in result.plans]
    return result, summary


def _fused_layers(model) -> list:
    from rnnfuse import FusedRNN

    return [l for l in model._flatten_layers(include_self=False) if isinstance(l, FusedRNN)]


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120
    return Console(file=stream, width=width, highlight=False)


# -- inspect -------------------------------------------------------------------


def _cmd_inspect(args) -> int:
    model = load_model(args.model, imports=args.imports, safe_mode=not args.unsafe)
    report = _analyze(model, args.min_layers)
    if args.plot:
        _plot(model, report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_OK
    from rnnfuse.passes.graph import is_graph_model

    console = _console()
    fused, alone = report.tables()
    already = _fused_layers(model)
    if report.groups:
        console.print(fused)
    elif not is_graph_model(model):
        console.print(
            f"rnnfuse: cannot look inside '{report.model_name}': it is a subclassed "
            f"model ({type(model).__name__}), whose call() rnnfuse cannot read."
        )
    elif already:
        console.print(f"rnnfuse: '{report.model_name}' is already optimized; no further fusable runs.")
    else:
        console.print(f"rnnfuse: no fusable runs in '{report.model_name}'.")
    if report.skipped:
        console.print(alone)
    for note in report.notes:
        console.print(f"note: {note}")
    fused_count = sum(len(g.layers) for g in report.groups)
    summary = (
        f"{len(report.groups)} group(s) fuse {fused_count} layer(s); "
        f"{len(report.skipped)} recurrent layer(s) stay as they are"
    )
    if already:
        inside = sum(len(l.fused_layers) for l in already)
        summary += f"; {len(already)} FusedRNN layer(s) already run {inside} recurrent layer(s)"
    console.print(summary + ".")
    if args.plot:
        console.print(f"layer graph drawn to {args.plot}")
    return EXIT_OK


def _plot(model, report, path: str) -> None:
    try:
        from rnnfuse.plotting import plot_layer_graph
    except ImportError as err:
        raise CliError(
            f"--plot needs matplotlib ({_first_line(err)}). Fix: pip install matplotlib"
        ) from err
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in formats:
        raise CliError(
            f"--plot: cannot draw to '{path}': "
            + (f"'.{extension}' is not an image format" if extension else "no file extension")
            + f". Fix: end the name in one of {', '.join('.' + f for f in formats)} "
            "(e.g. graph.png)"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--plot: no such folder: '{folder}'. Fix: create it first")
    try:
        plot_layer_graph(model, path, report=report)
    except ValueError as err:
        raise CliError(f"--plot: {_first_line(err)}") from err
    except OSError as err:
        raise CliError(
            f"--plot: cannot write '{path}': {err.strerror or err}. Fix: pick a "
            "writable path ending in .png, .svg or .pdf"
        ) from err


# -- bench ---------------------------------------------------------------------


def _cmd_bench(args) -> int:
    import numpy as np

    import rnnfuse

    from rnnfuse.tuning.timing import interleaved_medians

    backend = _backend("bench")
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    _analyze(model, args.min_layers)  # argument errors first, before inputs
    notes: list[str] = []
    inputs, described = random_inputs(
        model, batch=args.batch, steps=args.steps, rng=np.random.default_rng(0), notes=notes
    )
    tune = None
    if args.tune:
        steps = next((np.shape(x)[1] for x in _flatten(inputs) if np.ndim(x) >= 2), 1)
        tune = rnnfuse.TuneShape(args.batch, int(steps))
    optimized, summary = _optimize(model, args, tune=tune, training=args.train)
    report, fast = optimized.report, optimized.model
    device, on_gpu = backend.describe_device()
    notes += backend.timing_notes(on_gpu)
    models = {"original": model, "optimized": fast}
    steps = {}
    for which, m in models.items():
        fn = backend.model_step(m, args.train)
        steps[which] = lambda fn=fn: _run_model(fn, inputs, command="bench")
    with _progress(disable=args.json) as progress:
        task = progress.add_task("timing", total=2 * args.repeats)
        # The tuner's timing loop: warm-up, then interleaved rounds whose
        # order rotates, so drift does not favour either model.
        stats = interleaved_medians(
            steps,
            warmup=args.warmup,
            repeats=args.repeats,
            on_step=lambda _name: progress.advance(task),
        )
    times = {which: [1000 * t for t in stats[which]["times"]] for which in steps}
    paths = {l.name: l.last_path for l in _fused_layers(fast)}
    orig_ms, fast_ms = statistics.median(times["original"]), statistics.median(times["optimized"])
    result = {
        "model": model.name,
        "device": device,
        "gpu": on_gpu,
        "mode": "train" if args.train else "inference",
        "compute_dtype": _compute_dtype(model),
        "batch": args.batch,
        "inputs": described,
        "repeats": args.repeats,
        "groups": len(report.groups),
        "plans": {layers: f"{plan} ({source})" for layers, plan, source in summary},
        "fused_paths": paths,
        "original_ms": times["original"],
        "optimized_ms": times["optimized"],
        "original_median_ms": orig_ms,
        "optimized_median_ms": fast_ms,
        "speedup": orig_ms / fast_ms if fast_ms > 0 else float("nan"),
        "caveat": _caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_bench(result)
    return EXIT_OK


@contextlib.contextmanager
def _progress(disable: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console(stderr=True),
        disable=disable,
        transient=True,
    )
    with progress:
        yield progress


def _flatten(x):
    import keras

    return keras.tree.flatten(x)


def _print_header(console, result: dict) -> None:
    console.print(f"device: {result['device']}")
    for line in result["inputs"]:
        console.print(f"  input {line}")
    for layers, plan in result["plans"].items():
        console.print(f"  group {layers}: plan {plan}")
    for name, path in result["fused_paths"].items():
        console.print(f"  {name} ran: {path}")
    for note in result["notes"]:
        console.print(f"note: {note}")


def _print_bench(result: dict) -> None:
    from rich.table import Table

    console = _console()
    console.print(
        f"rnnfuse bench '{result['model']}': {result['groups']} fused group(s); "
        f"{result['mode']}, batch {result['batch']}, {result['compute_dtype']}, "
        f"{result['repeats']} timed runs each"
    )
    _print_header(console, result)
    table = Table(title="milliseconds per step")
    for col in ("model", "median", "min", "max"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for which in ("original", "optimized"):
        t = result[f"{which}_ms"]
        table.add_row(which, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}")
    console.print(table)
    console.print(f"speedup (original / optimized, medians): {result['speedup']:.2f}x")
    if not result["gpu"]:
        console.print("no GPU visible: these are CPU timings.")
    if result["caveat"]:
        console.print(result["caveat"])


# -- check ---------------------------------------------------------------------


def _cmd_check(args) -> int:
    import numpy as np

    backend = _backend("check")
    # Keep float32 matmuls exact on GPUs, so the comparison shows rnnfuse's
    # differences rather than TF32 rounding in either model.
    backend.exact_float32()
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    _analyze(model, args.min_layers)  # argument errors first, before inputs
    rng = np.random.default_rng(args.seed)
    notes: list[str] = []
    inputs, described = random_inputs(model, batch=args.batch, steps=args.steps, rng=rng, notes=notes)
    optimized, summary = _optimize(model, args)
    report, fast = optimized.report, optimized.model
    variables = list(model.trainable_variables)
    run = backend.outputs_and_grads
    out_orig, grads_orig = _run_model(run, model, inputs, variables, args.seed, command="check")
    out_fast, grads_fast = _run_model(run, fast, inputs, variables, args.seed, command="check")
    if len(out_orig) != len(out_fast):
        raise CliError(
            f"the optimized model returns {len(out_fast)} outputs and the "
            f"original {len(out_orig)}. Fix: this is a bug in rnnfuse; please report it"
        )
    out_diff, out_scale = _max_diff(out_orig, out_fast)
    grad_diff, grad_scale, worst = 0.0, 0.0, None
    for v, a, b in zip(variables, grads_orig, grads_fast):
        d, s = _max_diff([a], [b])
        grad_scale = max(grad_scale, s)
        if worst is None or d > grad_diff:
            grad_diff, worst = d, v.path
    compute = _compute_dtype(model)
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE.get(compute, 1e-4)
    passed = out_diff <= tolerance and grad_diff <= tolerance
    paths = {l.name: l.last_path for l in _fused_layers(fast)}
    result = {
        "model": model.name,
        "device": backend.describe_device()[0],
        "compute_dtype": compute,
        "groups": len(report.groups),
        "plans": {layers: f"{plan} ({source})" for layers, plan, source in summary},
        "fused_paths": paths,
        "inputs": described,
        "outputs_max_abs_diff": out_diff,
        "outputs_max_abs": out_scale,
        "gradients_max_abs_diff": grad_diff,
        "gradients_max_abs": grad_scale,
        "gradients_worst_variable": worst,
        "variables": len(variables),
        "tolerance": tolerance,
        "passed": passed,
        "caveat": _caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_check(result)
    return EXIT_OK if passed else EXIT_MISMATCH


def _compute_dtype(model) -> str:
    """The narrowest compute dtype among the model's layers."""
    dtypes = {str(getattr(l, "compute_dtype", "float32")) for l in model._flatten_layers(include_self=False)}
    for narrow in ("float16", "bfloat16"):
        if narrow in dtypes:
            return narrow
    return "float32"


def _max_diff(a: list, b: list) -> tuple[float, float]:
    """(max abs difference, max abs value of `a`) over paired arrays."""
    import numpy as np

    diff, scale = 0.0, 0.0
    for x, y in zip(a, b):
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x64.shape != y64.shape:
            return float("inf"), scale
        if x64.size:
            diff = max(diff, float(np.max(np.abs(x64 - y64))))
            scale = max(scale, float(np.max(np.abs(x64))))
    return diff, scale


def _print_check(result: dict) -> None:
    console = _console()
    console.print(
        f"rnnfuse check '{result['model']}': {result['groups']} fused group(s), "
        f"{result['compute_dtype']}"
    )
    _print_header(console, result)
    console.print(
        f"outputs:   max abs diff {result['outputs_max_abs_diff']:.3g} "
        f"(largest output {result['outputs_max_abs']:.3g})"
    )
    worst = f", worst {result['gradients_worst_variable']}" if result["gradients_max_abs_diff"] else ""
    console.print(
        f"gradients: max abs diff {result['gradients_max_abs_diff']:.3g} over "
        f"{result['variables']} trainable variables (largest gradient "
        f"{result['gradients_max_abs']:.3g}{worst})"
    )
    if result["caveat"]:
        console.print(result["caveat"])
    tol = result["tolerance"]
    if result["passed"]:
        console.print(f"PASS: both within the tolerance {tol:g}")
    else:
        console.print(f"FAIL: above the tolerance {tol:g}")
