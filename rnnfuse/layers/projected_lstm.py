"""`ProjectedLSTM`: an LSTM with a recurrent projection (LSTMP).

The maths (Sak et al. 2014; PyTorch's `nn.LSTM(proj_size=P)`), per time
step, with gate order i, f, c, o as in `keras.layers.LSTM`:

    z   = x_t @ kernel + h_{t-1} @ recurrent_kernel + bias     [B, 4U]
    i, f, o = recurrent_activation(z_i, z_f, z_o);  g = activation(z_c)
    c_t = f * c_{t-1} + i * g                                   [B, U]
    h_t = (o * activation(c_t)) @ projection_kernel             [B, P]

h_t is both the output and the recurrent input; the states are [h, c].
Weights: kernel (input_dim, 4U), recurrent_kernel (P, 4U), bias (4U,),
projection_kernel (U, P).

Two implementations of the same maths:

- Keras' generic loop (`keras.layers.RNN` calling `ProjectedLSTMCell` once
  per step): every Keras backend, and the reference.
- The fast path (TensorFlow backend): one GEMM for the input projection of
  all time steps (`x @ kernel + bias` over [T*B, F]), then a tight loop over
  time that runs only the recurrent GEMM, the gate maths and the projection.
  Variants (module switch, see `set_fast_path`; default from the environment
  variable RNNFUSE_PROJECTED_LSTM_PATH, else "auto": "custom_xla" when a GPU
  is visible and XLA compiles there (checked once), else "custom"; on the
  CPU XLA's compile time is not repaid):

  | variant        | loop                         | gradient                 |
  |----------------|------------------------------|--------------------------|
  | "custom_xla"   | tf.while_loop, XLA-compiled  | hand-written, XLA        |
  | "custom"       | tf.while_loop                | hand-written             |
  | "while_xla"    | tf.while_loop, XLA-compiled  | autodiff in XLA (*)      |
  | "while"        | tf.while_loop                | TensorFlow autodiff      |
  | "off"          | Keras' generic loop          | TensorFlow autodiff      |

  (*) TensorFlow cannot differentiate a loop across an XLA function's
  boundary, so "while_xla" differentiates a second run of the loop inside
  XLA (one extra forward pass). When the whole train step is XLA-compiled
  (Keras' `jit_compile`), every variant is compiled into it.

  The hand-written backward pass runs two GEMMs per step (dh @ P^T and
  dz @ R^T) and computes the weight gradients after the loop as two GEMMs
  over all steps (dR = H_prev^T dZ, dP = M^T dH), as cuDNN does; autodiff
  accumulates them step by step. It needs tanh/sigmoid activations (other
  activations use the autodiff loop of the same compile mode).

  `set_fast_path(name, unroll=k)` (or RNNFUSE_PROJECTED_LSTM_UNROLL) runs k
  time steps per loop iteration when k divides the static sequence length,
  trading a longer loop body for fewer iterations (default 4: measured
  faster on the H200 in every configuration).

  The fast path is used when the backend is TensorFlow, `use_cudnn` is not
  False, `unroll` is False and there is no recurrent dropout (nor input
  dropout with `implementation=1`, which draws one mask per gate);
  otherwise Keras' generic loop runs. Masks follow the generic loop
  exactly: masked steps keep the state; a masked step's output is zeros
  with `zero_output_for_mask=True`, else the last unmasked output (zeros
  before the first one).

On the TensorFlow backend with a GPU, rnnfuse's own cuDNN op
(`rnnfuse.backends.tensorflow.cudnn_op`, path "cudnn_op") runs the layer as
one cuDNN LSTMP call, forward and backward, when there is no mask, the
activations are tanh/sigmoid, the op is loaded and the call is not being
compiled by XLA; the loops above are the fallback. The fast path's outputs
keep the static shapes Keras' loop gives (time dimension included).

Under the torch backend the fast path is PyTorch's own LSTMP
(`nn.LSTM(proj_size=P)`'s `torch._VF.lstm` call, through
`rnnfuse.backends.torch.run_stack`): cuDNN on CUDA, PyTorch's native kernel
on the CPU; path "torch_fused". It runs when `use_cudnn` is not False, the
fast path is not switched "off", `unroll` is False, there is no recurrent
dropout (nor input dropout with `implementation=1`), the activations are
tanh/sigmoid, proj_size < units (PyTorch's limit) and the mask is None or
right-padded with no empty sequence (checked on its values; other masks run
Keras' generic loop). Results match the generic loop to float rounding.

`PATH_COUNTS` counts the paths taken (incremented each time `call` runs
eagerly or is traced) and `layer.last_path` names the last one, so tests
can prove which path ran.

Example:

    >>> import numpy as np
    >>> layer = ProjectedLSTM(16, proj_size=4, return_state=True)
    >>> y, h, c = layer(np.random.rand(2, 7, 3).astype("float32"))
    >>> tuple(y.shape), tuple(h.shape), tuple(c.shape)
    ((2, 4), (2, 4), (2, 16))
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from typing import Any

import keras
from keras import activations, constraints, initializers, ops, regularizers, tree

__all__ = [
    "FAST_PATHS",
    "PATH_COUNTS",
    "ProjectedLSTM",
    "ProjectedLSTMCell",
    "fast_path",
    "get_fast_path",
    "get_unroll",
    "set_fast_path",
]

logger = logging.getLogger("rnnfuse")

FAST_PATHS = ("auto", "custom_xla", "custom", "while_xla", "while", "off")

# Path name -> number of times a ProjectedLSTM call took it ("keras_loop" for
# Keras' generic loop). Incremented when the call runs eagerly or is traced.
PATH_COUNTS: collections.Counter = collections.Counter()

_ENV_VAR = "RNNFUSE_PROJECTED_LSTM_PATH"
_UNROLL_ENV_VAR = "RNNFUSE_PROJECTED_LSTM_UNROLL"
_fast_path = "auto"
# Four steps per loop iteration by default (where 4 divides T): on the H200,
# 1024/256, B=32, T=1000, train step, custom_xla took 84 ms unrolled 4x
# against 137 ms (float32) and 40 ms against 133 ms (mixed_float16);
# 4 layers 498 vs 517 ms and 410 vs 486 ms (bench/results/projected_lstm_h200.json).
_unroll = 4


def _check_path(name: Any, where: str) -> str:
    if name not in FAST_PATHS:
        raise ValueError(
            f"{where}: unknown fast path {name!r}; expected one of "
            f"{', '.join(repr(p) for p in FAST_PATHS)}."
        )
    return name


def _check_unroll(unroll: Any, where: str) -> int:
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(
            f"{where}: `unroll` must be a positive integer (time steps per loop "
            f"iteration); received unroll={unroll!r}. Fix: pass e.g. unroll=4."
        )
    return unroll


def set_fast_path(name: str, unroll: int | None = None) -> None:
    """Selects the ProjectedLSTM implementation for calls traced from now on.

    Args:
        name: one of `FAST_PATHS` ("off" runs Keras' generic loop).
        unroll: optional; time steps per iteration of the fast path's loops
            (1 by default). Used when it divides the static sequence length.

    Raises:
        ValueError: `name` is not one of `FAST_PATHS`, or a bad `unroll`.
    """
    global _fast_path, _unroll
    name = _check_path(name, "set_fast_path(name)")
    if unroll is not None:
        _unroll = _check_unroll(unroll, "set_fast_path")
    _fast_path = name


def get_unroll() -> int:
    """Time steps per loop iteration of the fast path (see `set_fast_path`)."""
    return _unroll


def get_fast_path(resolve: bool = False) -> str:
    """The ProjectedLSTM implementation new calls use (see `set_fast_path`).

    Args:
        resolve: turn "auto" into the variant it means here ("custom_xla"
            with a visible GPU, else "custom").
    """
    if resolve and _fast_path == "auto":
        import tensorflow as tf

        gpu = bool(tf.config.list_logical_devices("GPU"))
        return "custom_xla" if gpu and _xla_works() else "custom"
    return _fast_path


_xla_ok: bool | None = None


def _xla_works() -> bool:
    """Whether XLA can compile the fast path's loops here (checked once).

    XLA on a GPU needs CUDA's libdevice and ptxas, which some TensorFlow
    installs lack; "auto" then uses the "custom" loop instead of failing
    at run time. The check compiles the loops for a 1x1 problem eagerly.
    """
    global _xla_ok
    if _xla_ok is None:
        import tensorflow as tf

        with tf.init_scope():
            try:
                forward, backward = _custom_functions(jit=True)
                xw, small = tf.zeros([2, 1, 4]), tf.zeros([1, 1])
                hs, c, gates, cs = forward(xw, tf.zeros([1, 4]), small, small, small, None, 1)
                backward(hs, c, tf.zeros([1, 4]), small, small, small, None, hs, gates, cs, 1)
                _xla_ok = True
            except (tf.errors.OpError, RuntimeError, ValueError) as err:
                # Informational: the layer recovers by itself.
                logger.warning(
                    "ProjectedLSTM: XLA cannot compile here, so the fast path "
                    "runs without it ('custom'). XLA said: %s",
                    str(err)[:300],
                )
                _xla_ok = False
    return _xla_ok


@contextlib.contextmanager
def fast_path(name: str, unroll: int | None = None):
    """Context manager: `set_fast_path(name, unroll)` inside, the old values after.

    The choice is read when a call runs eagerly or is traced, so trace the
    model (first `fit`/`predict` step, or a fresh `tf.function`) inside.
    """
    old = (_fast_path, _unroll)
    set_fast_path(name, unroll)
    try:
        yield
    finally:
        set_fast_path(*old)


if os.environ.get(_ENV_VAR):
    set_fast_path(_check_path(os.environ[_ENV_VAR], f"environment variable {_ENV_VAR}"))
if os.environ.get(_UNROLL_ENV_VAR):
    _unroll = _check_unroll(
        int(os.environ[_UNROLL_ENV_VAR]), f"environment variable {_UNROLL_ENV_VAR}"
    )


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

    The arguments of `keras.layers.LSTMCell`, plus `proj_size` and the
    projection's initializer, regularizer and constraint. `state_size` is
    `[proj_size, units]` and `output_size` is `proj_size`.

    Args:
        units: width of the cell state c.
        proj_size: width of the output and recurrent state h.
        projection_initializer: initializer of `projection_kernel`
            (default "glorot_uniform").
        projection_regularizer: regularizer of `projection_kernel`.
        projection_constraint: constraint of `projection_kernel`.
        **kwargs: everything else as `keras.layers.LSTMCell`.

    Example:

        >>> import numpy as np, keras
        >>> cell = ProjectedLSTMCell(8, proj_size=3)
        >>> rnn = keras.layers.RNN(cell)
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


@keras.saving.register_keras_serializable(package="rnnfuse")
class ProjectedLSTM(keras.layers.RNN):
    """LSTM with a recurrent projection (LSTMP), fast on TensorFlow and torch.

    Every argument of `keras.layers.LSTM` behaves as there, with `proj_size`
    second. `use_cudnn` keeps LSTM's meaning of "the fast implementation":
    TensorFlow has no cuDNN kernel for projections, so "auto" and True pick
    this module's fast path; under the torch backend they pick PyTorch's
    proj_size LSTM (cuDNN on CUDA). True raises where the fast path cannot
    run, False forces Keras' generic loop. Like LSTM, `use_cudnn` is not
    serialized.

    Args:
        units: width of the cell state c.
        proj_size: width of the output and of the recurrent state h.
        projection_initializer: initializer of `projection_kernel`.
        projection_regularizer: regularizer of `projection_kernel`.
        projection_constraint: constraint of `projection_kernel`.
        **kwargs: the other arguments of `keras.layers.LSTM`
            (return_sequences, return_state, go_backwards, dropout, ...) and
            of `keras.layers.RNN` (zero_output_for_mask).

    Call arguments:
        sequences: [batch, time, features].
        initial_state: [h (batch, proj_size), c (batch, units)].
        mask: [batch, time] boolean.
        training: Python boolean (dropout).

    Returns:
        The output ([batch, proj_size], or [batch, time, proj_size] with
        return_sequences), followed by h and c with return_state.

    Example:

        >>> import numpy as np
        >>> layer = ProjectedLSTM(32, 8, return_sequences=True)
        >>> y = layer(np.random.rand(4, 10, 6).astype("float32"))
        >>> tuple(y.shape), [tuple(w.shape) for w in layer.weights]
        ((4, 10, 8), [(6, 128), (8, 128), (128,), (32, 8)])
    """

    # Read by rnnfuse.recurrent: this layer can take part in a fused stack.
    _rnnfuse_recurrent = True

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
        activity_regularizer=None,
        kernel_constraint=None,
        recurrent_constraint=None,
        bias_constraint=None,
        dropout=0.0,
        recurrent_dropout=0.0,
        seed=None,
        return_sequences=False,
        return_state=False,
        go_backwards=False,
        stateful=False,
        unroll=False,
        use_cudnn="auto",
        projection_initializer="glorot_uniform",
        projection_regularizer=None,
        projection_constraint=None,
        **kwargs,
    ):
        cell = ProjectedLSTMCell(
            units,
            proj_size,
            activation=activation,
            recurrent_activation=recurrent_activation,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            unit_forget_bias=unit_forget_bias,
            recurrent_initializer=recurrent_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint,
            dropout=dropout,
            recurrent_dropout=recurrent_dropout,
            projection_initializer=projection_initializer,
            projection_regularizer=projection_regularizer,
            projection_constraint=projection_constraint,
            dtype=kwargs.get("dtype", None),
            trainable=kwargs.get("trainable", True),
            name="projected_lstm_cell",
            seed=seed,
            implementation=kwargs.pop("implementation", 2),
        )
        super().__init__(
            cell,
            return_sequences=return_sequences,
            return_state=return_state,
            go_backwards=go_backwards,
            stateful=stateful,
            unroll=unroll,
            activity_regularizer=activity_regularizer,
            **kwargs,
        )
        self.input_spec = keras.layers.InputSpec(ndim=3)
        if use_cudnn not in ("auto", True, False):
            raise ValueError(
                "ProjectedLSTM: `use_cudnn` must be 'auto', True or False; "
                f"received use_cudnn={use_cudnn!r}. Fix: leave it at 'auto'."
            )
        self.use_cudnn = use_cudnn
        # The path of the last call ("custom_xla", ..., or "keras_loop: why").
        self.last_path: str | None = None

    # -- the loop ---------------------------------------------------------------

    def _keras_loop_reason(self) -> str | None:
        """Why this layer must run Keras' generic loop, or None."""
        from rnnfuse.backends import get_backend

        backend = get_backend()
        loop = backend.capabilities.projected_lstm_loop
        if loop is None:
            return f"no fast path for the {backend.name} backend"
        if self.unroll:
            return "unroll=True"
        if self.cell.recurrent_dropout:
            return "recurrent_dropout draws masks inside the loop"
        if self.cell.dropout and getattr(self.cell, "dropout_mask_count", None):
            return "implementation=1 draws one input dropout mask per gate"
        if loop == "torch":
            return _torch_reason(self.cell)
        return None

    @staticmethod
    def _keras_loop_backend() -> str | None:
        from rnnfuse.backends import get_backend

        return get_backend().capabilities.projected_lstm_loop

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
        if reason is None and self.use_cudnn is False:
            reason = "use_cudnn=False"
        if reason is None and _fast_path == "off":
            reason = "the fast path is switched off (set_fast_path('off'))"
        if reason is not None:
            return self._keras_loop(sequences, initial_state, mask, training, reason)
        if self._keras_loop_backend() == "torch":
            return self._torch_loop(sequences, initial_state, mask, training)
        if mask is None and _tf_op_reason(self.cell) is None:
            self.last_path = "cudnn_op"
            PATH_COUNTS["cudnn_op"] += 1
            result = _tf_op_inner_loop(
                self.cell,
                sequences,
                initial_state,
                training=training,
                go_backwards=self.go_backwards,
                return_sequences=self.return_sequences,
            )
            return _static_shapes(result, sequences, self.cell, self.return_sequences)
        variant = get_fast_path(resolve=True)
        if variant.startswith("custom") and not _tanh_sigmoid(self.cell):
            variant = variant.replace("custom", "while")
        unroll = _unroll_factor(sequences.shape[1])
        self.last_path = variant + (f"/u{unroll}" if unroll > 1 else "")
        PATH_COUNTS[self.last_path] += 1
        result = _fast_inner_loop(
            self.cell,
            sequences,
            initial_state,
            mask,
            training=training,
            go_backwards=self.go_backwards,
            zero_output_for_mask=self.zero_output_for_mask,
            return_sequences=self.return_sequences,
            variant=variant,
            unroll=unroll,
        )
        return _static_shapes(result, sequences, self.cell, self.return_sequences)

    def _keras_loop(self, sequences, initial_state, mask, training, reason):
        self.last_path = f"keras_loop: {reason}"
        PATH_COUNTS["keras_loop"] += 1
        return super().inner_loop(sequences, initial_state, mask=mask, training=training)

    def _torch_loop(self, sequences, initial_state, mask, training):
        """PyTorch's proj_size LSTM (one `torch._VF.lstm` call), or under a
        mask it cannot take (not right-padded, or an empty row) Keras' loop."""
        from rnnfuse.backends import torch as torch_backend

        def fused():
            self.last_path = "torch_fused"
            PATH_COUNTS["torch_fused"] += 1
            return _torch_inner_loop(
                self.cell,
                sequences,
                initial_state,
                mask,
                training=training,
                go_backwards=self.go_backwards,
                zero_output_for_mask=self.zero_output_for_mask,
                return_sequences=self.return_sequences,
            )

        if mask is None:
            return fused()
        # Keras' torch backend runs eagerly: the mask's values pick the path.
        return ops.cond(
            torch_backend.mask_is_supported(mask),
            fused,
            lambda: self._keras_loop(
                sequences,
                initial_state,
                mask,
                training,
                "the mask is not right-padded, or a sequence is empty",
            ),
        )

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
        config = {
            "units": self.units,
            "proj_size": self.proj_size,
            "activation": activations.serialize(self.activation),
            "recurrent_activation": activations.serialize(self.recurrent_activation),
            "use_bias": self.use_bias,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "recurrent_initializer": initializers.serialize(self.recurrent_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "projection_initializer": initializers.serialize(
                self.projection_initializer
            ),
            "unit_forget_bias": self.unit_forget_bias,
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "recurrent_regularizer": regularizers.serialize(self.recurrent_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "projection_regularizer": regularizers.serialize(
                self.projection_regularizer
            ),
            "activity_regularizer": regularizers.serialize(self.activity_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "recurrent_constraint": constraints.serialize(self.recurrent_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
            "projection_constraint": constraints.serialize(self.projection_constraint),
            "dropout": self.dropout,
            "recurrent_dropout": self.recurrent_dropout,
            "seed": self.cell.seed,
        }
        base_config = super().get_config()
        del base_config["cell"]
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# -- the fast path (TensorFlow) ---------------------------------------------------


def _tanh_sigmoid(cell) -> bool:
    """Whether the cell uses exactly tanh and sigmoid (the hand-written grad,
    and the only activations PyTorch's fused LSTM computes)."""
    from rnnfuse.backends import get_backend
    from rnnfuse.recurrent import _activation_name

    extra = get_backend().activation_functions()
    return (
        _activation_name(cell.activation, extra) == "tanh"
        and _activation_name(cell.recurrent_activation, extra) == "sigmoid"
    )


def _fast_inner_loop(
    cell,
    sequences,
    initial_state,
    mask,
    *,
    training,
    go_backwards,
    zero_output_for_mask,
    return_sequences,
    variant,
    unroll,
):
    """What `keras.layers.RNN.inner_loop` returns, computed on the fast path.

    Returns:
        (last_output [B, P], outputs [B, T, P] (or [B, 1, P] when not
        return_sequences, as the generic loop), [h [B, P], c [B, U]]).
    """
    import tensorflow as tf

    dtype = sequences.dtype
    x = tf.transpose(sequences, [1, 0, 2])  # time-major [T, B, F]
    if training and 0.0 < cell.dropout < 1.0:
        # The mask RNN.call drew for this call (one per sequence).
        x = x * cell.get_dropout_mask(sequences[:, 0, :])
    if go_backwards:
        x = tf.reverse(x, [0])
    kernel = tf.cast(cell.kernel, dtype)
    steps, batch, features = tf.shape(x)[0], tf.shape(x)[1], tf.shape(x)[2]
    xw = tf.matmul(tf.reshape(x, tf.stack([steps * batch, features])), kernel)
    if cell.use_bias:
        xw = xw + tf.cast(cell.bias, dtype)
    xw = tf.reshape(xw, tf.stack([steps, batch, 4 * cell.units]))
    recurrent = tf.cast(cell.recurrent_kernel, dtype)
    projection = tf.cast(cell.projection_kernel, dtype)
    h0 = tf.cast(initial_state[0], dtype)
    c0 = tf.cast(initial_state[1], dtype)
    keep = None
    if mask is not None:
        keep = tf.transpose(tf.cast(mask, tf.bool))  # [T, B]
        if go_backwards:
            keep = tf.reverse(keep, [0])
        keep = keep[:, :, None]
    hs, c_last = _recurrence(
        variant, unroll, xw, recurrent, projection, h0, c0, keep, cell.activation,
        cell.recurrent_activation,
    )
    h_last = hs[-1]
    if keep is None:
        outputs = hs
    else:
        # Generic loop: a masked step outputs zeros (zero_output_for_mask) or
        # the previous output, which is zeros before the first unmasked step.
        if zero_output_for_mask:
            shown = keep
        else:
            shown = tf.cumsum(tf.cast(keep, tf.int32), axis=0) > 0
        outputs = tf.where(shown, hs, tf.zeros_like(hs))
    last_output = outputs[-1]
    if return_sequences:
        outputs = tf.transpose(outputs, [1, 0, 2])
    else:
        outputs = last_output[:, None, :]
    return last_output, outputs, [h_last, c_last]


def _recurrence(variant, unroll, xw, recurrent, projection, h0, c0, keep, act, rec_act):
    """(hs [T, B, P]: h after each step, c after the last step)."""
    jit = variant.endswith("_xla")
    if variant.startswith("custom"):
        return _custom_recurrence(xw, recurrent, projection, h0, c0, keep, jit, unroll)
    fn = _autodiff_function(act, rec_act, jit)
    return fn(xw, recurrent, projection, h0, c0, keep, unroll)


def _unroll_factor(steps) -> int:
    """`get_unroll()` when it divides the (static) number of steps, else 1."""
    if _unroll > 1 and steps is not None and int(steps) % _unroll == 0:
        return _unroll
    return 1


_FUNCTIONS: dict = {}


def _autodiff_function(act, rec_act, jit):
    """The loop as a function TensorFlow differentiates.

    Without XLA, TensorFlow differentiates the while loop itself. With XLA
    it cannot (the loop's saved intermediates, TensorLists, may not cross
    the XLA boundary), so the gradient is a second XLA function that runs
    the loop again under a tape and differentiates it inside XLA: one extra
    forward pass, in exchange for a fully compiled backward.
    """
    key = ("while", act, rec_act, jit)
    if key not in _FUNCTIONS:
        import tensorflow as tf

        def forward(xw, recurrent, projection, h0, c0, keep, unroll):
            hs, c, _, _ = _forward_loop(
                xw, recurrent, projection, h0, c0, keep, act, rec_act, False, unroll
            )
            return hs, c

        if not jit:
            _FUNCTIONS[key] = tf.function(forward, autograph=False)
            return _FUNCTIONS[key]

        compiled = tf.function(forward, jit_compile=True, autograph=False)

        def backward(d_hs, d_c, xw, recurrent, projection, h0, c0, keep, unroll):
            inputs = (xw, recurrent, projection, h0, c0)
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                hs, c = forward(*inputs, keep, unroll)
            return tape.gradient((hs, c), inputs, output_gradients=(d_hs, d_c))

        backward = tf.function(backward, jit_compile=True, autograph=False)

        def run(xw, recurrent, projection, h0, c0, keep, unroll):
            @tf.custom_gradient
            def inner(xw, recurrent, projection, h0, c0):
                hs, c = compiled(*_detached(xw, recurrent, projection, h0, c0), keep, unroll)

                def grad(d_hs, d_c):
                    d_hs = tf.zeros_like(hs) if d_hs is None else d_hs
                    d_c = tf.zeros_like(c) if d_c is None else d_c
                    return backward(
                        d_hs, d_c, xw, recurrent, projection, h0, c0, keep, unroll
                    )

                return (hs, c), grad

            return inner(xw, recurrent, projection, h0, c0)

        _FUNCTIONS[key] = run
    return _FUNCTIONS[key]


def _custom_functions(jit):
    key = ("custom", jit)
    if key not in _FUNCTIONS:
        import tensorflow as tf

        def forward(xw, recurrent, projection, h0, c0, keep, unroll):
            return _forward_loop(
                xw, recurrent, projection, h0, c0, keep, tf.tanh, tf.sigmoid, True, unroll
            )

        _FUNCTIONS[key] = (
            tf.function(forward, jit_compile=jit, autograph=False),
            tf.function(_backward_loop, jit_compile=jit, autograph=False),
        )
    return _FUNCTIONS[key]


def _custom_recurrence(xw, recurrent, projection, h0, c0, keep, jit, unroll):
    import tensorflow as tf

    forward, backward = _custom_functions(jit)

    @tf.custom_gradient
    def run(xw, recurrent, projection, h0, c0):
        hs, c_last, gates, cs = forward(
            *_detached(xw, recurrent, projection, h0, c0), keep, unroll
        )

        def grad(d_hs, d_c_last):
            d_hs = tf.zeros_like(hs) if d_hs is None else d_hs
            d_c_last = tf.zeros_like(c_last) if d_c_last is None else d_c_last
            return backward(
                d_hs, d_c_last, recurrent, projection, h0, c0, keep, hs, gates, cs, unroll
            )

        return (hs, c_last), grad

    return run(xw, recurrent, projection, h0, c0)


def _detached(*tensors):
    """The inputs with their gradient stopped.

    Inside `tf.custom_gradient`, a tape that is recording would otherwise
    make TensorFlow call the differentiable variant of the inner function,
    whose saved intermediates (TensorLists) cannot leave an XLA function.
    """
    import tensorflow as tf

    return [tf.stop_gradient(t) for t in tensors]


def _forward_loop(xw, recurrent, projection, h0, c0, keep, act, rec_act, save, unroll):
    """The recurrence over time, given xw = x @ kernel + bias [T, B, 4U].

    Each loop iteration runs `unroll` time steps (a divisor of T).

    Returns:
        (hs [T, B, P], c after the last step [B, U], and with `save` the
        activated gates (i, f, g, o) [T, B, 4U] and the c states [T, B, U]
        for the hand-written backward pass; else None, None).
    """
    import tensorflow as tf

    steps = tf.shape(xw)[0]
    xs = tf.TensorArray(xw.dtype, size=steps, element_shape=xw.shape[1:]).unstack(xw)
    keeps = None
    if keep is not None:
        keeps = tf.TensorArray(tf.bool, size=steps, element_shape=keep.shape[1:])
        keeps = keeps.unstack(keep)

    def array(like, width):
        shape = tf.TensorShape([like.shape[0], width])
        return tf.TensorArray(like.dtype, size=steps, element_shape=shape)

    units = int(recurrent.shape[1]) // 4
    arrays = (array(h0, int(projection.shape[1])),)
    if save:
        arrays += (array(c0, 4 * units), array(c0, units))

    def step(t, h, c, arrays):
        z = xs.read(t) + tf.matmul(h, recurrent)
        z_i, z_f, z_g, z_o = tf.split(z, 4, axis=-1)
        i, f, o = rec_act(z_i), rec_act(z_f), rec_act(z_o)
        g = act(z_g)
        c_new = f * c + i * g
        h_new = tf.matmul(o * act(c_new), projection)
        if keeps is not None:
            k = keeps.read(t)
            c_new = tf.where(k, c_new, c)
            h_new = tf.where(k, h_new, h)
        out = (arrays[0].write(t, h_new),)
        if save:
            out += (
                arrays[1].write(t, tf.concat([i, f, g, o], axis=-1)),
                arrays[2].write(t, c_new),
            )
        return h_new, c_new, out

    def body(t, h, c, arrays):
        for j in range(unroll):
            h, c, arrays = step(t + j, h, c, arrays)
        return t + unroll, h, c, arrays

    _, _, c_last, arrays = tf.while_loop(
        lambda t, *_: t < steps,
        body,
        (tf.constant(0), h0, c0, arrays),
        maximum_iterations=steps // unroll,
    )
    if save:
        return arrays[0].stack(), c_last, arrays[1].stack(), arrays[2].stack()
    return arrays[0].stack(), c_last, None, None


def _backward_loop(
    d_hs, d_c_last, recurrent, projection, h0, c0, keep, hs, gates, cs, unroll
):
    """Gradients of the tanh/sigmoid recurrence, as cuDNN computes them.

    Per step (backwards): dh_new = (dh + d_hs[t]) (masked), dm = dh_new @ P^T,
    the gate derivatives into dz [B, 4U], and dh_prev = dz @ R^T. After the
    loop: dR = H_prev^T dZ and dP = M^T dH_new over all T*B rows, with
    M = o * tanh(c). At a masked step dh_new, dz are zero and dh, dc pass
    through unchanged.

    Returns:
        (d_xw [T, B, 4U], d_recurrent, d_projection, d_h0, d_c0).
    """
    import tensorflow as tf

    dtype = gates.dtype
    steps = tf.shape(gates)[0]
    units = int(recurrent.shape[1]) // 4
    c_prev = tf.concat([c0[None], cs[:-1]], axis=0)
    tanh_c = tf.tanh(cs)

    def unstack(x):
        ta = tf.TensorArray(x.dtype, size=steps, element_shape=x.shape[1:])
        return ta.unstack(x)

    d_hs_ta, gates_ta, c_prev_ta, tanh_ta = (
        unstack(d_hs),
        unstack(gates),
        unstack(c_prev),
        unstack(tanh_c),
    )
    keep_ta = unstack(tf.cast(keep, dtype)) if keep is not None else None
    dz_ta = tf.TensorArray(dtype, size=steps, element_shape=gates.shape[1:])
    dh_new_ta = tf.TensorArray(dtype, size=steps, element_shape=hs.shape[1:])

    def step(t, dh, dc, dz_ta, dh_new_ta):
        dh_total = dh + d_hs_ta.read(t)
        if keep_ta is not None:
            m = keep_ta.read(t)
            dh_new, dc_in = dh_total * m, dc * m
        else:
            dh_new, dc_in = dh_total, dc
        dm = tf.matmul(dh_new, projection, transpose_b=True)
        i, f, g, o = tf.split(gates_ta.read(t), 4, axis=-1)
        a = tanh_ta.read(t)
        d_o = dm * a
        dc_new = dc_in + dm * o * (1 - a * a)
        dz = tf.concat(
            [
                dc_new * g * i * (1 - i),
                dc_new * c_prev_ta.read(t) * f * (1 - f),
                dc_new * i * (1 - g * g),
                d_o * o * (1 - o),
            ],
            axis=-1,
        )
        dh_prev = tf.matmul(dz, recurrent, transpose_b=True)
        dc_prev = dc_new * f
        if keep_ta is not None:
            dh_prev = dh_prev + dh_total * (1 - m)
            dc_prev = dc_prev + dc * (1 - m)
        return dh_prev, dc_prev, dz_ta.write(t, dz), dh_new_ta.write(t, dh_new)

    def body(k, dh, dc, dz_ta, dh_new_ta):
        for j in range(unroll):
            dh, dc, dz_ta, dh_new_ta = step(steps - 1 - k - j, dh, dc, dz_ta, dh_new_ta)
        return k + unroll, dh, dc, dz_ta, dh_new_ta

    _, d_h0, d_c0, dz_ta, dh_new_ta = tf.while_loop(
        lambda k, *_: k < steps,
        body,
        (tf.constant(0), tf.zeros_like(h0), d_c_last, dz_ta, dh_new_ta),
        maximum_iterations=steps // unroll,
    )
    dz = dz_ta.stack()
    dh_new = dh_new_ta.stack()
    proj = int(hs.shape[-1])
    h_prev = tf.concat([h0[None], hs[:-1]], axis=0)
    d_recurrent = tf.matmul(
        tf.reshape(h_prev, [-1, proj]), tf.reshape(dz, [-1, 4 * units]), transpose_a=True
    )
    gated = gates[..., 3 * units :] * tanh_c
    d_projection = tf.matmul(
        tf.reshape(gated, [-1, units]), tf.reshape(dh_new, [-1, proj]), transpose_a=True
    )
    return dz, d_recurrent, d_projection, d_h0, d_c0


# -- the fast path (torch) ----------------------------------------------------------


def _static_shapes(result, sequences, cell, return_sequences):
    """`result` with the static shapes Keras' own loop gives (a graph-mode
    while loop loses the time dimension; an unrolled layer after this one
    needs it)."""
    last_output, outputs, (h, c) = result
    batch, steps = sequences.shape[0], sequences.shape[1]
    p, u = cell.proj_size, cell.units
    for tensor, shape in (
        (last_output, [batch, p]),
        (outputs, [batch, steps if return_sequences else 1, p]),
        (h, [batch, p]),
        (c, [batch, u]),
    ):
        if hasattr(tensor, "set_shape"):
            tensor.set_shape(shape)
    return last_output, outputs, [h, c]


def _tf_op_reason(cell) -> str | None:
    """Why rnnfuse's cuDNN op (TensorFlow) cannot run this cell, or None.

    It runs when a GPU is visible and the op is loaded, the activations are
    tanh/sigmoid, the dtype is float16/bfloat16/float32, and the call is not
    being compiled by XLA (the op has no XLA kernel; the XLA loop runs then).
    """
    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.base import StackSpec

    if not _tanh_sigmoid(cell):
        return "cuDNN computes only tanh and sigmoid activations"
    if not tf_backend.is_available():
        return "no GPU"
    if tf_backend.in_xla_context():
        return "the call is compiled by XLA"
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    if str(cell.compute_dtype) == "float64":
        return "float64"
    if not tf_backend.op_loaded():
        return "rnnfuse's cuDNN op is not loaded"
    return tf_backend.unsupported_reason(stack, cell.compute_dtype)


def _tf_op_inner_loop(cell, sequences, initial_state, *, training, go_backwards, return_sequences):
    """What `keras.layers.RNN.inner_loop` returns (no mask), from one
    RnnfuseCudnnRnn call with `proj_size` (TensorFlow backend)."""
    import tensorflow as tf

    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.base import StackSpec

    x = sequences
    if training and 0.0 < cell.dropout < 1.0:
        # The mask RNN.call drew for this call (one per sequence).
        x = x * tf.expand_dims(cell.get_dropout_mask(sequences[:, 0, :]), axis=1)
    if go_backwards:
        x = tf.reverse(x, [1])  # no mask: every row is full length
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    outputs, final_h, final_c = tf_backend.run_stack(
        x,
        stack=stack,
        initial_h=[initial_state[0]],
        initial_c=[initial_state[1]],
    )
    h_last, c_last = final_h[0], final_c[0]
    last_output = outputs[:, -1]
    if not return_sequences:
        outputs = last_output[:, None, :]
    return last_output, outputs, [h_last, c_last]


def _torch_reason(cell) -> str | None:
    """Why PyTorch's proj_size LSTM cannot compute this cell exactly, or None."""
    from rnnfuse.backends import torch as torch_backend
    from rnnfuse.backends.base import StackSpec

    if not _tanh_sigmoid(cell):
        return "PyTorch's fused LSTM computes only tanh and sigmoid activations"
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    return torch_backend.unsupported_reason(stack, cell.compute_dtype)


def _torch_inner_loop(
    cell,
    sequences,
    initial_state,
    mask,
    *,
    training,
    go_backwards,
    zero_output_for_mask,
    return_sequences,
):
    """What `keras.layers.RNN.inner_loop` returns, from one `torch._VF.lstm`
    call with `proj_size` (`rnnfuse.backends.torch.run_stack`).

    `mask`, when given, is right-padded with no empty row. `run_stack`
    returns outputs with zeros past each length, and with `reverse` each
    sequence reversed within its length; Keras' loop instead reverses the
    whole padded sequence, so a go_backwards layer first sees the padding
    (state kept, output zeros) and then the valid steps. Rearranged here
    to Keras' processing order; a masked step's output is zeros with
    `zero_output_for_mask`, else the last unmasked output (zeros before the
    first one), as in `_fast_inner_loop`.

    Returns:
        (last_output [B, P], outputs [B, T, P] (or [B, 1, P] when not
        return_sequences, as the generic loop), [h [B, P], c [B, U]]).
    """
    import torch

    from rnnfuse.backends import torch as torch_backend
    from rnnfuse.backends.base import StackSpec

    x = sequences
    if training and 0.0 < cell.dropout < 1.0:
        # The mask RNN.call drew for this call (one per sequence).
        x = x * ops.expand_dims(cell.get_dropout_mask(sequences[:, 0, :]), axis=1)
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    outputs, final_h, final_c = torch_backend.run_stack(
        x,
        stack=stack,
        initial_h=[initial_state[0]],
        initial_c=[initial_state[1]],
        mask=mask,
        reverse=go_backwards,
    )
    h_last, c_last = final_h[0], final_c[0]
    if mask is not None:
        keep = ops.convert_to_tensor(mask).to(device=outputs.device, dtype=torch.bool)
        if go_backwards:
            # Valid step j (processed j-th) moves to position T - length + j.
            steps = outputs.shape[1]
            lengths = keep.sum(dim=1, keepdim=True)  # [B, 1]
            source = torch.arange(steps, device=outputs.device)[None] - (steps - lengths)
            gathered = torch.gather(
                outputs, 1, source.clamp(min=0)[:, :, None].expand_as(outputs)
            )
            outputs = torch.where(
                (source >= 0)[:, :, None], gathered, torch.zeros_like(gathered)
            )
        elif not zero_output_for_mask:
            # Past its length a row repeats its last output: the final h.
            outputs = torch.where(keep[:, :, None], outputs, h_last[:, None, :])
    last_output = outputs[:, -1]
    if not return_sequences:
        outputs = last_output[:, None, :]
    return last_output, outputs, [h_last, c_last]
