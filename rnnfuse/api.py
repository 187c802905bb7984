"""The public entry points: `analyze(model)` and `optimize(model)`.

Both check their arguments at the boundary and raise clear errors (the
argument, what was received, the fix); nothing deeper raises on bad input.

Example:

    >>> import keras, numpy as np, rnnfuse
    >>> inp = keras.Input((12, 8))
    >>> x = keras.layers.LSTM(16, return_sequences=True)(inp)
    >>> x = keras.layers.LSTM(16)(x)
    >>> model = keras.Model(inp, keras.layers.Dense(2)(x))
    >>> fast = rnnfuse.optimize(model)
    >>> [type(l).__name__ for l in fast.layers[1:]]
    ['FusedRNN', 'Dense']
    >>> x = np.random.rand(3, 12, 8).astype("float32")
    >>> bool(np.allclose(fast(x), model(x), atol=1e-6))
    True
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from rnnfuse.passes.graph import build_layer_graph, is_graph_model
from rnnfuse.passes.planning import plan_fusion
from rnnfuse.passes.rewrite import FusionWarning, rewrite_model
from rnnfuse.reasons import Reason
from rnnfuse.recurrent import is_recurrent
from rnnfuse.report import FusionReport

__all__ = ["analyze", "optimize"]


def analyze(
    model: keras.Model, *, min_layers: int = 2, absorb_dropout: bool = True
) -> FusionReport:
    """Finds the runs of `model`'s recurrent layers that fuse, and why not.

    Args:
        model: a built Keras 3 Sequential or Functional model (nested
            sub-models are looked into).
        min_layers: the least number of recurrent levels worth fusing.
        absorb_dropout: treat a `Dropout` layer between two recurrent layers
            as cuDNN's between-layer dropout instead of a break in the run.

    Returns:
        A `FusionReport`: `.groups` (one `FusionGroup` per run) and
        `.skipped` (every other recurrent layer -> the reason).

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` is not built, or `min_layers` is not a positive
            integer.
    """
    _check_model(model, "analyze")
    _check_min_layers(min_layers, "analyze")
    if not is_graph_model(model):
        return _subclassed_report(model)
    graph = build_layer_graph(model)
    return plan_fusion(
        graph,
        model_name=model.name,
        min_layers=min_layers,
        absorb_dropout=absorb_dropout,
    )


def optimize(
    model: keras.Model, *, min_layers: int = 2, absorb_dropout: bool = True
) -> keras.Model:
    """A new model in which each fusable run is one `FusedRNN` layer.

    The new model has the same inputs, outputs and output names; every layer
    outside a run is the same object, and the runs' layers live inside the
    fused layers, so all variables are shared: training the new model
    trains `model`. `model` itself is not changed.

    Args:
        model: a built Keras 3 Sequential or Functional model.
        min_layers: the least number of recurrent levels worth fusing.
        absorb_dropout: see `analyze`.

    Returns:
        The optimized `keras.Model` (for a subclassed model: `model` itself,
        with a warning, since its call() cannot be rewritten).

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: `model` is not built, or `min_layers` is not valid.
    """
    _check_model(model, "optimize")
    _check_min_layers(min_layers, "optimize")
    if not is_graph_model(model):
        warnings.warn(
            f"rnnfuse.optimize: '{model.name}' is a subclassed model "
            f"({type(model).__name__}); rnnfuse cannot see inside its call(), "
            "so it is returned unchanged. Build it as a Functional or "
            "Sequential model to fuse its recurrent layers.",
            FusionWarning,
            stacklevel=2,
        )
        return model
    graph = build_layer_graph(model)
    report = plan_fusion(
        graph,
        model_name=model.name,
        min_layers=min_layers,
        absorb_dropout=absorb_dropout,
    )
    return rewrite_model(model, report, graph)


def _check_model(model: Any, fn: str) -> None:
    if not isinstance(model, keras.Model):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        hint = "pass a keras.Model (Keras 3)"
        if isinstance(model, keras.layers.Layer):
            hint = "wrap the layer in a model, e.g. keras.Sequential([keras.Input(shape), layer])"
        elif type(model).__module__.startswith(("tf_keras", "keras.engine", "tensorflow.python.keras")):
            hint = (
                "this is a tf.keras (Keras 2) model; rnnfuse works on Keras 3 "
                "models (`import keras`, keras>=3.10)"
            )
        elif isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            hint = "load it first: keras.models.load_model(path)"
        raise TypeError(
            f"rnnfuse.{fn}(model) expects a keras.Model; received {kind}. Fix: {hint}."
        )
    if not model.built:
        raise ValueError(
            f"rnnfuse.{fn}(model): model '{model.name}' is not built, so its "
            "layers have no weights or shapes yet. Fix: start it with "
            "keras.Input(shape), call model.build(input_shape), or call it "
            "once on a batch."
        )


def _check_min_layers(min_layers: Any, fn: str) -> None:
    if isinstance(min_layers, bool) or not isinstance(min_layers, int) or min_layers < 1:
        raise ValueError(
            f"rnnfuse.{fn}: min_layers must be a positive integer; received "
            f"{min_layers!r}."
        )


def _subclassed_report(model: keras.Model) -> FusionReport:
    skipped = {}
    for layer in model._flatten_layers(include_self=False):
        if is_recurrent(layer):
            skipped[layer.name] = Reason(
                "subclassed_model",
                f"it is inside the subclassed model '{model.name}', whose "
                "call() rnnfuse cannot see into",
            )
    note = (
        f"'{model.name}' is a subclassed model ({type(model).__name__}): rnnfuse "
        "cannot see inside its call(). Build it as a Functional or Sequential "
        "model to fuse its recurrent layers."
    )
    return FusionReport(
        model_name=model.name, groups=(), skipped=skipped, notes=(note,)
    )
