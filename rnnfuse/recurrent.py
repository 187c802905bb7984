"""A uniform view of the Keras recurrent layers rnnfuse can fuse.

`describe(layer)` gives a `RecurrentView`: the cuDNN cell kind and a grid
of cells `levels[i][d]` (level bottom to top, direction); everything
downstream reads the view, never the layer class. It is structural (the
rules say why a layer cannot fuse) and never raises.

| Keras layer                                  | kind                  |
|----------------------------------------------|-----------------------|
| `LSTM`, `RNN(LSTMCell)`                      | "lstm"                |
| `GRU(reset_after=True)`, `RNN(GRUCell)`      | "gru"                 |
| `SimpleRNN` / `RNN(SimpleRNNCell)`, tanh     | "rnn_tanh"            |
| `SimpleRNN` / `RNN(SimpleRNNCell)`, relu     | "rnn_relu"            |
| `RNN(StackedRNNCells([...]))` of one kind    | that kind, k levels   |
| `Bidirectional(<any of the above>)`          | that kind, 2 dirs     |
| `rnnfuse.layers.ProjectedLSTM`               | "lstm", proj_size > 0 |

>>> import keras
>>> layer = keras.layers.LSTM(8, return_sequences=True)
>>> _ = layer(keras.ops.zeros((1, 5, 3)))
>>> view = describe(layer)
>>> (view.kind, view.units, view.input_size, view.num_levels)
('lstm', 8, 3, 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import keras

from rnnfuse.reasons import Reason

__all__ = [
    "CELL_KINDS",
    "PACKED_MERGES",
    "STACKABLE_MERGES",
    "RecurrentView",
    "called_with_mask",
    "describe",
    "input_merges",
    "is_recurrent",
    "keras_has_cudnn_path",
]

CELL_KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")

# Merges a Bidirectional below the top of a run may have: cuDNN feeds the
# next level [fwd, bwd]; "sum" and "ave" are linear in it, so the next input
# kernel is packed doubled (PACKED_MERGES); "mul" and None end the run.
PACKED_MERGES = ("sum", "ave")
STACKABLE_MERGES = ("concat", *PACKED_MERGES)

_LAYER_OF_CELL = {
    keras.layers.LSTMCell: keras.layers.LSTM,
    keras.layers.GRUCell: keras.layers.GRU,
    keras.layers.SimpleRNNCell: keras.layers.SimpleRNN,
}


@dataclasses.dataclass(frozen=True)
class RecurrentView:
    """One Keras recurrent layer seen as a (part of a) cuDNN stack."""

    # The original Keras layer (LSTM, RNN, Bidirectional, ProjectedLSTM...).
    layer: Any
    # cuDNN cell mode: "lstm", "gru", "rnn_tanh" or "rnn_relu".
    kind: str
    # Width of every cell's state (cell width for a projected LSTM).
    units: int
    # Features of the layer's input sequence (None until the layer is built).
    input_size: int | None
    # levels[i][d]: the Keras cell of level i, direction d (0 fwd, 1 bwd).
    levels: tuple[tuple[Any, ...], ...]
    # Whether the layer reads its input in reverse (first level only).
    go_backwards: bool
    return_sequences: bool
    return_state: bool
    # Bidirectional merge mode ("concat", "sum", "mul", "ave", None).
    merge_mode: str | None
    # Input dropout of the first level (one mask per sequence, as Keras).
    dropout: float
    # Recurrent projection width (0: no projection).
    proj_size: int = 0
    # zero_output_for_mask of the generic Keras loop for this layer.
    zero_output_for_mask: bool = False

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def num_directions(self) -> int:
        return len(self.levels[0])

    @property
    def bidirectional(self) -> bool:
        return self.num_directions == 2

    @property
    def output_size(self) -> int:
        """Width of one direction's output (proj_size when projected)."""
        return self.proj_size or self.units


def is_recurrent(layer: Any) -> bool:
    """Whether `layer` is a recurrent layer rnnfuse reports on."""
    if isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional)):
        return True
    return bool(getattr(layer, "_rnnfuse_recurrent", False))


def _activation_name(fn: Any, extra: Mapping[str, Any] | None = None) -> str | None:
    """'tanh', 'sigmoid' or 'relu' when `fn` is exactly that function;
    `extra` adds the framework's own (this module imports no framework)."""
    known = {
        "tanh": [keras.activations.tanh, keras.ops.tanh],
        "sigmoid": [keras.activations.sigmoid, keras.ops.sigmoid],
        "relu": [keras.activations.relu, keras.ops.relu],
    }
    for name, fns in (extra or {}).items():
        known[name] = known.get(name, []) + list(fns)
    for name, fns in known.items():
        if any(fn is f for f in fns):
            return name
    return None


def cell_kind(cell: Any, activations: Mapping[str, Any] | None = None) -> str | None:
    """The cuDNN mode of one Keras cell, or None (structural only; the rules
    check the cell's arguments)."""
    declared = getattr(cell, "_rnnfuse_cell_kind", None)
    if declared:
        return declared
    if type(cell) is keras.layers.LSTMCell:
        return "lstm"
    if type(cell) is keras.layers.GRUCell:
        return "gru"
    if type(cell) is keras.layers.SimpleRNNCell:
        act = _activation_name(getattr(cell, "activation", None), activations)
        return "rnn_" + act if act in ("tanh", "relu") else None
    return None


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", repr(fn))


def _rnn_levels(layer: Any) -> tuple[tuple[Any, ...], ...] | Reason:
    """The levels of one unidirectional recurrent layer."""
    if isinstance(layer.cell, keras.layers.StackedRNNCells):
        cells = tuple(layer.cell.cells)
    else:
        cells = (layer.cell,)
    return tuple((c,) for c in cells)


def _input_size(layer: Any) -> int | None:
    try:
        shape = layer.input.shape if not isinstance(layer.input, list) else None
    except (AttributeError, ValueError):
        shape = None
    if shape is None:
        cell = layer.cell if hasattr(layer, "cell") else None
        if isinstance(cell, keras.layers.StackedRNNCells):
            cell = cell.cells[0]
        kernel = getattr(cell, "kernel", None)
        return int(kernel.shape[0]) if kernel is not None else None
    return int(shape[-1]) if shape[-1] is not None else None


def describe(
    layer: Any, require_built: bool = True, activations: Mapping[str, Any] | None = None
) -> RecurrentView | Reason:
    """A `RecurrentView` of `layer`, or the `Reason` it has no cuDNN cell mode.

    Args:
        layer: a Keras layer (check `rnnfuse.rules.layer_reason` first).
        require_built: kept for callers; the `not_built` rule checks it.
        activations: the framework's own tanh/sigmoid/relu, besides Keras'.
    """
    if isinstance(layer, keras.layers.Bidirectional):
        return _describe_bidirectional(layer, require_built, activations)
    if not is_recurrent(layer):
        return Reason("not_recurrent", f"{type(layer).__name__} is not recurrent")
    if not hasattr(layer, "cell"):
        return Reason("not_described", f"{type(layer).__name__} '{layer.name}' has no cell to describe")
    levels = _rnn_levels(layer)
    kind = cell_kind(levels[0][0], activations)
    if kind is None:
        return Reason(
            "not_described",
            f"'{layer.name}' has no cuDNN cell mode; rnnfuse.rules.layer_reason says why",
        )
    first = levels[0][0]
    return RecurrentView(
        layer=layer,
        kind=kind,
        units=int(first.units),
        input_size=_input_size(layer),
        levels=levels,
        go_backwards=bool(layer.go_backwards),
        return_sequences=bool(layer.return_sequences),
        return_state=bool(layer.return_state),
        merge_mode=None,
        dropout=float(getattr(first, "dropout", 0.0) or 0.0),
        proj_size=int(getattr(first, "proj_size", 0) or 0),
        zero_output_for_mask=bool(getattr(layer, "zero_output_for_mask", False)),
    )


def _describe_bidirectional(layer: Any, require_built: bool, activations=None) -> RecurrentView | Reason:
    fwd, bwd = layer.forward_layer, layer.backward_layer
    fview = describe(fwd, require_built, activations)
    bview = describe(bwd, require_built, activations)
    for view in (fview, bview):
        if isinstance(view, Reason):
            return view
    return RecurrentView(
        layer=layer,
        kind=fview.kind,
        units=fview.units,
        input_size=_input_size(fwd) or _input_size(layer),
        levels=((fview.levels[0][0], bview.levels[0][0]),),
        go_backwards=False,
        return_sequences=bool(layer.return_sequences),
        return_state=bool(layer.return_state),
        merge_mode=layer.merge_mode,
        dropout=0.0,
        proj_size=fview.proj_size,
        # Bidirectional forces zero_output_for_mask = return_sequences.
        zero_output_for_mask=bool(layer.return_sequences),
    )


def input_merges(views) -> tuple[str | None, ...]:
    """Per level of the stack `views` make: "sum" or "ave" where the level
    reads a Bidirectional below it merged that way, else None.

    >>> import keras
    >>> a = keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True), merge_mode="sum")
    >>> b = keras.layers.Bidirectional(keras.layers.GRU(4))
    >>> _ = b(a(keras.ops.zeros((1, 3, 2))))
    >>> input_merges([describe(a), describe(b)])
    (None, 'sum')
    """
    merges: list[str | None] = []
    below = None
    for view in views:
        for level in range(view.num_levels):
            merge = None
            if level == 0 and below is not None and below.bidirectional:
                if below.merge_mode in PACKED_MERGES:
                    merge = below.merge_mode
            merges.append(merge)
        below = view
    return tuple(merges)


def keras_has_cudnn_path(view: RecurrentView) -> bool:
    """Whether Keras has a cuDNN path for this layer (LSTM or GRU with a
    bias); everything else runs Keras' generic loop on every device."""
    layers = (
        (view.layer.forward_layer, view.layer.backward_layer)
        if isinstance(view.layer, keras.layers.Bidirectional)
        else (view.layer,)
    )
    return all(
        type(layer) in (keras.layers.LSTM, keras.layers.GRU) and layer.cell.use_bias
        for layer in layers
    )


def called_with_mask(layer: Any) -> bool:
    """Whether `layer` is called with a padding mask in its model (a `mask=`
    argument, or an input carrying Keras' mask).

    >>> inp = keras.Input((5,), dtype="int32")
    >>> gru = keras.layers.GRU(4)
    >>> _ = gru(keras.layers.Embedding(9, 3, mask_zero=True)(inp))
    >>> called_with_mask(gru)
    True
    """
    for node in getattr(layer, "_inbound_nodes", ()):
        arguments = getattr(node, "arguments", None)
        if arguments is not None and arguments.kwargs.get("mask") is not None:
            return True
        for tensor in keras.tree.flatten(getattr(node, "input_tensors", ())):
            if getattr(tensor, "_keras_mask", None) is not None:
                return True
    return False
