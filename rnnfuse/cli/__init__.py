"""The `rnnfuse` command line: what fuses in a model, how fast, how exact.

    rnnfuse inspect MODEL [--json] [--plot FILE.png]
    rnnfuse bench   MODEL [--batch N] [--steps T] [--train] [--tune] ...
    rnnfuse check   MODEL [--tolerance X] [--batch N] [--steps T] ...
    rnnfuse build-ops [--force]

MODEL is a `.keras` file or `module:function` / `file.py:fn` returning a
built model; one module per command, named in `COMMANDS`. Exit codes: 0
success; 1 `check` found a difference above the tolerance; 2 a problem
with the input (one line: what and how to fix it); 3 an internal error.
`--json` prints one record fixed by `schema_version`.

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
    """Runs the command line; returns the exit code (see the module doc).
    `argv`: the arguments after the program name (default: sys.argv[1:])."""
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
