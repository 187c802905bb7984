"""Where Keras' own recurrent layers cannot run under JAX on this device.

Keras' JAX `lstm()` (and `bidirectional_lstm()`) call jaxlib's cuDNN RNN
(`jax.experimental.rnn.lstm`) for an LSTM with no mask, tanh and sigmoid,
a bias, `unroll=False`, `use_cudnn` "auto" or True and no
`recurrent_dropout`, when JAX's default device is a GPU. That lowering
(`jaxlib/gpu_rnn.py`) takes float32 and float64 only: in float16 or
bfloat16 (`mixed_float16`, `mixed_bfloat16`) it raises "Unknown output
type float16" when the step is compiled, after Keras' own fallback, so
the original model cannot run. `keras_path_fails` says so for a fusion
group; the planner then fuses it without timing (nothing to lose).

Example (no GPU here: Keras' layers run their loop):

    >>> import keras
    >>> from rnnfuse.passes import build_layer_graph, plan_fusion
    >>> m = keras.Sequential([keras.Input((6, 3)), keras.layers.LSTM(4, dtype="mixed_float16")])
    >>> (group,) = plan_fusion(build_layer_graph(m), model_name=m.name).groups
    >>> keras_path_fails(group, "float16") is None
    True
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import jax
import keras

__all__ = ["keras_path_fails", "keras_sees_gpu", "takes_jaxlib_cudnn"]

# The dtypes jaxlib's cuDNN RNN lowering takes.
JAXLIB_CUDNN_DTYPES = ("float32", "float64")


def keras_sees_gpu() -> bool:
    """Keras' own test (`keras/src/backend/jax/rnn.py`): JAX's default device is a GPU."""
    return jax.default_backend() == "gpu"


def _keras_lstm_calls_cudnn() -> bool:
    """Whether this Keras' JAX `lstm()` has a cuDNN path at all (3.13 and
    older always raise NotImplementedError: their `cudnn_ok` takes *args)."""
    try:
        # The module (the package's `rnn` attribute is its function of that name).
        keras_rnn = importlib.import_module("keras.src.backend.jax.rnn")
        return "activation" in inspect.signature(keras_rnn.cudnn_ok).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def _keras_activations() -> tuple[tuple, tuple]:
    """(tanh, sigmoid) functions Keras' `cudnn_ok` accepts, as it lists them."""
    import jax.numpy as jnp
    from keras import activations, ops

    return (activations.tanh, jnp.tanh, ops.tanh), (activations.sigmoid, ops.sigmoid)


def takes_jaxlib_cudnn(layer: Any) -> bool:
    """Whether Keras' LSTM `layer`, called with no mask, asks jaxlib's cuDNN
    RNN for its steps (the module doc's conditions but the device)."""
    lstm = keras.layers.LSTM
    if not isinstance(layer, lstm) or type(layer).inner_loop is not lstm.inner_loop:
        return False
    cell = layer.cell
    tanh, sigmoid = _keras_activations()
    return (
        layer.use_cudnn in ("auto", True)
        and not cell.recurrent_dropout
        and cell.activation in tanh
        and cell.recurrent_activation in sigmoid
        and not layer.unroll
        and cell.use_bias
    )


def _keras_layers(view: Any) -> tuple:
    layer = view.layer
    if isinstance(layer, keras.layers.Bidirectional):
        return (layer.forward_layer, layer.backward_layer)
    return (layer,)


def keras_path_fails(group: Any, dtype: str, masked: bool | None = None) -> str | None:
    """Why `group`'s original layers cannot run in `dtype` on this device
    (the module doc), or None where they can. `masked`: whether its input
    carries a mask (None: read from the model's graph); a masked LSTM runs
    Keras' loop, which takes every dtype."""
    from rnnfuse.recurrent import called_with_mask

    dtype = str(dtype)
    if dtype in JAXLIB_CUDNN_DTYPES or not keras_sees_gpu() or not _keras_lstm_calls_cudnn():
        return None
    if masked is None:
        masked = bool(group.views) and called_with_mask(group.views[0].layer)
    if masked:
        return None
    failing = [layer for view in group.views for layer in _keras_layers(view)
               if takes_jaxlib_cudnn(layer)]
    if not failing:
        return None
    return (f"Keras' cuDNN LSTM on JAX fails in {dtype} (jaxlib's cuDNN RNN takes "
            "float32 and float64 only); fused on rnnfuse's cuDNN core")
