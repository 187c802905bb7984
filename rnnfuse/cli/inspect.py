"""`rnnfuse inspect MODEL [--json] [--plot FILE.png]`: the fused groups,
how each runs here, and why every other recurrent layer is left alone.

Builds no optimized model: the plans come from `optimize`'s rule table (or
`--plan`). `-q` prints the one-line summary only.

Example:
    >>> from rnnfuse.cli import main
    >>> main(["inspect", "examples/text_classifier.py:build_model", "-q"])  # doctest: +SKIP
    1 group(s) of 2 layer(s) can fuse; here (tensorflow) they run unfused; 0 other recurrent layer(s) cannot fuse.
    0
"""

from __future__ import annotations

import os

from rnnfuse.cli import pipeline, render
from rnnfuse.cli.errors import CliError, _first_line
from rnnfuse.cli.loading import load_model

NAME = "inspect"
HELP = "list the fused groups and why each other recurrent layer is not fused"
PARENTS = ("model", "json")

_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def add_arguments(parser) -> None:
    parser.add_argument("--plot", metavar="FILE.png", help="draw the layer graph, fused groups highlighted")


def run(args) -> int:
    from rnnfuse.cli.output import envelope, group_records
    from rnnfuse.passes.graph import is_graph_model
    from rnnfuse.placement import backend_name
    from rnnfuse.fused import fused_layers

    model = load_model(args.model, imports=args.imports, safe_mode=not args.unsafe)
    report = pipeline.analyze(model, args.min_layers)
    chosen = pipeline.choose(model, report, args)
    groups = group_records(chosen)
    if args.plot:
        _plot(model, report, args.plot)
    why = pipeline.nothing_fused_here(chosen)
    if args.json:
        from rnnfuse.report_text import break_lines

        data = report.to_dict()
        # The remarks the text output prints, in its order.
        notes = [*break_lines(report), *data["notes"]]
        if why:
            notes.append(f"here, no group runs fused: {why}.")
        render.print_json({
            **envelope(NAME, report.model_name), "groups": groups, "skipped": data["skipped"],
            "breaks": data["breaks"], "notes": notes,
        })
        return 0
    already = fused_layers(model)
    if not is_graph_model(model):
        empty = (
            f"rnnfuse: cannot look inside '{report.model_name}': it is a subclassed "
            f"model ({type(model).__name__}), whose call() rnnfuse cannot read."
        )
    elif already:
        empty = f"rnnfuse: '{report.model_name}' is already optimized; no further fusable runs."
    else:
        empty = None
    render.print_inspect(
        render.Printer(quiet=bool(args.quiet)),
        report,
        groups,
        backend=backend_name(),
        empty=empty,
        already=already,
        why=why,
        plot=args.plot,
    )
    return 0


def _plot(model, report, path: str) -> None:
    from rnnfuse.plotting import MissingPlotDependency, plot_layer_graph

    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in _FORMATS:
        raise CliError(
            f"--plot: cannot draw to '{path}': "
            + (f"'.{extension}' is not an image format" if extension else "no file extension")
            + f". Fix: end the name in one of {', '.join('.' + f for f in _FORMATS)} "
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
