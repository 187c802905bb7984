"""Draws a model's layer graph with the fused groups highlighted.

`plot_layer_graph(model, path)` draws what `build_layer_graph` sees, top to
bottom, coloured with `analyze`'s verdicts: each fused group in its colour
inside a frame of its own, a recurrent layer left alone red-bordered with
"not fused: <rule>", a propagated mask as a "mask from <layer>" line.
Renderers: "graphviz" (pydot and `dot`) and "matplotlib" (networkx's
layered layout on the Agg canvas, without pyplot or a window).

>>> import keras
>>> m = keras.Sequential([keras.Input((6, 2)),
...     keras.layers.GRU(4, return_sequences=True), keras.layers.GRU(4)])
>>> type(plot_layer_graph(m, engine="matplotlib")).__name__   # or (m, "m.png")
'Figure'
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Any

import networkx as nx

__all__ = ["MissingPlotDependency", "plot_layer_graph"]

ENGINES = ("auto", "graphviz", "matplotlib")

_OTHER = "#e8e8e8"
_OTHER_EDGE = "#999999"
_SKIPPED_EDGE = "#c62828"
_SKIPPED_FILL = "#fdecea"
_OPAQUE = "#616161"
_GROUP_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#bab0ac", "#e15759",
)
_INSTALL = "pip install 'rnnfuse[plot]'"


class MissingPlotDependency(ImportError):
    """A plotting dependency is not installed; the message says how to fix it."""


# -- what to draw (shared by both renderers) -----------------------------------


@dataclasses.dataclass(frozen=True)
class _Box:
    """One box of the picture."""

    # "fused", "skipped", "opaque", "other" or "input".
    kind: str
    # Text lines: name, class, shapes, verdict.
    lines: tuple[str, ...]
    fill: str
    edge: str
    text: str = "black"
    # Index of the fused group it belongs to, or None.
    group: int | None = None
    # Qualified-name prefix of the (sub-)model holding it.
    scope: str = ""
    dashed: bool = False

    @property
    def label(self) -> str:
        return "\n".join(self.lines)


@dataclasses.dataclass(frozen=True)
class _Picture:
    """The boxes, the arrows between them and the groups' titles."""

    boxes: dict[str, _Box]
    # (source key, target key) in graph order.
    arrows: list[tuple[str, str]]
    # group index -> (title, colour).
    groups: dict[int, tuple[str, str]]
    title: str


def _picture(model: Any, graph: nx.DiGraph, report: Any, title: str | None) -> _Picture:
    """Boxes with user-facing names and shapes; masks become a label line."""
    group_of = {}
    for i, group in enumerate(report.groups):
        for key in (*group.layers, *group.absorbed_dropout):
            group_of[key] = i
    hidden = _mask_ops(graph) | {k for k, d in graph.nodes(data=True) if d["kind"] == "output"}
    masks = _received_masks(graph, hidden)
    boxes = {}
    for key, data in graph.nodes(data=True):
        if key in hidden:
            continue
        boxes[key] = _box(model, graph, report, key, data, group_of, masks.get(key, []))
    arrows = []
    for src, dst, role in graph.edges(data="role"):
        if role == "mask":
            continue
        for a, b in _bridged(graph, src, dst, hidden):
            if (a, b) not in arrows and a in boxes and b in boxes:
                arrows.append((a, b))
    groups = {
        i: (f"group {i}: {g.cell} x {g.num_layers}", _GROUP_COLOURS[i % len(_GROUP_COLOURS)])
        for i, g in enumerate(report.groups)
    }
    text = title or (
        f"rnnfuse: '{report.model_name}': {len(report.groups)} fused group(s), "
        f"{len(report.skipped)} recurrent layer(s) left alone"
    )
    return _Picture(boxes, arrows, groups, text)


def _bridged(graph, src, dst, hidden):
    """The arrow src -> dst, or arrows around a hidden node in between."""
    if dst in hidden:
        return []  # an output marker, or a mask op: nothing drawn after it
    if src in hidden:
        return [(p, dst) for p in graph.predecessors(src) if p not in hidden]
    return [(src, dst)]


def _mask_ops(graph: nx.DiGraph) -> set[str]:
    """The Keras ops (not layers) whose outputs end only in masks (a Masking
    layer's NotEqual -> Any, an Embedding's NotEqual, a user's mask)."""
    import keras

    found: set[str] = set()
    for key in reversed(list(nx.topological_sort(graph))):
        data = graph.nodes[key]
        layer = data.get("layer")
        if data["kind"] != "layer" or layer is None or isinstance(layer, keras.layers.Layer):
            continue
        edges = list(graph.out_edges(key, data="role"))
        if edges and all(role == "mask" or dst in found for _, dst, role in edges):
            found.add(key)
    return found


def _received_masks(graph: nx.DiGraph, hidden: set[str]) -> dict[str, list[str]]:
    """Layer key -> the layers whose mask its call received (its `mask=`
    argument, else its input's `_keras_mask`), traced back to the layer that
    made it, else to the inputs of the ops that computed it."""
    import keras

    creators: dict[int, str] = {}
    received: dict[str, list[str]] = {}
    for key in nx.topological_sort(graph):
        layer = graph.nodes[key].get("layer")
        node = _first_node(layer) if isinstance(layer, keras.layers.Layer) else None
        if node is None:
            continue
        if getattr(layer, "_call_has_mask_arg", False):
            for mask in _call_masks(node):
                origin = creators.get(id(mask)) or _computed_from(graph, mask, hidden)
                if origin and origin not in received.setdefault(key, []):
                    received[key].append(origin)
        for out in keras.tree.flatten(node.output_tensors):
            mask = getattr(out, "_keras_mask", None)
            if mask is not None:
                creators.setdefault(id(mask), _name(key))
    return {key: names for key, names in received.items() if names}


def _first_node(layer):
    nodes = getattr(layer, "_inbound_nodes", None) or []
    return nodes[0] if nodes else None


def _call_masks(node) -> list:
    """The mask tensors a layer call received (explicit or propagated)."""
    import keras

    arguments = getattr(node, "arguments", None)
    kwargs = getattr(arguments, "kwargs", None) or {}
    mask = kwargs.get("mask")
    if mask is None:
        args = getattr(arguments, "args", None) or node.input_tensors
        first = args[0] if args else None
        mask = [getattr(t, "_keras_mask", None) for t in keras.tree.flatten(first)]
    return [m for m in keras.tree.flatten(mask) if m is not None]


def _computed_from(graph: nx.DiGraph, mask, hidden: set[str]) -> str:
    """The shown nodes a mask was computed from, through hidden mask ops."""
    history = getattr(mask, "_keras_history", None)
    operation = getattr(history, "operation", None)
    keys = [k for k, d in graph.nodes(data=True) if d.get("layer") is operation] if operation else []
    names, todo, seen = [], list(keys), set(keys)
    while todo:
        key = todo.pop(0)
        if key not in hidden:
            names.append(_name(key))
            continue
        for src in graph.predecessors(key):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return ", ".join(names)


def _name(key: str) -> str:
    """A node's name as the user gave it."""
    match = re.fullmatch(r"(.*)<(input|output):(.*)>", key)
    if match is None:
        return key
    scope, _, name = match.groups()
    if re.fullmatch(r"(keras_tensor|input_layer)(_\d+)?", name):
        name = "input"
    return scope + name


def _box(model, graph, report, key, data, group_of, masks) -> _Box:
    layer = data.get("layer")
    if data["kind"] == "input":
        tensor = _input_tensor(model, graph, key, data["scope"])
        lines = [_name(key), "Input"]
        if tensor is not None:
            lines.append(f"{_shape(tensor.shape)} {tensor.dtype}")
        return _Box("input", tuple(lines), "white", _OTHER_EDGE, scope=data["scope"], dashed=True)
    lines = [key, _class_name(layer)]
    shapes = _shapes(layer)
    if shapes:
        lines.append(shapes)
    if masks:
        lines.append(f"mask from {', '.join(masks)}")
    if key in group_of:
        colour = _GROUP_COLOURS[group_of[key] % len(_GROUP_COLOURS)]
        return _Box("fused", tuple(lines), colour, colour, "white", group_of[key], data["scope"])
    if key in report.skipped:
        rule = getattr(report.skipped[key], "rule", "")
        lines.append(f"not fused: {rule}")
        return _Box("skipped", tuple(lines), _SKIPPED_FILL, _SKIPPED_EDGE, scope=data["scope"])
    if data["kind"] == "opaque":
        inner = sorted(
            {getattr(r, "rule", "") for k, r in report.skipped.items() if k.startswith(key + "/")}
        )
        lines[1] += " (subclassed)"
        if inner:
            lines.append(f"not fused: {', '.join(inner)}")
        edge = _SKIPPED_EDGE if inner else _OPAQUE
        return _Box("skipped" if inner else "opaque", tuple(lines), _OPAQUE, edge, "white", scope=data["scope"])
    return _Box("other", tuple(lines), _OTHER, _OTHER_EDGE, scope=data["scope"])


def _input_tensor(model, graph, key, scope):
    owner = graph.graph.get("scopes", {}).get(scope, model)
    name = key[len(scope):][len("<input:"):-1]
    for tensor in getattr(owner, "inputs", None) or []:
        if getattr(tensor, "name", None) == name:
            return tensor
    return None


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def _shapes(layer) -> str:
    """ "in -> out" shapes of the layer's first call, as plot_model shows them."""
    from keras import tree

    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return ""
    node = nodes[0]

    def text(tensors):
        shapes = [_shape(t.shape) for t in tree.flatten(tensors) if hasattr(t, "shape")]
        return shapes[0] if len(shapes) == 1 else "[" + ", ".join(shapes) + "]"

    # A mask or initial state passed by keyword is not the layer's input.
    args = getattr(getattr(node, "arguments", None), "args", None)
    inputs = args[0] if args and len(args) == 1 else (args or node.input_tensors)
    try:
        return f"{text(inputs)} -> {text(node.output_tensors)}"
    except (AttributeError, TypeError, ValueError):
        return ""


def _class_name(layer: Any) -> str:
    import keras

    name = type(layer).__name__
    if layer is not None and not isinstance(layer, keras.layers.Layer):
        # A Keras op in a functional graph: name it as the user called it.
        return "keras.ops." + re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
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


# -- entry point ---------------------------------------------------------------


def plot_layer_graph(
    model: Any,
    path: str | os.PathLike | None = None,
    *,
    report: Any = None,
    min_layers: int | None = None,
    title: str | None = None,
    dpi: int = 120,
    engine: str = "auto",
):
    """Draws `model`'s layer graph, fused groups highlighted; returns a
    matplotlib `Figure` or a `pydot.Dot`.

    Args:
        model: a built Sequential or Functional keras.Model.
        path: where to save the drawing (.png, .svg, .pdf, ...); None: only
            return it.
        report: `rnnfuse.analyze(model)`'s report, if already computed, else
            made with `min_layers`.
        title, dpi: the picture's title and a raster's resolution.
        engine: "graphviz", "matplotlib", or "auto" (graphviz where installed).

    Raises:
        ValueError: a subclassed `model` (no layer graph), or a bad `engine`.
        MissingPlotDependency: the renderer is not installed (names the fix).
    """
    import rnnfuse
    from rnnfuse.passes.graph import build_layer_graph, is_graph_model

    if engine not in ENGINES:
        raise ValueError(f"plot_layer_graph: engine must be one of {ENGINES}; received {engine!r}")
    if not is_graph_model(model):
        raise ValueError(
            f"model '{getattr(model, 'name', model)}' is a subclassed model "
            f"({type(model).__name__}); it has no layer graph to draw. Fix: "
            "build it as a Functional or Sequential model"
        )
    if engine == "auto":
        engine = "graphviz" if _has_graphviz() else "matplotlib"
    if report is None:
        report = rnnfuse.analyze(model, min_layers=min_layers)
    picture = _picture(model, build_layer_graph(model), report, title)
    if engine == "graphviz":
        return _draw_graphviz(picture, path, dpi)
    return _draw_matplotlib(picture, path, dpi)


def _has_graphviz() -> bool:
    try:
        import pydot  # noqa: F401
    except ImportError:
        return False
    return shutil.which("dot") is not None


# -- graphviz ------------------------------------------------------------------


def _require(name: str, needs: str):
    """Imports `name`, or raises MissingPlotDependency naming the fix."""
    try:
        return __import__(name)
    except ImportError as err:
        raise MissingPlotDependency(f"{needs} {name}, which is not installed. Fix: {_INSTALL}") from err


def _draw_graphviz(picture: _Picture, path, dpi: int):
    pydot = _require("pydot", "engine='graphviz' needs")
    dot = pydot.Dot(
        graph_type="digraph", rankdir="TB", nodesep="0.3", ranksep="0.35",
        fontname="Helvetica", label=_quote(picture.title), labelloc="t",
        fontsize="12", dpi=str(dpi), concentrate="false",
    )
    dot.set_node_defaults(shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10")
    dot.set_edge_defaults(color="#555555", arrowsize="0.7")
    parents: dict[str, Any] = {"": dot}

    def scope_graph(scope: str):
        # A nested model is a cluster of its own, inside its parent's.
        if scope not in parents:
            outer = scope.rstrip("/").rpartition("/")[0]
            outer = outer + "/" if outer else ""
            cluster = pydot.Cluster(
                f"scope_{len(parents)}", label=_quote(f"model {scope.rstrip('/')}"),
                style="dashed", color="#999999", fontname="Helvetica", fontsize="10",
            )
            scope_graph(outer).add_subgraph(cluster)
            parents[scope] = cluster
        return parents[scope]

    clusters = {}
    for key, box in picture.boxes.items():
        owner = scope_graph(box.scope)
        if box.group is not None:
            if box.group not in clusters:
                title, colour = picture.groups[box.group]
                clusters[box.group] = pydot.Cluster(
                    f"group_{box.group}", label=_quote(title), color=colour,
                    fontcolor=colour, style="rounded,filled", fillcolor=colour + "26",
                    fontname="Helvetica-Bold", fontsize="10", penwidth="1.5", labeljust="r", labelloc="b",
                )
                owner.add_subgraph(clusters[box.group])
            owner = clusters[box.group]
        style = "rounded,filled" + (",dashed" if box.dashed else "")
        owner.add_node(
            pydot.Node(
                _id(key), label=_quote(box.label), fillcolor=box.fill, color=box.edge,
                fontcolor=box.text, style=style,
                penwidth="1.8" if box.kind == "skipped" else "1",
            )
        )
    for src, dst in picture.arrows:
        dot.add_edge(pydot.Edge(_id(src), _id(dst)))
    if path is not None:
        fmt = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
        try:
            dot.write(os.fspath(path), format=fmt)
        except FileNotFoundError as err:
            raise MissingPlotDependency(
                "engine='graphviz' needs Graphviz's `dot` program, which is not "
                "on PATH. Fix: apt-get install graphviz (or brew install graphviz)"
            ) from err
    return dot


def _id(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# -- matplotlib ----------------------------------------------------------------

# Sizes in inches: a character of the 7 pt font, a text line, the gaps.
_CHAR_W, _LINE_H, _PAD = 0.056, 0.135, 0.08
_ROW_GAP, _COL_GAP, _MARGIN = 0.42, 0.25, 0.3


def _draw_matplotlib(picture: _Picture, path, dpi: int):
    _require("matplotlib", "drawing needs")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    layout = _layout(picture)
    fig = Figure(figsize=(layout.width, layout.height))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(0, layout.width)
    ax.set_ylim(0, layout.height)
    _draw_group_frames(ax, picture, layout, FancyBboxPatch)
    _draw_boxes(ax, picture, layout, FancyBboxPatch)
    for route in layout.routes:
        ax.add_patch(FancyArrowPatch(path=_polyline(route), arrowstyle="-|>", mutation_scale=7,
                                     color="#555555", linewidth=0.8, zorder=1))
    fig.text(_MARGIN / layout.width, 1 - 0.12 / layout.height, picture.title, fontsize=8,
             ha="left", va="top")
    # Under the title, so a long title never runs into it.
    fig.legend(handles=_legend(picture, Patch), loc="upper right", fontsize=6.5, frameon=False,
               bbox_to_anchor=(1 - 0.1 / layout.width, 1 - 0.32 / layout.height))
    if path is not None:
        fig.savefig(os.fspath(path), dpi=dpi)
    return fig


def _polyline(points):
    from matplotlib.path import Path

    return Path(points, [Path.MOVETO] + [Path.LINETO] * (len(points) - 1))


def _draw_group_frames(ax, picture: _Picture, layout: "_Layout", FancyBboxPatch) -> None:
    """A rounded rectangle per member of a group and a band between
    consecutive members in one column, so the frame holds its boxes only."""
    pad = 0.07
    for i, (title, colour) in picture.groups.items():
        members = sorted((k for k, b in picture.boxes.items() if b.group == i),
                         key=lambda k: -layout.centre[k][1])
        for j, key in enumerate(members):
            (x, y), (w, h) = layout.centre[key], layout.size[key]
            top = h / 2 + pad + (_LINE_H + 0.02 if j == 0 else 0)
            ax.add_patch(FancyBboxPatch(
                (x - w / 2 - pad, y - h / 2 - pad), w + 2 * pad, h / 2 + pad + top,
                boxstyle="round,pad=0,rounding_size=0.06", facecolor=colour, alpha=0.16,
                edgecolor="none", zorder=0))
            if j == 0:
                ax.text(x - w / 2 - pad + 0.04, y + top - 0.03, title, ha="left", va="top",
                        fontsize=6.5, color=colour, fontweight="bold", zorder=1)
            if j + 1 < len(members):
                (x2, y2), (w2, h2) = layout.centre[members[j + 1]], layout.size[members[j + 1]]
                if abs(x2 - x) < 1e-6:
                    band, low = min(w, w2) * 0.5, y2 + h2 / 2 + pad
                    ax.add_patch(FancyBboxPatch(
                        (x - band / 2, low), band, (y - h / 2 - pad) - low, boxstyle="square,pad=0",
                        facecolor=colour, alpha=0.16, edgecolor="none", zorder=0))


def _draw_boxes(ax, picture: _Picture, layout: "_Layout", FancyBboxPatch) -> None:
    for key, box in picture.boxes.items():
        (x, y), (w, h) = layout.centre[key], layout.size[key]
        ax.add_patch(FancyBboxPatch(
            (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.05",
            facecolor=box.fill, edgecolor=box.edge, linestyle="dashed" if box.dashed else "solid",
            linewidth=1.8 if box.kind == "skipped" else (1.3 if box.kind == "fused" else 0.9),
            zorder=2))
        for n, line in enumerate(box.lines):
            ax.text(x, y + h / 2 - _PAD - (n + 0.5) * _LINE_H, line, ha="center", va="center",
                    fontsize=7, color=box.text, zorder=3, fontweight="bold" if n == 0 else "normal")


def _legend(picture: _Picture, Patch) -> list:
    legend = [Patch(facecolor=c, label=f"fused {t.split(':')[0]}") for t, c in picture.groups.values()]
    if any(b.kind == "skipped" for b in picture.boxes.values()):
        legend.append(Patch(facecolor=_SKIPPED_FILL, edgecolor=_SKIPPED_EDGE, label="recurrent, not fused"))
    legend.append(Patch(facecolor=_OTHER, edgecolor=_OTHER_EDGE, label="other layer"))
    return legend


@dataclasses.dataclass
class _Layout:
    centre: dict[str, tuple[float, float]]
    size: dict[str, tuple[float, float]]
    # One polyline per arrow (inches), source box edge to target box edge.
    routes: list[list[tuple[float, float]]]
    width: float
    height: float


def _layout(picture: _Picture) -> _Layout:
    """networkx's layered layout (`multipartite_layout`), one row per
    topological generation, scaled so the widest neighbours fit. An arrow
    that skips rows passes a waypoint of its own in each row it crosses, and
    runs diagonally only in the gaps between rows, so it crosses no box."""
    size = {k: (max(map(len, b.lines)) * _CHAR_W + 2 * _PAD + 0.1, len(b.lines) * _LINE_H + 2 * _PAD)
            for k, b in picture.boxes.items()}
    graph, chains = _layered_graph(picture, size)
    rows: dict[int, list[str]] = {}
    for key in graph:
        rows.setdefault(graph.nodes[key]["row"], []).append(key)
    unit = nx.multipartite_layout(graph, subset_key=rows, align="horizontal")
    # multipartite_layout spaces a row's nodes one step apart: fit the widest pair.
    step = max((abs(unit[a][0] - unit[b][0]) for r in rows.values() for a, b in zip(r, r[1:])),
               default=1.0)
    need = max((size[a][0] / 2 + size[b][0] / 2 + _COL_GAP for r in rows.values()
                for a, b in zip(r, r[1:])), default=1.0)
    x = {k: unit[k][0] * need / step for k in graph}
    low = min(x[k] - size[k][0] / 2 for k in x)
    content = max(x[k] + size[k][0] / 2 for k in x) - low + 2 * _MARGIN
    width = max(content, 5.0, len(picture.title) * 0.075 + 2 * _MARGIN)
    x = {k: v - low + _MARGIN + (width - content) / 2 for k, v in x.items()}
    y, height, band = _y_positions(picture, [rows[r] for r in sorted(rows)], size)
    routes = []
    for chain in chains:
        start = chain[0]
        points = [(x[start], y[start] - size[start][1] / 2), (x[start], band[graph.nodes[start]["row"]][1])]
        for key in chain[1:-1]:
            top, bottom = band[graph.nodes[key]["row"]]
            points += [(x[key], top), (x[key], bottom)]
        end = chain[-1]
        points += [(x[end], band[graph.nodes[end]["row"]][0]), (x[end], y[end] + size[end][1] / 2)]
        # A stub of no length (a box as tall as its row) would leave the
        # arrow head no direction.
        routes.append([p for i, p in enumerate(points) if i == 0 or p != points[i - 1]])
    return _Layout({k: (x[k], y[k]) for k in picture.boxes}, size, routes, width, height)


def _layered_graph(picture: _Picture, size: dict) -> tuple[nx.DiGraph, list[list[str]]]:
    """(the boxes and "~" waypoints as nodes with a "row", in depth-first
    order from the inputs, so a tower keeps its column; each arrow's chain)."""
    boxes = nx.DiGraph()
    boxes.add_nodes_from(picture.boxes)
    boxes.add_edges_from(picture.arrows)
    row = {k: r for r, g in enumerate(nx.topological_generations(boxes)) for k in g}
    chains = []
    for src, dst in picture.arrows:
        chain = [src, *(f"~{src}~{dst}~{r}" for r in range(row[src] + 1, row[dst])), dst]
        for r, way in enumerate(chain[1:-1], start=row[src] + 1):
            row[way], size[way] = r, (0.12, 0.0)
        chains.append(chain)
    layered = nx.DiGraph()
    layered.add_nodes_from(sorted(row, key=row.get))  # the search starts from the inputs
    for chain in chains:
        nx.add_path(layered, chain)
    order = nx.DiGraph()
    order.add_nodes_from(nx.dfs_preorder_nodes(layered))
    order.add_edges_from(layered.edges)
    nx.set_node_attributes(order, row, "row")
    return order, chains


def _y_positions(picture, rows, size) -> tuple[dict[str, float], float, list[tuple[float, float]]]:
    """Row heights and y (top row highest; a band at the top for the title
    and legend): box centres' y, the picture's height, each row's (top, bottom)."""
    heights = [max([size[k][1] for k in r_nodes] + [0.3]) for r_nodes in rows]
    y: dict[str, float] = {}
    entries = len(picture.groups) + 1 + any(b.kind == "skipped" for b in picture.boxes.values())
    top = 0.45 + 0.14 * entries
    total = top + sum(heights) + _ROW_GAP * max(len(rows) - 1, 0) + _MARGIN
    cursor = total - top
    band = []
    for r_nodes, h in zip(rows, heights):
        for k in r_nodes:
            y[k] = cursor - h / 2
        band.append((cursor, cursor - h))
        cursor -= h + _ROW_GAP
    return y, total, band
