"""`ProjectedLSTM`: an LSTM with a recurrent projection (LSTMP).

Per time step, gate order i, f, c, o as in `keras.layers.LSTM`:

    z   = x_t @ kernel + h_{t-1} @ recurrent_kernel + bias     [B, 4U]
    i, f, o = recurrent_activation(z_i, z_f, z_o);  g = activation(z_c)
    c_t = f * c_{t-1} + i * g                                   [B, U]
    h_t = (o * activation(c_t)) @ projection_kernel             [B, P]

Weights: kernel (input_dim, 4U), recurrent_kernel (P, 4U), bias (4U,),
projection_kernel (U, P); the states are [h, c].

Keras' generic loop over `ProjectedLSTMCell` runs everywhere and is the
reference. The fast path runs the input GEMM for all steps at once, then a
loop of only the recurrent GEMM, gates and projection; its variant is the
layer's `fast_path`, else the context's (`set_fast_path`, `fast_path()`),
else RNNFUSE_PROJECTED_LSTM_PATH, else "auto":

  | variant      | loop (TensorFlow)            | gradient             |
  |--------------|------------------------------|----------------------|
  | "custom_xla" | tf.while_loop, XLA-compiled  | hand-written, XLA    |
  | "custom"     | tf.while_loop                | hand-written         |
  | "while_xla"  | tf.while_loop, XLA-compiled  | autodiff in XLA      |
  | "while"      | tf.while_loop                | TensorFlow autodiff  |
  | "off"        | Keras' generic loop          | TensorFlow autodiff  |

On a TensorFlow GPU rnnfuse's cuDNN op runs unmasked calls; under torch
the fast path is PyTorch's own LSTMP. Keras' loop runs where the fast path
cannot (unroll, recurrent dropout, JAX); `layer.last_path` says which ran.

Example:
    >>> import numpy as np
    >>> layer = ProjectedLSTM(16, proj_size=4, return_state=True)
    >>> y, h, c = layer(np.random.rand(2, 7, 3).astype("float32"))
    >>> tuple(y.shape), tuple(h.shape), tuple(c.shape)
    ((2, 4), (2, 4), (2, 16))
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from typing import Any

import keras
from keras import constraints, initializers, ops, regularizers, tree

from rnnfuse.backends import get_backend
from rnnfuse.scoped import scoped
from rnnfuse.backends.base import PROJECTED_LSTM_PATHS, ProjectedLSTMCall

__all__ = [
    "FAST_PATHS",
    "ProjectedLSTM",
    "ProjectedLSTMCell",
    "fast_path",
    "get_fast_path",
    "get_unroll",
    "set_fast_path",
]

FAST_PATHS = PROJECTED_LSTM_PATHS

# Read when a call runs or is traced, where nothing else chose.
_ENV_VAR = "RNNFUSE_PROJECTED_LSTM_PATH"
_UNROLL_ENV_VAR = "RNNFUSE_PROJECTED_LSTM_UNROLL"
# Fewer iterations beat the longer body in every measured configuration.
DEFAULT_UNROLL = 4
# (path, unroll) chosen in this context; None: the environment's or the default.
_CHOICE: contextvars.ContextVar[tuple[str | None, int | None]] = contextvars.ContextVar(
    "rnnfuse_projected_lstm_path", default=(None, None)
)


def _check_path(name: Any, where: str) -> str:
    if name in FAST_PATHS:
        return name
    known = ", ".join(map(repr, FAST_PATHS))
    raise ValueError(f"{where}: unknown fast path {name!r}; expected one of {known}.")


def _check_unroll(unroll: Any, where: str) -> int:
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(
            f"{where}: `unroll` must be a positive integer (time steps per loop "
            f"iteration); received unroll={unroll!r}. Fix: pass e.g. unroll=4."
        )
    return unroll


def set_fast_path(name: str, unroll: int | None = None) -> None:
    """Selects the ProjectedLSTM implementation for calls traced from now on
    in this thread (or task): `name` one of `FAST_PATHS` ("off": Keras'
    generic loop), `unroll` time steps per loop iteration (default 4, used
    where it divides the sequence length); ValueError for either out of
    range. A layer's own arguments win; this wins over the environment."""
    _CHOICE.set(_choice(name, unroll, "set_fast_path"))


def _choice(name: Any, unroll: Any, where: str) -> tuple[str, int | None]:
    """(name, unroll) checked; unroll None keeps the one chosen before."""
    name = _check_path(name, f"{where}(name)")
    return name, _CHOICE.get()[1] if unroll is None else _check_unroll(unroll, where)


def get_unroll() -> int:
    """Time steps per loop iteration of the fast path (see `set_fast_path`)."""
    unroll = _CHOICE.get()[1]
    if unroll is not None:
        return unroll
    raw = os.environ.get(_UNROLL_ENV_VAR)
    if raw:
        where = f"environment variable {_UNROLL_ENV_VAR}"
        try:
            value = int(raw)
        except ValueError:
            value = raw
        return _check_unroll(value, where)
    return DEFAULT_UNROLL


def get_fast_path(resolve: bool = False) -> str:
    """The ProjectedLSTM implementation new calls use (see `set_fast_path`);
    `resolve` turns "auto" into the variant it means here.

    >>> with fast_path("while"):
    ...     get_fast_path()
    'while'
    """
    path = _CHOICE.get()[0]
    if path is None and os.environ.get(_ENV_VAR):
        path = _check_path(os.environ[_ENV_VAR], f"environment variable {_ENV_VAR}")
    path = path or "auto"
    if resolve:
        return get_backend().resolve_projected_lstm_path(path)
    return path


@contextlib.contextmanager
def fast_path(name: str, unroll: int | None = None):
    """Context manager: `set_fast_path(name, unroll)` inside, the old values
    after. The choice is read when a call runs or is traced, so trace inside."""
    with scoped(_CHOICE, _choice(name, unroll, "fast_path")):
        yield


def _check_size(value: Any, arg: str, cls: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{cls}: `{arg}` must be a positive integer; received "
            f"{arg}={value!r}. Fix: pass e.g. {arg}=256."
        )
    return int(value)


@keras.saving.register_keras_serializable(package="rnnfuse")
class ProjectedLSTMCell(keras.layers.LSTMCell):
    """One step of an LSTM with a recurrent projection.

    The arguments of `keras.layers.LSTMCell`, plus `proj_size` (the width of
    the output and recurrent state h) and `projection_initializer`,
    `projection_regularizer`, `projection_constraint` for `projection_kernel`.
    `state_size` is `[proj_size, units]`.

    Example:
        >>> import numpy as np, keras
        >>> rnn = keras.layers.RNN(ProjectedLSTMCell(8, proj_size=3))
        >>> tuple(rnn(np.zeros((2, 4, 5), "float32")).shape)
        (2, 3)
    """

    # Read by rnnfuse.recurrent.cell_kind: cuDNN's LSTM mode.
    _rnnfuse_cell_kind = "lstm"

    def __init__(
        self,
        units,
        proj_size,
        activation="tanh",
        recurrent_activation="sigmoid",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        recurrent_initializer="orthogonal",
        bias_initializer="zeros",
        unit_forget_bias=True,
        kernel_regularizer=None,
        recurrent_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        recurrent_constraint=None,
        bias_constraint=None,
        dropout=0.0,
        recurrent_dropout=0.0,
        seed=None,
        projection_initializer="glorot_uniform",
        projection_regularizer=None,
        projection_constraint=None,
        **kwargs,
    ):
        _check_size(units, "units", type(self).__name__)
        _check_size(proj_size, "proj_size", type(self).__name__)
        super().__init__(
            units,
            activation=activation,
            recurrent_activation=recurrent_activation,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            recurrent_initializer=recurrent_initializer,
            bias_initializer=bias_initializer,
            unit_forget_bias=unit_forget_bias,
            kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint,
            dropout=dropout,
            recurrent_dropout=recurrent_dropout,
            seed=seed,
            **kwargs,
        )
        self.proj_size = int(proj_size)
        self.projection_initializer = initializers.get(projection_initializer)
        self.projection_regularizer = regularizers.get(projection_regularizer)
        self.projection_constraint = constraints.get(projection_constraint)
        self.state_size = [self.proj_size, self.units]
        self.output_size = self.proj_size

    def build(self, input_shape):
        # LSTMCell.build would make a (units, 4 units) recurrent kernel.
        keras.layers.Layer.build(self, input_shape)
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units * 4),
            name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.recurrent_kernel = self.add_weight(
            shape=(self.proj_size, self.units * 4),
            name="recurrent_kernel",
            initializer=self.recurrent_initializer,
            regularizer=self.recurrent_regularizer,
            constraint=self.recurrent_constraint,
        )
        if self.use_bias:
            if self.unit_forget_bias:

                def bias_initializer(_, *args, **kwargs):
                    return ops.concatenate(
                        [
                            self.bias_initializer((self.units,), *args, **kwargs),
                            initializers.get("ones")((self.units,), *args, **kwargs),
                            self.bias_initializer((self.units * 2,), *args, **kwargs),
                        ]
                    )

            else:
                bias_initializer = self.bias_initializer
            self.bias = self.add_weight(
                shape=(self.units * 4,),
                name="bias",
                initializer=bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
        else:
            self.bias = None
        self.projection_kernel = self.add_weight(
            shape=(self.units, self.proj_size),
            name="projection_kernel",
            initializer=self.projection_initializer,
            regularizer=self.projection_regularizer,
            constraint=self.projection_constraint,
        )

    def call(self, inputs, states, training=False):
        # LSTMCell's step works unchanged with a [B, P] h and a (P, 4U)
        # recurrent kernel; it returns o * activation(c), which we project.
        gated, (_, c) = super().call(inputs, states, training=training)
        h = ops.matmul(gated, self.projection_kernel)
        return h, [h, c]

    def get_config(self):
        config = {
            "proj_size": self.proj_size,
            "projection_initializer": initializers.serialize(
                self.projection_initializer
            ),
            "projection_regularizer": regularizers.serialize(
                self.projection_regularizer
            ),
            "projection_constraint": constraints.serialize(
                self.projection_constraint
            ),
        }
        return {**super().get_config(), **config}


# The arguments a ProjectedLSTM hands its cell, besides units and proj_size
# (the rest go to keras.layers.RNN).
_CELL_ARGS = tuple(inspect.signature(ProjectedLSTMCell.__init__).parameters)[3:-1]


@keras.saving.register_keras_serializable(package="rnnfuse")
class ProjectedLSTM(keras.layers.RNN):
    """LSTM with a recurrent projection (LSTMP), fast on TensorFlow and torch.

    Every argument of `keras.layers.LSTM` behaves as there (by keyword), with
    `proj_size` (the width of the output and of h) second and the
    `projection_*` initializer, regularizer and constraint. `use_cudnn`:
    "auto" and True pick the fast path (True raises where it cannot run),
    False Keras' generic loop; not serialized. `fast_path` and
    `fast_path_unroll`: this layer's variant and steps per loop iteration
    (None: the context's); serialized.

    Example:
        >>> import numpy as np
        >>> layer = ProjectedLSTM(32, 8, return_sequences=True)
        >>> y = layer(np.random.rand(4, 10, 6).astype("float32"))
        >>> tuple(y.shape), [tuple(w.shape) for w in layer.weights]
        ((4, 10, 8), [(6, 128), (8, 128), (128,), (32, 8)])
    """

    # Read by rnnfuse.recurrent: this layer can take part in a fused stack.
    _rnnfuse_recurrent = True

    def __init__(self, units, proj_size, *, use_cudnn="auto", fast_path=None, fast_path_unroll=None,
                 **kwargs):
        cell_args = {k: kwargs.pop(k) for k in _CELL_ARGS if k in kwargs}
        cell = ProjectedLSTMCell(
            units,
            proj_size,
            **cell_args,
            dtype=kwargs.get("dtype", None),
            trainable=kwargs.get("trainable", True),
            name="projected_lstm_cell",
            implementation=kwargs.pop("implementation", 2),
        )
        super().__init__(cell, **kwargs)
        self.input_spec = keras.layers.InputSpec(ndim=3)
        if use_cudnn not in ("auto", True, False):
            raise ValueError(
                "ProjectedLSTM: `use_cudnn` must be 'auto', True or False; "
                f"received use_cudnn={use_cudnn!r}. Fix: leave it at 'auto'."
            )
        self.use_cudnn = use_cudnn
        if fast_path is not None:
            _check_path(fast_path, "ProjectedLSTM(fast_path)")
        if fast_path_unroll is not None:
            _check_unroll(fast_path_unroll, "ProjectedLSTM(fast_path_unroll)")
        self.fast_path = fast_path
        self.fast_path_unroll = fast_path_unroll
        # The path of the last call ("custom_xla", ..., or "keras_loop: why").
        self.last_path: str | None = None

    # -- the loop ---------------------------------------------------------------

    def _keras_loop_reason(self) -> str | None:
        """Why this layer must run Keras' generic loop, or None."""
        backend = get_backend()
        if backend.capabilities.projected_lstm_loop is None:
            return backend.projected_lstm_reason(self.cell)
        if self.unroll:
            return "unroll=True"
        if self.cell.recurrent_dropout:
            return "recurrent_dropout draws masks inside the loop"
        if self.cell.dropout and getattr(self.cell, "dropout_mask_count", None):
            return "implementation=1 draws one input dropout mask per gate"
        return backend.projected_lstm_reason(self.cell)

    def _call_options(self) -> tuple[str, int]:
        """(fast-path variant, unroll) for this call: the layer's own
        arguments, else the process-wide ones (read now)."""
        path = self.fast_path if self.fast_path is not None else get_fast_path()
        unroll = self.fast_path_unroll if self.fast_path_unroll is not None else get_unroll()
        return path, unroll

    def inner_loop(self, sequences, initial_state, mask, training=False):
        if tree.is_nested(mask):
            mask = mask[0]
        reason = self._keras_loop_reason()
        if reason is not None and self.use_cudnn is True:
            raise ValueError(
                f"ProjectedLSTM '{self.name}': use_cudnn=True, but the fast "
                f"path cannot run here ({reason}). Fix: pass use_cudnn='auto' "
                "to fall back to Keras' generic loop."
            )
        path, unroll = self._call_options()
        if reason is None and self.use_cudnn is False:
            reason = "use_cudnn=False"
        if reason is None and path == "off":
            if self.fast_path == "off":
                reason = "the fast path is switched off (fast_path='off')"
            else:
                reason = "the fast path is switched off (set_fast_path('off'))"
        if reason is not None:
            return self._keras_loop(sequences, initial_state, mask, training, reason)
        call = ProjectedLSTMCall(
            cell=self.cell, training=training, go_backwards=self.go_backwards,
            zero_output_for_mask=self.zero_output_for_mask,
            return_sequences=self.return_sequences, path=path, unroll=unroll)
        try:
            result, taken = get_backend().run_projected_lstm(sequences, initial_state, mask, call)
        except NotImplementedError as err:
            return self._keras_loop(sequences, initial_state, mask, training, str(err))
        self.last_path = taken
        return result

    def _keras_loop(self, sequences, initial_state, mask, training, reason):
        self.last_path = f"keras_loop: {reason}"
        return super().inner_loop(sequences, initial_state, mask=mask, training=training)

    def call(self, sequences, initial_state=None, mask=None, training=False):
        return super().call(
            sequences, mask=mask, training=training, initial_state=initial_state
        )

    # -- LSTM's properties --------------------------------------------------------

    @property
    def units(self):
        return self.cell.units

    @property
    def proj_size(self):
        return self.cell.proj_size

    @property
    def activation(self):
        return self.cell.activation

    @property
    def recurrent_activation(self):
        return self.cell.recurrent_activation

    @property
    def use_bias(self):
        return self.cell.use_bias

    @property
    def unit_forget_bias(self):
        return self.cell.unit_forget_bias

    @property
    def kernel_initializer(self):
        return self.cell.kernel_initializer

    @property
    def recurrent_initializer(self):
        return self.cell.recurrent_initializer

    @property
    def bias_initializer(self):
        return self.cell.bias_initializer

    @property
    def projection_initializer(self):
        return self.cell.projection_initializer

    @property
    def kernel_regularizer(self):
        return self.cell.kernel_regularizer

    @property
    def recurrent_regularizer(self):
        return self.cell.recurrent_regularizer

    @property
    def bias_regularizer(self):
        return self.cell.bias_regularizer

    @property
    def projection_regularizer(self):
        return self.cell.projection_regularizer

    @property
    def kernel_constraint(self):
        return self.cell.kernel_constraint

    @property
    def recurrent_constraint(self):
        return self.cell.recurrent_constraint

    @property
    def bias_constraint(self):
        return self.cell.bias_constraint

    @property
    def projection_constraint(self):
        return self.cell.projection_constraint

    @property
    def dropout(self):
        return self.cell.dropout

    @property
    def recurrent_dropout(self):
        return self.cell.recurrent_dropout

    def get_config(self):
        cell = self.cell.get_config()
        config = {
            **{k: cell[k] for k in ("units", "proj_size", *_CELL_ARGS)},
            "activity_regularizer": regularizers.serialize(self.activity_regularizer),
            "fast_path": self.fast_path,
            "fast_path_unroll": self.fast_path_unroll,
        }
        base_config = super().get_config()
        del base_config["cell"]
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
