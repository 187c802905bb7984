"""The command line's argument parser, built from the commands' modules
(each declares `NAME`, `HELP`, `PARENTS`, `add_arguments` and `run`). The
shared option sets: "model" (MODEL, `--import`, `--unsafe`,
`--min-layers`), "plan" and "json"; `-q`, `-v` and `--debug` everywhere.
A bad option is a one-line `CliError` (exit 2).

>>> from rnnfuse.cli import build_ops
>>> build_parser([build_ops]).parse_args(["build-ops", "--debug"]).debug
True
"""

from __future__ import annotations

import argparse
import math
from typing import Sequence

from rnnfuse.cli.errors import CliError

__all__ = ["build_parser", "positive_int", "tolerance"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option as a one-line CliError."""

    def error(self, message):
        raise CliError(f"{message}. Run '{self.prog} --help' for the options")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    return value


def tolerance(text: str) -> float:
    """argparse type: a finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected a non-negative number such as 1e-4, received {text!r}"
        )
    return value


def _verbosity(default) -> argparse.ArgumentParser:
    """-q, -v and --debug; `default` is SUPPRESS on the commands, so that a
    flag given before the command name is not reset by the command's parser."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "-q", "--quiet", action="count", default=default,
        help="print only errors and the command's one-line result",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=default, help="print debug messages too"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="show TensorFlow's log lines, Python warnings, and the traceback of an error",
    )
    return parser


def _shared() -> dict[str, argparse.ArgumentParser]:
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or module:function (or path/to/file.py:function) "
        "returning a built keras.Model",
    )
    model.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a name or path/to/file.py) first, e.g. the one "
        "that registers the model's custom layers; repeatable",
    )
    model.add_argument(
        "--unsafe",
        action="store_true",
        help="load the .keras file with safe_mode=False (Lambda layers); only for files you trust",
    )
    model.add_argument(
        "--min-layers",
        type=positive_int,
        default=None,
        metavar="N",
        help="the least number of recurrent levels worth fusing (default: per kind, 1 for "
        "LSTM/GRU/SimpleRNN/RNN(cell), so a lone layer is a group of one; 2 for "
        "ProjectedLSTM; 2: stacks only)",
    )
    plan = argparse.ArgumentParser(add_help=False)
    plan.add_argument(
        "--plan",
        choices=("auto", "fused", "per-layer"),
        default="auto",
        help="how each group runs: optimize()'s choice (auto, the default), "
        "every group fused whole (fused), or its original layers (per-layer)",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument(
        "--json", action="store_true", help="print one JSON record (errors too) on stdout"
    )
    return {"model": model, "plan": plan, "json": as_json}


def build_parser(commands: Sequence) -> argparse.ArgumentParser:
    """The `rnnfuse` parser with one subcommand per module of `commands`.

    Args:
        commands: modules with NAME, HELP, PARENTS, add_arguments and run.
    """
    from rnnfuse.cli.output import rnnfuse_version

    names = ", ".join(c.NAME for c in commands)
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
        parents=[_verbosity(0)],
    )
    parser.add_argument("--version", action="version", version=f"rnnfuse {rnnfuse_version()}")
    subcommands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser, title=f"commands ({names})"
    )
    shared = _shared()
    for command in commands:
        sub = subcommands.add_parser(
            command.NAME,
            help=command.HELP,
            description=command.HELP,
            parents=[_verbosity(argparse.SUPPRESS), *(shared[p] for p in command.PARENTS)],
        )
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    parser.set_defaults(run=None)
    return parser
