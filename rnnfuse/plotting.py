"""Draws a model's layer graph with the fused groups highlighted.

`plot_layer_graph(model, path)` draws the graph `build_layer_graph` sees
(nested models expanded, one box per layer call) from top to bottom in
topological layers, and colours it with `analyze`'s verdicts:

- each fused group: its layers (and absorbed Dropout layers) filled with the
  group's colour inside a shaded frame labelled "group i: <cell> x <levels>";
- each recurrent layer left alone: a red-bordered box whose last line is
  "not fused: <rule>" (the `Reason.rule`; `rnnfuse inspect` prints the text);
- a subclassed sub-model rnnfuse cannot see into: a dark box;
- every other layer: grey; model inputs and outputs: dashed white boxes;
- arrows are the tensors between layers; a mask passed on is a dashed grey
  arrow.

It needs matplotlib (a test extra of rnnfuse, not a dependency) and draws
on the Agg canvas directly, without pyplot, so it never changes the
process's matplotlib backend or opens a window.

Example:

    >>> import keras
    >>> m = keras.Sequential([keras.Input((6, 2)),
    ...     keras.layers.GRU(4, return_sequences=True),
    ...     keras.layers.GRU(4), keras.layers.Dense(1)])
    >>> fig = plot_layer_graph(m)            # or plot_layer_graph(m, "m.png")
    >>> type(fig).__name__
    'Figure'
"""

from __future__ import annotations

import os
from typing import Any

import networkx as nx

__all__ = ["MissingPlotDependency", "plot_layer_graph"]


class MissingPlotDependency(ImportError):
    """matplotlib is not installed; the message says how to install it."""

_OTHER = "#e8e8e8"
_SKIPPED_EDGE = "#c62828"
_SKIPPED_FILL = "#fdecea"
_OPAQUE = "#616161"
_GROUP_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#bab0ac", "#e15759",
)


def plot_layer_graph(
    model: Any,
    path: str | os.PathLike | None = None,
    *,
    report: Any = None,
    min_layers: int = 2,
    title: str | None = None,
    dpi: int = 120,
):
    """Draws `model`'s layer graph, fused groups highlighted.

    Args:
        model: a built Sequential or Functional keras.Model.
        path: where to save the drawing (.png, .svg, .pdf, ...); None to
            only return the figure.
        report: `rnnfuse.analyze(model)`'s report, if already computed.
        min_layers: passed to `analyze` when `report` is None.
        title: the figure's title (default: the model's name).
        dpi: resolution of a saved raster image.

    Returns:
        The `matplotlib.figure.Figure`.

    Raises:
        ValueError: `model` is a subclassed model (it has no layer graph).
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch, Patch
    except ImportError as err:
        raise MissingPlotDependency(
            "drawing needs matplotlib, which is not installed. Fix: pip install "
            "'rnnfuse[plot]'"
        ) from err

    import rnnfuse
    from rnnfuse.passes.graph import build_layer_graph, is_graph_model

    if not is_graph_model(model):
        raise ValueError(
            f"model '{getattr(model, 'name', model)}' is a subclassed model "
            f"({type(model).__name__}); it has no layer graph to draw. Fix: "
            "build it as a Functional or Sequential model"
        )
    if report is None:
        report = rnnfuse.analyze(model, min_layers=min_layers)
    graph = build_layer_graph(model)
    pos, rows, width = _layout(graph)
    styles = _styles(graph, report)

    fig = Figure(figsize=(max(6.0, 2.6 * width), max(3.0, 1.05 * rows + 1.2)))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.90))
    ax.set_axis_off()
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(-rows + 0.4, 0.6)

    for i, group in enumerate(report.groups):
        members = [k for k in (*group.layers, *group.absorbed_dropout) if k in pos]
        if not members:
            continue
        xs = [pos[k][0] for k in members]
        ys = [pos[k][1] for k in members]
        colour = _GROUP_COLOURS[i % len(_GROUP_COLOURS)]
        ax.add_patch(
            FancyBboxPatch(
                (min(xs) - 0.46, min(ys) - 0.36),
                max(xs) - min(xs) + 0.92,
                max(ys) - min(ys) + 0.72,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=colour,
                alpha=0.18,
                edgecolor=colour,
                linewidth=1.5,
                zorder=0,
            )
        )
        ax.text(
            max(xs) + 0.44,
            max(ys) + 0.32,
            f"group {i}: {group.cell} x {group.num_layers}",
            ha="right",
            va="top",
            fontsize=7,
            color=colour,
            fontweight="bold",
            zorder=1,
        )

    boxes = {}
    for key, (x, y) in pos.items():
        style = styles[key]
        boxes[key] = ax.text(
            x,
            y,
            style["label"],
            ha="center",
            va="center",
            fontsize=7,
            color=style.get("text", "black"),
            # Below the arrows: a box's outline is known only once it is
            # drawn, and the arrows are clipped to it.
            zorder=2,
            bbox=dict(
                boxstyle="round,pad=0.35",
                facecolor=style["fill"],
                edgecolor=style["edge"],
                linestyle=style.get("linestyle", "solid"),
                linewidth=style.get("linewidth", 1.0),
            ),
        )
    for src, dst, role in graph.edges(data="role"):
        mask = role == "mask"
        ax.annotate(
            "",
            xy=pos[dst],
            xytext=pos[src],
            arrowprops=dict(
                arrowstyle="-|>",
                color="#aaaaaa" if mask else "#555555",
                linestyle="dashed" if mask else "solid",
                linewidth=0.7 if mask else 0.9,
                shrinkA=2,
                shrinkB=2,
                patchA=boxes[src].get_bbox_patch(),
                patchB=boxes[dst].get_bbox_patch(),
            ),
            zorder=3,
        )

    legend = [
        Patch(facecolor=_GROUP_COLOURS[i % len(_GROUP_COLOURS)], label=f"fused group {i}")
        for i in range(len(report.groups))
    ]
    if any(s["kind"] == "skipped" for s in styles.values()):
        legend.append(Patch(facecolor=_SKIPPED_FILL, edgecolor=_SKIPPED_EDGE, label="recurrent, not fused"))
    legend.append(Patch(facecolor=_OTHER, edgecolor="#999999", label="other layer"))
    if any(role == "mask" for _, _, role in graph.edges(data="role")):
        legend.append(Patch(facecolor="white", edgecolor="#aaaaaa", linestyle="dashed", label="mask (dashed arrow)"))
    fig.legend(handles=legend, loc="upper right", fontsize=7, frameon=False)
    fig.suptitle(
        title or f"rnnfuse: '{report.model_name}'\n{len(report.groups)} fused "
        f"group(s), {len(report.skipped)} recurrent layer(s) left alone",
        fontsize=9,
        x=0.02,
        ha="left",
    )
    if path is not None:
        fig.savefig(os.fspath(path), dpi=dpi)
    return fig


def _layout(graph: nx.DiGraph) -> tuple[dict, int, int]:
    """Positions: one row per topological generation, top to bottom."""
    if nx.is_directed_acyclic_graph(graph):
        generations = [list(g) for g in nx.topological_generations(graph)]
    else:  # cannot happen for a Keras graph; stay drawable anyway
        generations = [[n] for n in graph]
    width = max((len(g) for g in generations), default=1)
    order = {key: i for i, key in enumerate(graph)}
    pos = {}
    for row, nodes in enumerate(generations):
        offset = (width - len(nodes)) / 2

        def placement(key):
            # Below the first row: under the mean of the node's inputs,
            # which keeps arrows short and rarely crossing.
            xs = [pos[p][0] for p in graph.predecessors(key) if p in pos]
            return (sum(xs) / len(xs) if xs else 0.0, order[key])

        for col, key in enumerate(sorted(nodes, key=placement)):
            pos[key] = (offset + col, -row)
    return pos, len(generations), width


def _styles(graph: nx.DiGraph, report: Any) -> dict[str, dict]:
    """Label and colours of every node."""
    group_of = {}
    for i, group in enumerate(report.groups):
        for key in (*group.layers, *group.absorbed_dropout):
            group_of[key] = i
    styles = {}
    for key, data in graph.nodes(data=True):
        layer = data.get("layer")
        if data["kind"] in ("input", "output"):
            name = key[len(data["scope"]):]
            styles[key] = dict(
                kind="io", label=name.strip("<>").replace(":", ": ", 1),
                fill="white", edge="#999999", linestyle="dashed",
            )
            continue
        label = f"{key}\n{_class_name(layer)}"
        if key in group_of:
            colour = _GROUP_COLOURS[group_of[key] % len(_GROUP_COLOURS)]
            styles[key] = dict(kind="fused", label=label, fill=colour, edge=colour, text="white", linewidth=1.5)
        elif key in report.skipped:
            rule = getattr(report.skipped[key], "rule", "")
            styles[key] = dict(
                kind="skipped", label=f"{label}\nnot fused: {rule}",
                fill=_SKIPPED_FILL, edge=_SKIPPED_EDGE, linewidth=1.8,
            )
        elif data["kind"] == "opaque":
            inner = sorted({
                getattr(r, "rule", "") for k, r in report.skipped.items() if k.startswith(key + "/")
            })
            extra = f"\nnot fused: {', '.join(inner)}" if inner else ""
            styles[key] = dict(
                kind="skipped" if inner else "opaque", label=f"{label} (subclassed){extra}",
                fill=_OPAQUE, edge=_SKIPPED_EDGE if inner else _OPAQUE, text="white",
            )
        else:
            styles[key] = dict(kind="other", label=label, fill=_OTHER, edge="#999999")
    return styles


def _class_name(layer: Any) -> str:
    name = type(layer).__name__
    inner = getattr(layer, "forward_layer", None)
    if inner is not None:
        return f"{name}({type(inner).__name__})"
    cell = getattr(layer, "cell", None)
    if name == "RNN" and cell is not None:
        cells = getattr(cell, "cells", None)
        if cells is not None:
            return f"RNN(Stacked[{', '.join(type(c).__name__ for c in cells)}])"
        return f"RNN({type(cell).__name__})"
    return name
