"""A `FusionReport` as text: the fused groups, the recurrent layers left
alone (each with its rule and reason), the notes. Cells are rich `Text`
and consoles have markup off, so a layer named `enc[bold]` prints as
written.

>>> import keras, rnnfuse
>>> m = keras.Sequential([keras.Input((10, 4)),
...     keras.layers.GRU(8, return_sequences=True, name="enc[bold]"), keras.layers.GRU(8)])
>>> "enc[bold] -> gru" in report_text(rnnfuse.analyze(m))
True
"""

from __future__ import annotations

import io
from typing import Any, Sequence, TextIO

__all__ = ["break_lines", "plain_console", "print_report", "report_tables", "report_text"]


def plain_console(file: TextIO, *, width: int | None = None, color: bool = True):
    """A rich Console that prints text as written: no markup, no highlighting."""
    from rich.console import Console

    return Console(file=file, width=width, no_color=not color, highlight=False, markup=False, emoji=False)


def report_tables(report: Any, runs: Sequence[str] | None = None, runs_title: str = "runs") -> tuple:
    """rich Tables of the fused groups and the layers left alone; `runs`: one
    extra cell per group, under `runs_title`."""
    from rich.table import Table
    from rich.text import Text

    # Text cells are never read as markup, whatever console prints them.
    fused = Table(title=Text(f"rnnfuse: fused groups in '{report.model_name}'"))
    for col in ("#", "layers", "cell", "units", "levels", "input", "bidir"):
        fused.add_column(col)
    if runs is not None:
        fused.add_column(runs_title)
    for i, g in enumerate(report.groups):
        layers = " -> ".join(g.layers)
        if g.absorbed_dropout:
            layers += f"  (absorbs {', '.join(g.absorbed_dropout)})"
        cell = g.cell + (f" (proj {g.proj_size})" if g.proj_size else "")
        cells = [str(i), layers, cell, str(g.units), str(g.num_layers), str(g.input_size)]
        cells += ["yes" if g.bidirectional else "no", *([runs[i]] if runs is not None else [])]
        fused.add_row(*map(Text, cells))
    alone = Table(title="recurrent layers left as they are")
    for col in ("layer", "rule", "why"):
        alone.add_column(col)
    for name, reason in report.skipped.items():
        alone.add_row(Text(name), Text(getattr(reason, "rule", "")), Text(str(reason)))
    return fused, alone


def print_report(
    console,
    report: Any,
    *,
    runs: Sequence[str] | None = None,
    runs_title: str = "runs",
    empty: str | None = None,
) -> None:
    """Prints the groups (or `empty`), the layers left alone, the grouped
    neighbours that are separate calls, and the notes."""
    fused, alone = report_tables(report, runs, runs_title)
    if report.groups:
        console.print(fused)
    else:
        console.print(empty or f"rnnfuse: no fusable runs in '{report.model_name}'.")
    if report.skipped:
        console.print(alone)
    for line in break_lines(report):
        console.print(line)
    for note in report.notes:
        console.print(f"note: {note}")


def break_lines(report: Any) -> list[str]:
    """One line per pair of grouped neighbours that run as separate calls
    (`report.breaks`), naming the rule that keeps them apart."""
    return [
        f"separate groups: '{upper}' -> '{lower}' ({getattr(reason, 'rule', 'unknown')}): {reason}"
        for (upper, lower), reason in report.breaks.items()
    ]


def report_text(report: Any) -> str:
    """The report as plain text, 120 columns wide (what `str(report)` is)."""
    buf = io.StringIO()
    print_report(plain_console(buf, width=120, color=False), report)
    return buf.getvalue().rstrip("\n")
