"""The `rnnfuse` command line: what fuses in a model, how fast, how exact.

Commands (MODEL is a `.keras` file, or `module:function` / `path/to/file.py:fn`
naming a function that takes no arguments and returns a built keras.Model),
one module each:

    rnnfuse inspect MODEL [--json] [--plot FILE.png]           (cli/inspect.py)
    rnnfuse bench   MODEL [--batch N] [--steps T] [--train] [--mixed-precision]
                          [--repeats K] [--warmup W] [--plan P] [--tune] [--json]
                                                                (cli/bench.py)
    rnnfuse check   MODEL [--tolerance X] [--batch N] [--steps T] [--seed S]
                          [--mixed-precision] [--plan P] [--json] (cli/check.py)
    rnnfuse build-ops [--force]                                 (cli/build_ops.py)

The commands that read a MODEL take `--min-layers N`, `--import MODULE`
(import a module first, for example the one that registers a model's
custom layers; repeatable) and `--unsafe` (load a `.keras` file with
`safe_mode=False`, for Lambda layers you trust); `--plan
auto|fused|per-layer` picks how each group runs (auto is
`rnnfuse.optimize`'s own choice). Every command takes, before or after its
name, `-q` (errors and the command's one-line result only), `-v` (debug
messages too) and `--debug` (TensorFlow's own log lines, Python warnings,
and the traceback of an error).

The other modules: `arguments` (the parser, built from `COMMANDS`),
`pipeline` (analyze, plans, optimize as the commands call them), `inputs`
(random inputs, running the model), `loading` (MODEL -> keras.Model),
`output` (the `--json` records), `render` (what the commands print),
`errors` and `quiet` (logging and TensorFlow's start-up lines). A new
command is a module with NAME, HELP, PARENTS, add_arguments and run, named
in `COMMANDS` below.

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
`schema_version` (rnnfuse/schema/cli-output-v1.json; `rnnfuse.cli.output`);
an error under `--json` is a record too, `{"error": {"exit_code",
"message"}, ...}` on stdout, besides its line on stderr.

Random inputs (`bench`, `check`) follow each model input's shape and dtype:
the batch size from `--batch`; the time axis (axis 1) from the input's shape,
or from `--steps` where the shape leaves it open; floats are standard
normal; integer inputs that feed an `Embedding` get token ids below its
`input_dim` (from 1 when `mask_zero=True`, and then right-padded with 0 to
random lengths, so masks take the sequence-length path).

`bench` and `check` run on the TensorFlow, torch and JAX Keras backends.

Example:

    >>> from rnnfuse.cli import main
    >>> main(["inspect", "examples/text_classifier.py:build_model", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import sys
import traceback
from typing import Sequence

from rnnfuse.cli import bench, build_ops, check, inspect
from rnnfuse.cli.arguments import build_parser
from rnnfuse.cli.errors import CliError, _first_line, _one_line
from rnnfuse.cli.inputs import random_inputs
from rnnfuse.cli.loading import check_source, load_model
from rnnfuse.cli.quiet import (
    configure_logging,
    quiet_native_stderr,
    rnnfuse_warnings_logged,
    verbosity_level,
)

__all__ = ["COMMANDS", "CliError", "load_model", "main", "random_inputs"]

# The commands, in the order `rnnfuse --help` lists them.
COMMANDS = (inspect, bench, check, build_ops)

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code.

    Args:
        argv: the arguments after the program name (default: sys.argv[1:]).

    Returns:
        0 on success, 1 when `check` finds a difference above the tolerance,
        2 for a problem with the input, 3 for an unexpected error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {c.NAME for c in COMMANDS}
    # What a bad option must still honour: --debug, and --json (the error
    # as a JSON record), for the command named.
    failure = _Failure(
        debug="--debug" in argv,
        as_json="--json" in argv,
        command=next((a for a in argv if a in names), None),
    )
    try:
        args = build_parser(COMMANDS).parse_args(argv)
    except SystemExit as done:  # --help, --version
        return int(done.code or 0)
    except CliError as err:
        return failure(err, EXIT_USAGE)
    failure = _Failure(debug=bool(args.debug), as_json=bool(getattr(args, "json", False)), command=args.command)
    restore_logging = configure_logging(verbosity_level(quiet=args.quiet, verbose=args.verbose))
    try:
        with quiet_native_stderr(failure.debug), rnnfuse_warnings_logged(failure.debug):
            if args.run is None:
                raise CliError(
                    f"choose a command: {', '.join(c.NAME for c in COMMANDS)} (for example "
                    "'rnnfuse inspect model.keras'). Run 'rnnfuse --help' for more"
                )
            if getattr(args, "model", None) is not None:
                check_source(args.model)  # before the seconds keras takes to import
            _load_library()
            return args.run(args)
    except CliError as err:
        return failure(err, EXIT_USAGE)
    except KeyboardInterrupt:
        return failure(CliError("interrupted"), 130)
    except Exception as err:  # noqa: BLE001 - the last resort: one line, no traceback
        wrapped = CliError(
            f"unexpected {type(err).__name__}: {_first_line(err)}. This may be "
            "a bug in rnnfuse: run again with --debug and report the traceback"
        )
        wrapped.__cause__ = err
        return failure(wrapped, EXIT_INTERNAL)
    finally:
        restore_logging()


def _load_library() -> None:
    """Imports keras and rnnfuse's API, after the arguments are parsed."""
    import rnnfuse

    try:
        rnnfuse._load_api()
    except ImportError as err:
        raise CliError(_first_line(err).removeprefix("rnnfuse: ")) from err


class _Failure:
    """Reports an error: one line on stderr (the traceback first with
    --debug) and, under --json, a JSON record on stdout."""

    def __init__(self, *, debug: bool, as_json: bool, command: str | None):
        self.debug, self.as_json, self.command = debug, as_json, command

    def __call__(self, err: CliError, code: int) -> int:
        from rnnfuse.cli.output import error_record
        from rnnfuse.cli.render import print_json

        message = _one_line(str(err))
        if self.debug:
            traceback.print_exception(err.__cause__ or err)
        print(f"rnnfuse: error: {message}", file=sys.stderr)
        if self.as_json:
            print_json(error_record(self.command, code, message))
        return code
