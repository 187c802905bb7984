"""A uniform view of the Keras recurrent layers rnnfuse can fuse.

Keras spells one recurrent computation in several ways: `LSTM(...)`,
`RNN(LSTMCell(...))`, `RNN(StackedRNNCells([...]))` (several levels inside one
layer) and `Bidirectional(LSTM(...))` (two directions). `describe(layer)`
turns each of them into a `RecurrentView`: the cuDNN cell kind and a grid of
cells, `levels[i][d]`, level `i` (bottom to top) and direction `d`
(0 forward, 1 backward). Everything downstream (rules, packing, backends)
reads the view, never the layer class.

Supported:

| Keras layer                                  | kind                  |
|----------------------------------------------|-----------------------|
| `LSTM`, `RNN(LSTMCell)`                      | "lstm"                |
| `GRU(reset_after=True)`, `RNN(GRUCell)`      | "gru"                 |
| `SimpleRNN` / `RNN(SimpleRNNCell)`, tanh     | "rnn_tanh"            |
| `SimpleRNN` / `RNN(SimpleRNNCell)`, relu     | "rnn_relu"            |
| `RNN(StackedRNNCells([...]))` of one kind    | that kind, k levels   |
| `Bidirectional(<any of the above>)`          | that kind, 2 dirs     |
| `rnnfuse.layers.ProjectedLSTM`               | "lstm", proj_size > 0 |

`describe` returns a `Reason` (a string) instead of a view when the layer
cannot be expressed as a cuDNN stack; it never raises.

Example:

    >>> import keras
    >>> layer = keras.layers.LSTM(8, return_sequences=True)
    >>> _ = layer(keras.ops.zeros((1, 5, 3)))
    >>> view = describe(layer)
    >>> (view.kind, view.units, view.input_size, view.num_levels)
    ('lstm', 8, 3, 1)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import keras

from rnnfuse.reasons import Reason

__all__ = [
    "CELL_KINDS",
    "RecurrentView",
    "describe",
    "is_recurrent",
    "keras_has_cudnn_path",
    "keras_runs_cudnn",
]

CELL_KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")

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


def _activation_name(fn: Any) -> str | None:
    """'tanh', 'sigmoid' or 'relu' when `fn` is exactly that function."""
    known = {
        "tanh": [keras.activations.tanh, keras.ops.tanh],
        "sigmoid": [keras.activations.sigmoid, keras.ops.sigmoid],
        "relu": [keras.activations.relu, keras.ops.relu],
    }
    # A framework's own function can only be `fn` if that framework is
    # loaded: look in sys.modules instead of importing it (the torch backend
    # runs without TensorFlow).
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        known["tanh"] += [tf.tanh, tf.math.tanh]
        known["sigmoid"] += [tf.sigmoid, tf.math.sigmoid]
        known["relu"] += [tf.nn.relu]
    torch = sys.modules.get("torch")
    if torch is not None:
        known["tanh"] += [torch.tanh]
        known["sigmoid"] += [torch.sigmoid]
        known["relu"] += [torch.relu]
    for name, fns in known.items():
        if any(fn is f for f in fns):
            return name
    return None


def cell_kind(cell: Any) -> str | Reason:
    """The cuDNN mode of one Keras cell, or the reason it has none."""
    name = type(cell).__name__
    if getattr(cell, "recurrent_dropout", 0):
        return Reason(
            "recurrent_dropout",
            f"recurrent_dropout={cell.recurrent_dropout} draws a new mask "
            "inside the time loop, which cuDNN cannot do; set it to 0 to fuse",
        )
    if getattr(cell, "dropout", 0) and getattr(cell, "implementation", 2) == 1:
        return Reason(
            "dropout_implementation",
            f"dropout={cell.dropout} with implementation=1 applies a different "
            "mask row to each gate in Keras' loop; cuDNN applies one input "
            "mask (use the default implementation=2 to fuse)",
        )
    act = _activation_name(getattr(cell, "activation", None))
    rec = _activation_name(getattr(cell, "recurrent_activation", None))
    declared = getattr(cell, "_rnnfuse_cell_kind", None)
    if declared in ("lstm", "gru") and (act != "tanh" or rec != "sigmoid"):
        # A cell that declares its kind (ProjectedLSTMCell) still needs
        # cuDNN's activations.
        return Reason(
            "activation",
            f"{name} uses activation={_fn_name(cell.activation)} and "
            f"recurrent_activation={_fn_name(cell.recurrent_activation)}; "
            "cuDNN computes only tanh and sigmoid",
        )
    if declared:
        return declared
    if type(cell) in (keras.layers.LSTMCell, keras.layers.GRUCell):
        if act != "tanh" or rec != "sigmoid":
            return Reason(
                "activation",
                f"{name} uses activation={_fn_name(cell.activation)} and "
                f"recurrent_activation={_fn_name(cell.recurrent_activation)}; "
                "cuDNN computes only tanh and sigmoid",
            )
        if type(cell) is keras.layers.GRUCell and not cell.reset_after:
            return Reason(
                "reset_after",
                "GRU with reset_after=False applies the reset gate before "
                "the recurrent matrix; cuDNN only computes reset_after=True",
            )
        return "lstm" if type(cell) is keras.layers.LSTMCell else "gru"
    if type(cell) is keras.layers.SimpleRNNCell:
        if act in ("tanh", "relu"):
            return "rnn_" + act
        return Reason(
            "activation",
            f"SimpleRNN uses activation={_fn_name(cell.activation)}; cuDNN "
            "computes only tanh and relu",
        )
    return Reason(
        "cell_type",
        f"cell {name} has no cuDNN equivalent (supported: LSTMCell, GRUCell, "
        "SimpleRNNCell and rnnfuse.layers.ProjectedLSTM)",
    )


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", repr(fn))


def _rnn_levels(layer: Any) -> tuple[tuple[Any, ...], ...] | Reason:
    """The levels of one unidirectional recurrent layer."""
    if isinstance(layer.cell, keras.layers.StackedRNNCells):
        cells = tuple(layer.cell.cells)
    else:
        cells = (layer.cell,)
    return tuple((c,) for c in cells)


def _unidirectional_reason(layer: Any, require_built: bool) -> Reason | None:
    """Layer-level checks shared by plain layers and Bidirectional parts."""
    cls = type(layer)
    plain = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN)
    if cls not in plain and cls is not keras.layers.RNN:
        if not getattr(layer, "_rnnfuse_recurrent", False):
            base = next((b.__name__ for b in plain if isinstance(layer, b)), None)
            what = f"a subclass of {base}" if base else "a recurrent layer"
            return Reason(
                "layer_type",
                f"{cls.__name__} is {what} whose call() rnnfuse cannot "
                "see into; only LSTM, GRU, SimpleRNN, RNN(cell), "
                "Bidirectional and ProjectedLSTM are fused",
            )
    if getattr(layer, "unroll", False):
        return Reason(
            "unroll",
            "unroll=True unrolls the loop into separate ops; set unroll=False "
            "to fuse",
        )
    if getattr(layer, "stateful", False):
        return Reason(
            "stateful",
            "stateful=True keeps state between batches in the layer's own "
            "variables; stateful layers are not fused",
        )
    if getattr(layer, "use_cudnn", "auto") is False:
        return Reason(
            "use_cudnn",
            "use_cudnn=False: the layer was told not to use cuDNN",
        )
    if require_built and not layer.built:
        return Reason("not_built", "the layer is not built")
    return None


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


def _kinds_of(levels: tuple[tuple[Any, ...], ...]) -> str | Reason:
    kinds = set()
    units = set()
    for level in levels:
        for cell in level:
            kind = cell_kind(cell)
            if isinstance(kind, Reason):
                return kind
            kinds.add(kind)
            units.add((int(cell.units), int(getattr(cell, "proj_size", 0))))
    for i, level in enumerate(levels[1:], start=1):
        if getattr(level[0], "dropout", 0):
            return Reason(
                "dropout",
                f"cell {i} of its StackedRNNCells has dropout="
                f"{level[0].dropout}; input dropout can only be applied "
                "before the first level of a fused call",
            )
    if len(kinds) > 1:
        return Reason(
            "mixed_cells",
            "its cells are of different kinds (" + ", ".join(sorted(kinds)) + ")",
        )
    if len(units) > 1:
        return Reason(
            "mixed_units",
            "its cells have different widths "
            + ", ".join(str(u) for u, _ in sorted(units)),
        )
    return kinds.pop()


def describe(layer: Any, require_built: bool = True) -> RecurrentView | Reason:
    """A `RecurrentView` of `layer`, or the `Reason` it cannot be fused.

    Args:
        layer: a Keras layer.
        require_built: whether an unbuilt layer is a reason not to fuse.

    Returns:
        `RecurrentView` for LSTM, GRU, SimpleRNN, RNN(cell),
        RNN(StackedRNNCells), Bidirectional of those, and ProjectedLSTM;
        otherwise a `Reason` naming the rule that failed.
    """
    if isinstance(layer, keras.layers.Bidirectional):
        return _describe_bidirectional(layer, require_built)
    if not is_recurrent(layer):
        return Reason("not_recurrent", f"{type(layer).__name__} is not recurrent")
    reason = _unidirectional_reason(layer, require_built)
    if reason is not None:
        return reason
    levels = _rnn_levels(layer)
    kind = _kinds_of(levels)
    if isinstance(kind, Reason):
        return kind
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


def _describe_bidirectional(layer: Any, require_built: bool) -> RecurrentView | Reason:
    fwd, bwd = layer.forward_layer, layer.backward_layer
    for part in (fwd, bwd):
        view = describe(part, require_built)
        if isinstance(view, Reason):
            return Reason(view.rule, f"its {_part_name(layer, part)}: {view}")
    fview, bview = describe(fwd, require_built), describe(bwd, require_built)
    if fview.num_levels != 1 or bview.num_levels != 1:
        return Reason(
            "stacked_cells_in_bidirectional",
            "Bidirectional(RNN(StackedRNNCells)) runs each direction through "
            "all levels before the other direction; cuDNN interleaves them",
        )
    if fview.go_backwards or not bview.go_backwards:
        return Reason(
            "bidirectional_directions",
            "its forward layer must read forwards and its backward layer "
            "backwards",
        )
    if (fview.kind, fview.units, fview.proj_size) != (
        bview.kind,
        bview.units,
        bview.proj_size,
    ):
        return Reason(
            "bidirectional_mismatch",
            f"its forward layer ({_width(fview)}) and backward layer "
            f"({_width(bview)}) differ",
        )
    if fview.dropout or bview.dropout:
        return Reason(
            "bidirectional_dropout",
            "dropout inside a Bidirectional layer draws one input mask per "
            "direction; a fused bidirectional call has one input",
        )
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


def _width(view: RecurrentView) -> str:
    proj = f", proj_size {view.proj_size}" if view.proj_size else ""
    return f"{view.kind}, {view.units} units{proj}"


def _part_name(wrapper: Any, part: Any) -> str:
    which = "forward" if part is wrapper.forward_layer else "backward"
    return f"{which} layer '{part.name}'"


def keras_has_cudnn_path(view: RecurrentView) -> bool:
    """Whether Keras has a cuDNN path for this layer at all: `LSTM` or
    `GRU` (each direction of a Bidirectional) with a bias. Everything else
    (SimpleRNN, RNN(cell), StackedRNNCells, no bias) runs Keras' generic
    Python-level loop on every device."""
    layers = (
        (view.layer.forward_layer, view.layer.backward_layer)
        if isinstance(view.layer, keras.layers.Bidirectional)
        else (view.layer,)
    )
    return all(
        type(layer) in (keras.layers.LSTM, keras.layers.GRU) and layer.cell.use_bias
        for layer in layers
    )


def keras_runs_cudnn(view: RecurrentView) -> bool:
    """Whether Keras itself would run this layer on cuDNN here.

    Keras' TensorFlow backend runs `LSTM` and `GRU` (not `RNN(cell)`, not
    `SimpleRNN`) on cuDNN when their arguments allow it and a GPU is
    visible. On that path padded time steps of a returned sequence are
    zeros; on the generic loop they follow `zero_output_for_mask`.

    Keras' torch backend (3.15) runs LSTM/GRU on cuDNN only without a mask:
    with one, `backend.lstm/gru` raise NotImplementedError and the generic
    loop runs, so under torch padded steps always follow
    `zero_output_for_mask` (False here).
    """
    if not keras_has_cudnn_path(view):
        return False
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return bool(tf.config.list_logical_devices("GPU"))
