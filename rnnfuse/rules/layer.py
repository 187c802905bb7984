"""Layer rules: can this recurrent layer be part of a fused call at all?

`layer_reason(layer)` runs, for each direction, the "part", "cell" and
"stack" rules, then the "bidirectional" and "node" rules; the first
failing rule's `Reason` is the answer.

>>> import keras
>>> layer = keras.layers.GRU(4, recurrent_dropout=0.2)
>>> _ = layer(keras.ops.zeros((1, 3, 2)))
>>> layer_reason(layer).rule
'recurrent_dropout'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import keras
import networkx as nx

from rnnfuse.reasons import Reason
from rnnfuse.recurrent import _activation_name, _fn_name, cell_kind, describe, is_recurrent
from rnnfuse.rules.registry import first_reason, rule

__all__ = ["LayerContext", "layer_reason", "recurrent_sublayers"]

_PLAIN = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN)
_CELLS = (keras.layers.LSTMCell, keras.layers.GRUCell, keras.layers.SimpleRNNCell)


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What layer checks may read besides the layer."""

    # Whether an unbuilt layer fails (`not_built`).
    require_built: bool = True
    # The active framework's own tanh/sigmoid/relu (name -> functions).
    activations: Mapping[str, Any] | None = None


def layer_reason(
    layer: Any,
    *,
    require_built: bool = True,
    activations: Mapping[str, Any] | None = None,
    graph: nx.DiGraph | None = None,
    key: str | None = None,
) -> Reason | None:
    """The first layer rule `layer` fails, or None (see module doc)."""
    ctx = LayerContext(require_built, activations)
    if isinstance(layer, keras.layers.Bidirectional):
        for part in (layer.forward_layer, layer.backward_layer):
            reason = _part_reason(part, ctx)
            if reason is not None:
                which = "forward" if part is layer.forward_layer else "backward"
                return Reason(reason.rule, f"its {which} layer '{part.name}': {reason}")
        fview = describe(layer.forward_layer, ctx.require_built, ctx.activations)
        bview = describe(layer.backward_layer, ctx.require_built, ctx.activations)
        reason = first_reason("layer", "bidirectional", layer, fview, bview)
        if reason is not None:
            return reason
    else:
        reason = _part_reason(layer, ctx)
        if reason is not None:
            return reason
    return first_reason("layer", "node", graph, key) if graph is not None else None


def _part_reason(part: Any, ctx: LayerContext) -> Reason | None:
    levels = _levels(part)
    cells = (first_reason("layer", "cell", cell, ctx) for cell in levels)
    return (first_reason("layer", "part", part, ctx) or next((r for r in cells if r is not None), None)
            or first_reason("layer", "stack", part, levels, ctx))


def _levels(part: Any) -> list:
    cell = getattr(part, "cell", None)
    if isinstance(cell, keras.layers.StackedRNNCells):
        return list(cell.cells)
    return [cell]


# -- part rules (one direction of a layer) ------------------------------------


@rule("layer_type", "layer", "a subclass of a Keras RNN layer, or another recurrent layer, whose call() rnnfuse cannot see into", "part")
def _layer_type(part, ctx):
    cls = type(part)
    if cls in _PLAIN or cls is keras.layers.RNN or getattr(part, "_rnnfuse_recurrent", False):
        return None
    base = next((b.__name__ for b in _PLAIN if isinstance(part, b)), None)
    what = f"a subclass of {base}" if base else "a recurrent layer"
    return (f"{cls.__name__} is {what} whose call() rnnfuse cannot see into; only LSTM, GRU, "
            "SimpleRNN, RNN(cell), Bidirectional and ProjectedLSTM are fused")


@rule("unroll", "layer", "unroll=True unrolls the loop into separate ops", "part")
def _unroll(part, ctx):
    if getattr(part, "unroll", False):
        return "unroll=True unrolls the loop into separate ops; set unroll=False to fuse"
    return None


@rule("stateful", "layer", "stateful=True keeps state between batches in the layer's own variables", "part")
def _stateful(part, ctx):
    if getattr(part, "stateful", False):
        return ("stateful=True keeps state between batches in the layer's own variables; stateful "
                "layers are not fused")
    return None


@rule("use_cudnn", "layer", "use_cudnn=False: the layer was told not to use cuDNN", "part")
def _use_cudnn(part, ctx):
    if getattr(part, "use_cudnn", "auto") is False:
        return "use_cudnn=False: the layer was told not to use cuDNN"
    return None


@rule("not_built", "layer", "the layer is not built (start the model with keras.Input)", "part")
def _not_built(part, ctx):
    if ctx.require_built and not part.built:
        return "the layer is not built"
    return None


# -- cell rules -------------------------------------------------------------------


@rule("recurrent_dropout", "layer", "recurrent_dropout draws a new mask inside the time loop, which cuDNN cannot do", "cell")
def _recurrent_dropout(cell, ctx):
    if getattr(cell, "recurrent_dropout", 0):
        return (f"recurrent_dropout={cell.recurrent_dropout} draws a new mask inside the time loop, "
                "which cuDNN cannot do; set it to 0 to fuse")
    return None


@rule("dropout_implementation", "layer", "dropout with implementation=1 draws one input mask per gate; cuDNN applies one", "cell")
def _dropout_implementation(cell, ctx):
    if getattr(cell, "dropout", 0) and getattr(cell, "implementation", 2) == 1:
        return (f"dropout={cell.dropout} with implementation=1 applies a different mask row to each "
                "gate in Keras' loop; cuDNN applies one input mask (use the default implementation=2 "
                "to fuse)")
    return None


@rule("cell_type", "layer", "a cell with no cuDNN equivalent (a custom cell in keras.layers.RNN)", "cell")
def _cell_type(cell, ctx):
    if getattr(cell, "_rnnfuse_cell_kind", None) or type(cell) in _CELLS:
        return None
    return (f"cell {type(cell).__name__} has no cuDNN equivalent (supported: LSTMCell, GRUCell, "
            "SimpleRNNCell and rnnfuse.layers.ProjectedLSTM)")


@rule("cell_activity_regularizer", "layer", "a cell with an activity_regularizer (Keras applies it at every time step of its loop)", "cell")
def _cell_activity_regularizer(cell, ctx):
    if getattr(cell, "activity_regularizer", None) is not None:
        return (f"its cell '{cell.name}' has an activity_regularizer, which Keras applies to the "
                "cell's output at every time step; the fused call runs no per-step cell call")
    return None


@rule("activation", "layer", "activations cuDNN does not compute (LSTM/GRU: tanh and sigmoid; SimpleRNN: tanh or relu)", "cell")
def _activation(cell, ctx):
    act = _activation_name(getattr(cell, "activation", None), ctx.activations)
    name = type(cell).__name__
    if type(cell) is keras.layers.SimpleRNNCell:
        if act in ("tanh", "relu"):
            return None
        return (f"SimpleRNN uses activation={_fn_name(cell.activation)}; cuDNN computes only tanh and "
                "relu")

    rec = _activation_name(getattr(cell, "recurrent_activation", None), ctx.activations)
    if act == "tanh" and rec == "sigmoid":
        return None
    return (f"{name} uses activation={_fn_name(cell.activation)} and "
            f"recurrent_activation={_fn_name(cell.recurrent_activation)}; cuDNN computes only tanh and"
            " sigmoid")


@rule("reset_after", "layer", "GRU with reset_after=False, which cuDNN does not compute", "cell")
def _reset_after(cell, ctx):
    if type(cell) is keras.layers.GRUCell and not cell.reset_after:
        return ("GRU with reset_after=False applies the reset gate before the recurrent matrix; cuDNN"
                " only computes reset_after=True")
    return None


# -- stack rules (the levels of one RNN(StackedRNNCells)) ---------------------------


@rule("dropout", "layer", "input dropout on a level of a StackedRNNCells above the first", "stack")
def _stacked_dropout(part, levels, ctx):
    for i, cell in enumerate(levels[1:], start=1):
        if getattr(cell, "dropout", 0):
            return (f"cell {i} of its StackedRNNCells has dropout={cell.dropout}; input dropout can "
                    "only be applied before the first level of a fused call")
    return None


@rule("mixed_cells", "layer", "a StackedRNNCells mixing cell kinds", "stack")
def _mixed_cells(part, levels, ctx):
    kinds = {cell_kind(c, ctx.activations) for c in levels}
    if len(kinds) > 1:
        return "its cells are of different kinds (" + ", ".join(sorted(kinds)) + ")"
    return None


@rule("mixed_units", "layer", "a StackedRNNCells whose cells have different widths", "stack")
def _mixed_units(part, levels, ctx):
    units = {(int(c.units), int(getattr(c, "proj_size", 0))) for c in levels}
    if len(units) > 1:
        return "its cells have different widths " + ", ".join(str(u) for u, _ in sorted(units))
    return None


# -- Bidirectional rules --------------------------------------------------------------


@rule("stacked_cells_in_bidirectional", "layer", "Bidirectional(RNN(StackedRNNCells)) runs each direction through all levels first; cuDNN interleaves them", "bidirectional")
def _stacked_cells_in_bidirectional(layer, fview, bview):
    if fview.num_levels != 1 or bview.num_levels != 1:
        return ("Bidirectional(RNN(StackedRNNCells)) runs each direction through all levels before "
                "the other direction; cuDNN interleaves them")
    return None


@rule("bidirectional_directions", "layer", "a Bidirectional whose forward layer reads backwards or backward layer forwards", "bidirectional")
def _bidirectional_directions(layer, fview, bview):
    if fview.go_backwards or not bview.go_backwards:
        return "its forward layer must read forwards and its backward layer backwards"
    return None


@rule("bidirectional_mismatch", "layer", "a Bidirectional whose two layers differ in kind or width", "bidirectional")
def _bidirectional_mismatch(layer, fview, bview):
    if (fview.kind, fview.units, fview.proj_size) != (bview.kind, bview.units, bview.proj_size):
        return f"its forward layer ({_width(fview)}) and backward layer ({_width(bview)}) differ"
    return None


@rule("bidirectional_dropout", "layer", "input dropout inside a Bidirectional (one mask per direction; the fused call has one input)", "bidirectional")
def _bidirectional_dropout(layer, fview, bview):
    if fview.dropout or bview.dropout:
        return ("dropout inside a Bidirectional layer draws one input mask per direction; a fused "
                "bidirectional call has one input")
    return None


@rule("bidirectional_activity_regularizer", "layer", "an activity_regularizer on the forward or backward layer inside a Bidirectional (each direction's own output never leaves the fused call)", "bidirectional")
def _bidirectional_activity_regularizer(layer, fview, bview):
    for part in (layer.forward_layer, layer.backward_layer):
        if part.activity_regularizer is not None:
            return (f"its layer '{part.name}' has an activity_regularizer, which Keras applies to that"
                    " direction's own output; a fused bidirectional call returns the two directions "
                    "together (an activity_regularizer on the Bidirectional itself is fine)")
    return None


def _width(view) -> str:
    proj = f", proj_size {view.proj_size}" if view.proj_size else ""
    return f"{view.kind}, {view.units} units{proj}"


# -- node rules (the layer in the model graph) ------------------------------------------


@rule("shared_layer", "layer", "a layer called more than once in the model", "node")
def _shared_layer(graph, key):
    calls = graph.nodes[key]["calls"]
    if calls > 1:
        return (f"the layer is called {calls} times in the model (a shared layer); only layers called "
                "once are fused")
    return None


@rule("subclassed_model", "layer", "a recurrent layer inside a subclassed model, whose call() rnnfuse cannot see into", "container")
def subclassed_model(container_key: str) -> Reason:
    return Reason(
        "subclassed_model",
        f"it is inside the subclassed model '{container_key}', whose call() "
        "rnnfuse cannot see into; build that part as a Functional or "
        "Sequential model to fuse it",
    )


@rule("wrapped_layer", "layer", "a recurrent layer inside a wrapper (TimeDistributed) or a custom layer, which rnnfuse cannot rewrite", "container")
def wrapped_layer(container_key: str, container: Any) -> Reason:
    what = (
        f"the {type(container).__name__} wrapper '{container_key}'"
        if isinstance(container, keras.layers.Wrapper)
        else f"the custom layer '{container_key}' ({type(container).__name__})"
    )
    return Reason(
        "wrapped_layer",
        f"it runs inside {what}, whose call() rnnfuse does not rewrite; only "
        "recurrent layers called directly in a Functional or Sequential model "
        "are fused",
    )


def recurrent_sublayers(layer: Any) -> list:
    """The recurrent layers held by a non-recurrent `layer` (a wrapper, a
    custom layer, a subclassed model), not counting those inside recurrent
    ones (a Bidirectional's own two layers)."""
    if not isinstance(layer, keras.layers.Layer):
        return []  # a Keras op in a Functional graph (NotEqual, ...)
    found, inner = [], set()
    for sub in layer._flatten_layers(include_self=False):
        if id(sub) in inner:
            continue
        if is_recurrent(sub):
            found.append(sub)
            inner.update(id(s) for s in sub._flatten_layers(include_self=False))
    return found
