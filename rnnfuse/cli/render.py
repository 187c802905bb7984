"""What the commands print: text on stdout (or one JSON record), progress
on stderr. A `Printer`'s `detail` lines are dropped under `-q`, its
`result` line never is; markup is off, so names print as written.

>>> printer = Printer(quiet=True)
>>> printer.detail("dropped under -q")
>>> printer.result("PASS [ok]")
PASS [ok]
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys

from rnnfuse.report_text import plain_console, print_report

__all__ = ["Printer", "print_bench", "print_check", "print_inspect", "print_json", "progress"]


def console(stderr: bool = False):
    """A console on stdout (or stderr): 120 columns when not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return plain_console(stream, width=None if stream.isatty() else 120)


class Printer:
    """A command's text output: `detail` lines are left out under -q."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.console = console()

    def detail(self, *renderables) -> None:
        if not self.quiet:
            self.console.print(*renderables)

    def result(self, text: str) -> None:
        self.console.print(text)


def print_json(record: dict) -> None:
    """One JSON record on stdout; NaN and infinities become null."""
    print(json.dumps(record, indent=2, allow_nan=False, default=_json_number))


def _json_number(value):
    # numpy scalars that slipped through; NaN/inf become null (valid JSON).
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


@contextlib.contextmanager
def progress(disable: bool):
    """A transient rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        disable=disable,
        transient=True,
    )
    with bar:
        yield bar


# -- inspect -------------------------------------------------------------------


def _runs_here(group: dict) -> str:
    """A group's cell of inspect's "runs here" column, with the static
    plan's reason where it has one ("static: <why>")."""
    text = f"plan {group['plan']['name']}; runs {group['runs']['how']}"
    source = group["plan"]["source"]
    return f"{text} ({source.removeprefix('static: ')})" if source.startswith("static: ") else text


def print_inspect(printer: Printer, report, groups: list[dict], *, backend: str, empty: str | None,
                  already: list, why: str | None, plot: str | None) -> None:
    """The report with how each group runs here (`groups`: the `--json` group
    records), and a one-line summary; `empty` is the line for a model without
    groups, `already` its FusedRNN layers, `why` why none runs fused here,
    `plot` the drawing's file."""
    if not printer.quiet:
        here = [_runs_here(g) for g in groups]
        print_report(printer.console, report, runs=here, runs_title=f"runs here ({backend})", empty=empty)
    fused_count = sum(len(g.layers) for g in report.groups)
    running = sum(1 for g in groups if g["runs"]["fused"])
    parts = [f"{len(report.groups)} group(s) of {fused_count} layer(s) can fuse"]
    if report.groups:
        if running == len(report.groups):
            parts.append(f"here ({backend}) each runs fused")
        elif running:
            parts.append(f"here ({backend}) {running} of them run fused")
        else:
            parts.append(f"here ({backend}) they run unfused")
    parts.append(f"{len(report.skipped)} other recurrent layer(s) cannot fuse")
    if already:
        parts.append(f"{len(already)} FusedRNN layer(s) already run "
                     f"{sum(len(l.fused_layers) for l in already)} recurrent layer(s)")
    printer.result("; ".join(parts) + ".")
    if why:
        printer.detail(f"here, no group runs fused: {why}.")
    if plot:
        printer.detail(f"layer graph drawn to {plot}")


# -- bench and check -------------------------------------------------------------


def print_header(printer: Printer, result: dict) -> None:
    """Device, inputs, each group's plan and the notes (bench and check)."""
    from rnnfuse.cli.output import describe_input

    printer.detail(f"device: {result['device']} ({result['backend']} backend)")
    for record in result["inputs"]:
        printer.detail(f"  input {describe_input(record)}")
    for group in result["groups"]:
        plan, runs = group["plan"], group["runs"]
        printer.detail(
            f"  group {' -> '.join(group['layers'])}: plan {plan['name']} "
            f"({plan['source']}); here: {runs['how']}"
        )
    for note in result["notes"]:
        printer.detail(f"note: {note}")


def _print_ran(printer: Printer, result: dict) -> None:
    for name, path in result["fused_paths"].items():
        if path is None:
            printer.detail(f"  {name} was not called")
        elif path.startswith("layers: "):
            printer.detail(f"  {name} ran the original layers: {path.removeprefix('layers: ')}")
        else:
            printer.detail(f"  {name} ran: {path}")


def print_bench_start(printer: Printer, result: dict, groups: int, early: str | None) -> None:
    """What bench will time, and what the timing can show, before it runs."""
    printer.detail(
        f"rnnfuse bench '{result['model']}': {groups} fusion group(s); "
        f"{result['mode']}, batch {result['batch']}, {result['compute_dtype']}, "
        f"{result['repeats']} timed runs each"
    )
    print_header(printer, result)
    if early:
        printer.detail(f"before timing: {early}")


def print_bench(printer: Printer, result: dict, early: str | None) -> None:
    """The timings table and the speedup (the result line)."""
    from rich.table import Table

    _print_ran(printer, result)
    table = Table(title="milliseconds per step")
    for col in ("model", "median", "min", "max"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for which in ("original", "optimized"):
        t = result[f"{which}_ms"]
        table.add_row(which, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}")
    printer.detail(table)
    speedup = result["speedup"]
    printer.result(
        "speedup (original / optimized, medians): "
        + (f"{speedup:.2f}x" if speedup is not None else "n/a")
    )
    if not result["gpu"]:
        printer.detail("no GPU visible: these are CPU timings.")
    if result["caveat"] and not early:  # a fallback only the run revealed
        printer.detail(result["caveat"])


def print_check(printer: Printer, result: dict) -> None:
    """The largest differences, and PASS or FAIL (the result line)."""
    printer.detail(
        f"rnnfuse check '{result['model']}': {len(result['groups'])} fusion group(s), "
        f"{result['compute_dtype']}"
    )
    print_header(printer, result)
    _print_ran(printer, result)
    out_diff = result["outputs_max_abs_diff"]
    grad_diff = result["gradients_max_abs_diff"]
    out_text = f"{out_diff:.3g}" if out_diff is not None else "inf (shapes differ)"
    grad_text = f"{grad_diff:.3g}" if grad_diff is not None else "inf (shapes differ)"
    printer.detail(
        f"outputs:   max abs diff {out_text} (largest output {result['outputs_max_abs']:.3g})"
    )
    worst = f", worst {result['gradients_worst_variable']}" if grad_diff else ""
    printer.detail(
        f"gradients: max abs diff {grad_text} over "
        f"{result['variables']} trainable variables (largest gradient "
        f"{result['gradients_max_abs']:.3g}{worst})"
    )
    if result["caveat"] and result["compared_fused_path"]:
        printer.detail(result["caveat"])
    tol = result["tolerance"]
    if result["passed"]:
        suffix = "" if result["compared_fused_path"] else " (original layers against themselves)"
        printer.result(f"PASS: both within the tolerance {tol:g}{suffix}")
    else:
        printer.result(f"FAIL: above the tolerance {tol:g}")
