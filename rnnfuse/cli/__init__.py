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
Lambda layers you trust), `-q` (errors only), `-v` (debug messages too) and
`--debug` (TensorFlow's own log lines, Python warnings, and the traceback of
an error). `--plan auto|fused|per-layer` picks how each group runs: auto is
`rnnfuse.optimize`'s own choice.

Exit codes: 0 success; 1 `check` found a difference above the tolerance;
2 a problem with the input (a missing or unreadable file, a file that is not
a Keras model, custom objects that cannot be found, a bad option, a function
that does not return a model): one line on stderr saying what and how to fix
it; 3 an unexpected internal error (also one line; `--debug` shows the
traceback).

Start-up: `--help` and `--version` answer without importing keras; a command
imports keras (and the backend) after its arguments are parsed. TensorFlow's
C++ start-up log lines are dropped unless `--debug` (see `rnnfuse.cli.quiet`).
rnnfuse's own messages go through the `rnnfuse` logger to stderr.

`--json` prints one record whose fields and types are fixed by
`schema_version` (rnnfuse/schema/cli-output-v1.json; `rnnfuse.cli.output`).

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
import logging
import math
import os
import statistics
import sys
import time
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
from rnnfuse.cli.quiet import configure_logging, quiet_native_stderr, verbosity_level

__all__ = ["CliError", "load_model", "main", "random_inputs"]

logger = logging.getLogger("rnnfuse")

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
    debug = bool(getattr(args, "debug", False))
    level = verbosity_level(quiet=getattr(args, "quiet", 0), verbose=getattr(args, "verbose", 0))
    restore_logging = configure_logging(level)
    try:
        with quiet_native_stderr(debug), _quiet(debug):
            if args.run is not _no_command:
                _load_library()
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
    finally:
        restore_logging()


def _load_library() -> None:
    """Imports keras and rnnfuse's API, after the arguments are parsed."""
    import rnnfuse

    try:
        rnnfuse._load_api()
    except ImportError as err:
        raise CliError(_first_line(err).removeprefix("rnnfuse: ")) from err


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


def _add_verbosity(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "-q", "--quiet", action="count", default=default,
        help="print only errors (and the command's result)",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=default,
        help="print debug messages too",
    )


def _parser() -> argparse.ArgumentParser:
    from rnnfuse.cli.output import rnnfuse_version

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
        help="the least number of recurrent levels worth fusing (default: per kind, 1 for "
        "layers Keras runs in its Python loop, 2 for LSTM/GRU/ProjectedLSTM)",
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
        help="show TensorFlow's log lines, Python warnings, and the traceback "
        "of an error",
    )
    _add_verbosity(common, argparse.SUPPRESS)

    parser = _Parser(
        prog="rnnfuse",
        description="See which stacked recurrent layers of a Keras 3 model "
        "fuse into one cuDNN call, how much faster that is here, and that "
        "it computes the same thing.",
        epilog="examples:\n"
        "  rnnfuse inspect model.keras --plot graph.png\n"
        "  rnnfuse check model.keras\n"
        "  rnnfuse bench model.keras --batch 32 --steps 200 --train\n"
        "  rnnfuse inspect examples/speech_encoder.py:build_model\n"
        "  rnnfuse check model.keras --json | jq .passed\n\n"
        "exit codes: 0 ok, 1 check above tolerance, 2 bad input (one line on "
        "stderr),\n3 internal error. Run 'rnnfuse COMMAND --help' for a "
        "command's options.\nDocs: "
        "https://github.com/rnnfuse/rnnfuse/blob/main/docs/guide.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rnnfuse {rnnfuse_version()}")
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    _add_verbosity(parser, 0)
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


def _analyze(model, min_layers: int | None):
    import rnnfuse

    try:
        return rnnfuse.analyze(model, min_layers=min_layers)
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def _forced_plan(args):
    import rnnfuse

    return {"auto": None, "fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER}[
        getattr(args, "plan", "auto")
    ]


def _choose(model, report, args, *, tune=None, training=True) -> list:
    """Each group's `TuneResult` (group, plan, how it was chosen), for
    `inspect`, which builds no model.

    The plan of each group (fused whole, split, per layer) comes from
    `--plan`: "auto" is `optimize`'s own choice (the static rule table, or
    timing on this device with `tune`), "fused" forces every group fused.
    """
    from rnnfuse.api import choose_plans

    try:
        return choose_plans(model, report.groups, tune=tune, training=training, plan=_forced_plan(args))
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def _optimize(model, args, *, tune=None, training=True):
    """The `rnnfuse.OptimizeResult` of one `optimize` call (model, report,
    each group's `TuneResult`); the pipeline runs once."""
    import rnnfuse

    # The commands say themselves, per group, where nothing runs fused.
    said_here = _DropRecords("_say_if_nothing_runs_fused")
    logger.addFilter(said_here)
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        stack.callback(logger.removeFilter, said_here)
        warnings.simplefilter("always", rnnfuse.FusionWarning)
        try:
            result = rnnfuse.optimize(
                model,
                min_layers=args.min_layers,
                tune=tune if tune is not None else False,
                training=training,
                plan=_forced_plan(args),
                return_result=True,
            )
        except (TypeError, ValueError) as err:
            raise CliError(_first_line(err, limit=600)) from err
    for w in caught:
        if issubclass(w.category, rnnfuse.FusionWarning):
            logger.warning(_one_line(str(w.message)))
    return result


class _DropRecords(logging.Filter):
    """Drops the log records one function of the library emits."""

    def __init__(self, func_name: str):
        super().__init__()
        self.func_name = func_name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != self.func_name


def _fused_layers(model) -> list:
    from rnnfuse import FusedRNN

    return [l for l in model._flatten_layers(include_self=False) if isinstance(l, FusedRNN)]


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120
    return Console(file=stream, width=width, highlight=False)


def _print_json(result: dict) -> None:
    print(json.dumps(result, indent=2, allow_nan=False, default=_json_number))


def _json_number(value):
    # numpy scalars that slipped through; NaN/inf become null (valid JSON).
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _here(chosen) -> str | None:
    """Why no group runs fused here, or None: said before any work is timed."""
    from rnnfuse.placement import nothing_fused_reason

    return nothing_fused_reason([r.plan for r in chosen], [r.source for r in chosen])


# -- inspect -------------------------------------------------------------------


def _cmd_inspect(args) -> int:
    from rnnfuse.cli.output import envelope, group_records
    from rnnfuse.passes.graph import is_graph_model
    from rnnfuse.placement import backend_name

    model = load_model(args.model, imports=args.imports, safe_mode=not args.unsafe)
    report = _analyze(model, args.min_layers)
    chosen = _choose(model, report, args)
    groups = group_records(chosen)
    if args.plot:
        _plot(model, report, args.plot)
    if args.json:
        data = report.to_dict()
        result = {
            **envelope("inspect", report.model_name),
            "groups": groups,
            "skipped": data["skipped"],
            "notes": data["notes"],
        }
        _print_json(result)
        return EXIT_OK
    console = _console()
    here = [f"plan {g['plan']['name']}; runs {g['runs']['how']}" for g in groups]
    fused, alone = report.tables(runs=here, runs_title=f"runs here ({backend_name()})")
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
    running = sum(1 for g in groups if g["runs"]["fused"])
    console.print(
        f"{len(report.groups)} group(s) of {fused_count} layer(s) can fuse; "
        f"{running} run(s) fused here ({backend_name()}); "
        f"{len(report.skipped)} recurrent layer(s) stay as they are"
        + (
            f"; {len(already)} FusedRNN layer(s) already run "
            f"{sum(len(l.fused_layers) for l in already)} recurrent layer(s)."
            if already
            else "."
        )
    )
    why = _here(chosen)
    if why:
        console.print(f"here, no group runs fused: {why}.")
    if args.plot:
        console.print(f"layer graph drawn to {args.plot}")
    return EXIT_OK


def _plot(model, report, path: str) -> None:
    from rnnfuse.plotting import MissingPlotDependency, plot_layer_graph

    formats = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")
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
    except MissingPlotDependency as err:
        raise CliError(f"--plot: {err}") from err
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
    from rnnfuse.cli.output import envelope, group_records, input_records

    engine = _backend("bench")
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    report = _analyze(model, args.min_layers)
    notes: list[str] = []
    inputs, described = random_inputs(
        model, batch=args.batch, steps=args.steps, rng=np.random.default_rng(0), notes=notes
    )
    tune = None
    if args.tune:
        steps = next((np.shape(x)[1] for x in _flatten(inputs) if np.ndim(x) >= 2), 1)
        tune = rnnfuse.TuneShape(args.batch, int(steps))
    optimized = _optimize(model, args, tune=tune, training=args.train)
    chosen, fast = list(optimized.plans), optimized.model
    device, on_gpu = engine.describe_device()
    notes += engine.timing_notes(on_gpu)
    result = {
        **envelope("bench", model.name),
        "device": device,
        "gpu": on_gpu,
        "mode": "train" if args.train else "inference",
        "compute_dtype": _compute_dtype(model),
        "batch": args.batch,
        "inputs": input_records(described),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "groups": group_records(chosen),
        "notes": notes,
    }
    # Say what the numbers can show before spending the time on them.
    early = _early_caveat(report, chosen)
    if not args.json:
        console = _console()
        console.print(
            f"rnnfuse bench '{result['model']}': {len(report.groups)} fusion group(s); "
            f"{result['mode']}, batch {result['batch']}, {result['compute_dtype']}, "
            f"{result['repeats']} timed runs each"
        )
        _print_header(console, result)
        if early:
            console.print(f"before timing: {early}")
    elif early:
        logger.info("before timing: %s", early)
    steps = {"original": engine.model_step(model, args.train), "optimized": engine.model_step(fast, args.train)}
    times = {"original": [], "optimized": []}
    with _progress(disable=args.json or logger.level >= logging.ERROR) as progress:
        task = progress.add_task("warming up", total=2 * (args.warmup + args.repeats))
        for _ in range(args.warmup):
            for fn in steps.values():
                _run_model(fn, inputs, command="bench")
                progress.advance(task)
        for i in range(args.repeats):
            progress.update(task, description=f"timing {i + 1}/{args.repeats}")
            # Alternate the order so drift does not favour either model.
            order = ["original", "optimized"] if i % 2 == 0 else ["optimized", "original"]
            for which in order:
                start = time.perf_counter()
                _run_model(steps[which], inputs, command="bench")
                times[which].append(1000 * (time.perf_counter() - start))
                progress.advance(task)
    paths = {l.name: l.last_path for l in _fused_layers(fast)}
    orig_ms, fast_ms = statistics.median(times["original"]), statistics.median(times["optimized"])
    result.update(
        {
            "fused_paths": paths,
            "original_ms": times["original"],
            "optimized_ms": times["optimized"],
            "original_median_ms": orig_ms,
            "optimized_median_ms": fast_ms,
            "speedup": orig_ms / fast_ms if fast_ms > 0 else None,
            "caveat": _caveat(paths, len(report.groups)),
        }
    )
    if args.json:
        _print_json(result)
    else:
        _print_bench(console, result, early)
    return EXIT_OK


def _early_caveat(report, chosen) -> str | None:
    """What the timing can show, from the plans alone (before any run)."""
    if not report.groups:
        return "nothing fuses in this model: both models run the same layers, so expect about 1.0x."
    why = _here(chosen)
    if why:
        return (
            f"no group runs fused here ({why}): both models run the same layers, "
            "so expect about 1.0x. On a CUDA GPU each group runs as one cuDNN call."
        )
    return None


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
    from rnnfuse.cli.output import describe_input

    console.print(f"device: {result['device']} ({result['backend']} backend)")
    for record in result["inputs"]:
        console.print(f"  input {describe_input(record)}")
    for group in result["groups"]:
        plan, runs = group["plan"], group["runs"]
        console.print(
            f"  group {' -> '.join(group['layers'])}: plan {plan['name']} "
            f"({plan['source']}); here: {runs['how']}"
        )
    for note in result["notes"]:
        console.print(f"note: {note}")


def _print_ran(console, result: dict) -> None:
    for name, path in result["fused_paths"].items():
        console.print(f"  {name} ran: {path}")


def _print_bench(console, result: dict, early: str | None) -> None:
    from rich.table import Table

    _print_ran(console, result)
    table = Table(title="milliseconds per step")
    for col in ("model", "median", "min", "max"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for which in ("original", "optimized"):
        t = result[f"{which}_ms"]
        table.add_row(which, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}")
    console.print(table)
    speedup = result["speedup"]
    console.print(
        "speedup (original / optimized, medians): "
        + (f"{speedup:.2f}x" if speedup is not None else "n/a")
    )
    if not result["gpu"]:
        console.print("no GPU visible: these are CPU timings.")
    if result["caveat"] and not early:  # a fallback only the run revealed
        console.print(result["caveat"])


# -- check ---------------------------------------------------------------------


def _cmd_check(args) -> int:
    import numpy as np

    from rnnfuse.cli.output import envelope, group_records, input_records

    engine = _backend("check")
    # Keep float32 matmuls exact on GPUs, so the comparison shows rnnfuse's
    # differences rather than TF32 rounding in either model.
    engine.exact_float32()
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    report = _analyze(model, args.min_layers)
    rng = np.random.default_rng(args.seed)
    notes: list[str] = []
    inputs, described = random_inputs(model, batch=args.batch, steps=args.steps, rng=rng, notes=notes)
    optimized = _optimize(model, args)
    chosen, fast = list(optimized.plans), optimized.model
    variables = list(model.trainable_variables)
    run = engine.outputs_and_grads
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
    compared_fused = any(p == "fused" or (p and not p.startswith("layers")) for p in paths.values())
    device, on_gpu = engine.describe_device()
    result = {
        **envelope("check", model.name),
        "device": device,
        "gpu": bool(on_gpu),
        "compute_dtype": compute,
        "batch": args.batch,
        "groups": group_records(chosen),
        "fused_paths": paths,
        "inputs": input_records(described),
        "outputs_max_abs_diff": _finite(out_diff),
        "outputs_max_abs": out_scale,
        "gradients_max_abs_diff": _finite(grad_diff),
        "gradients_max_abs": grad_scale,
        "gradients_worst_variable": worst,
        "variables": len(variables),
        "tolerance": tolerance,
        "passed": passed,
        "compared_fused_path": compared_fused,
        "caveat": _caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if report.groups and not compared_fused:
        result["notes"].append(_self_comparison_note(chosen))
    if args.json:
        _print_json(result)
    else:
        _print_check(result)
    return EXIT_OK if passed else EXIT_MISMATCH


def _self_comparison_note(chosen) -> str:
    """Says that `check` compared the original layers against themselves."""
    import importlib.util

    from rnnfuse.placement import backend_name

    why = _here(chosen) or "every fused layer fell back to the original layers"
    text = (
        f"no fused call ran here ({why}), so this compared the original layers "
        "against themselves: PASS says nothing about the fused kernel."
    )
    if backend_name() == "tensorflow":
        if importlib.util.find_spec("torch") is not None:
            text += (
                " To compare a fused call on this machine, run under "
                "KERAS_BACKEND=torch (its fused call runs on the CPU too)."
            )
        else:
            text += (
                " To compare a fused call on a CPU: pip install 'rnnfuse[torch]' "
                "and run under KERAS_BACKEND=torch; or run on a CUDA GPU."
            )
    else:
        text += " Run on a CUDA GPU to compare the fused call."
    return text


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
        f"rnnfuse check '{result['model']}': {len(result['groups'])} fusion group(s), "
        f"{result['compute_dtype']}"
    )
    _print_header(console, result)
    _print_ran(console, result)
    out_diff = result["outputs_max_abs_diff"]
    grad_diff = result["gradients_max_abs_diff"]
    out_text = f"{out_diff:.3g}" if out_diff is not None else "inf (shapes differ)"
    grad_text = f"{grad_diff:.3g}" if grad_diff is not None else "inf (shapes differ)"
    console.print(
        f"outputs:   max abs diff {out_text} "
        f"(largest output {result['outputs_max_abs']:.3g})"
    )
    worst = f", worst {result['gradients_worst_variable']}" if grad_diff else ""
    console.print(
        f"gradients: max abs diff {grad_text} over "
        f"{result['variables']} trainable variables (largest gradient "
        f"{result['gradients_max_abs']:.3g}{worst})"
    )
    if result["caveat"] and result["compared_fused_path"]:
        console.print(result["caveat"])
    tol = result["tolerance"]
    if result["passed"]:
        suffix = "" if result["compared_fused_path"] or not result["groups"] else " (original layers against themselves)"
        console.print(f"PASS: both within the tolerance {tol:g}{suffix}")
    else:
        console.print(f"FAIL: above the tolerance {tol:g}")
