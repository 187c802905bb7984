"""Un-fusing optimized models, and their files in the original layout.

`restore(optimized)` gives a plain Keras model of the original layers (the
same objects, so the current weights). An optimized model's `save`,
`save_weights`, `load_weights` and `export` go through it, so its files
are the original model's (plain Keras loads them), unless `fused=True`.
Keras names a weight file's variables by their place in the object tree,
so the optimized tree would write names the original cannot read.

>>> import keras, rnnfuse, tempfile, os
>>> model = keras.Sequential([keras.Input((6, 3)),
...     keras.layers.GRU(4, return_sequences=True), keras.layers.GRU(4)])
>>> path = os.path.join(tempfile.mkdtemp(), "w.weights.h5")
>>> rnnfuse.optimize(model).save_weights(path); model.load_weights(path)
"""

from __future__ import annotations

import os
import warnings
import zipfile
from typing import Any

import keras
from keras import tree
from keras.src.models.functional import Functional

from rnnfuse.fused import FusedRNN, call_members, first_call_kwargs, fused_layers
from rnnfuse.passes.rewrite import keep_dtype_policy
from rnnfuse.reasons import FusionWarning

__all__ = [
    "copy_compile",
    "export_model",
    "holds_fused",
    "in_original_order",
    "is_fused_archive",
    "plain_twin",
    "portable_model",
    "restore",
    "weights_model",
]

_FUSED_NAME = "rnnfuse>FusedRNN"


def restore(model: keras.Model) -> keras.Model:
    """A plain Keras model with the original layers of an optimized model.

    Every `FusedRNN` (nested models too) is replaced by the layers it holds,
    called as the original model called them; they are the same objects
    (current weights, shared), the config names only Keras' and rnnfuse's own
    layer classes, and the compile() arguments carry over. Any other
    Sequential or Functional model is rebuilt over the same layers; anything
    else raises TypeError.

    Example:
        >>> import keras, rnnfuse
        >>> m = keras.Sequential([keras.Input((5, 2)),
        ...     keras.layers.LSTM(3, return_sequences=True), keras.layers.LSTM(3)])
        >>> plain = rnnfuse.restore(rnnfuse.optimize(m))
        >>> [a is b for a, b in zip(plain.layers, m.layers)]
        [True, True]
    """
    if not isinstance(model, (keras.Sequential, Functional)):
        raise TypeError(
            "rnnfuse.restore(model) expects a Sequential or Functional "
            "keras.Model (what rnnfuse.optimize returns); received "
            f"{type(model).__module__}.{type(model).__qualname__}. Fix: pass "
            "the optimized model."
        )
    restored = _restore(model)
    copy_compile(model, restored)
    return restored


# -- restoring ---------------------------------------------------------------


def holds_fused(model: Any) -> bool:
    """Whether `model` (or a model nested in it) holds a FusedRNN."""
    return bool(fused_layers(model))


def _restore(model: Any) -> keras.Model:
    """`model` with every FusedRNN expanded, as plain Keras classes."""
    replacements = {}
    for layer in model.layers:
        if isinstance(layer, (keras.Sequential, Functional)) and holds_fused(layer):
            replacements[id(layer)] = _restore(layer)
    if isinstance(model, keras.Sequential):
        return keep_dtype_policy(model, _restore_sequential(model, replacements))
    return keep_dtype_policy(model, _restore_functional(model, replacements))


def _restore_sequential(model, replacements) -> keras.Sequential:
    layers = []
    for layer in model.layers:
        if isinstance(layer, FusedRNN):
            layers.extend(layer.members())
        else:
            layers.append(replacements.get(id(layer), layer))
    first = model._layers[0] if model._layers else None
    if isinstance(first, keras.layers.InputLayer):
        layers.insert(0, _input_like(first.output, first))
    return keras.Sequential(layers, name=model.name, trainable=model.trainable)


def _restore_functional(model, replacements) -> keras.Model:
    inputs = tree.map_structure(
        lambda x: _input_like(x, getattr(x, "_keras_history", [None])[0]), model.input
    )

    def call_fn(layer, *args, **kwargs):
        if isinstance(layer, FusedRNN):
            return _call_members(layer, args, kwargs)
        return layer(*args, **kwargs)

    outputs = model._run_through_graph(
        inputs,
        operation_fn=lambda layer: replacements.get(id(layer), layer),
        call_fn=call_fn,
    )
    return keras.Model(inputs, outputs, name=model.name, trainable=model.trainable)


def _call_members(fused: FusedRNN, args, kwargs):
    """Calls the layers of `fused` as the run's first layer was called."""
    first = first_call_kwargs(args, kwargs)
    # The later layers take the first one's mask, as FusedRNN's own call of
    # the layers does: inside a run every layer returns sequences, which
    # keeps the mask; the graph then records the calls as the original did.
    rest = {k: first[k] for k in ("training", "mask") if k in first}
    return call_members(fused.members(), args[0], first=first, rest=rest)


def _input_like(tensor, input_layer) -> Any:
    name = getattr(input_layer, "name", None) or tensor.name
    return keras.Input(
        batch_shape=tensor.shape,
        dtype=tensor.dtype,
        sparse=getattr(tensor, "sparse", False),
        name=name,
    )


def copy_compile(model, new) -> None:
    """Carry `model`'s compile() arguments over to `new` (a fresh optimizer
    with the same config), as clone_model does; a warning where they do
    not round-trip. The one compile-copy of rewrite and saving."""
    if not getattr(model, "compiled", False):
        return
    try:
        new.compile_from_config(model.get_compile_config())
    except Exception as err:  # noqa: BLE001 - custom losses may not round-trip
        warnings.warn(
            f"rnnfuse: could not copy compile() arguments to '{new.name}' "
            f"({type(err).__name__}: {err}); call compile() on it",
            FusionWarning,
            stacklevel=3,
        )



# -- weight files ------------------------------------------------------------


def plain_twin(model) -> keras.Model:
    """`_restore(model)`, built once per structure of `model` and kept on it
    (untracked): each save, export or weights file would otherwise call the
    original layers again, adding a node to every one of them each time."""
    key = tuple(id(layer) for layer in model._flatten_layers(include_self=False))
    cached = model.__dict__.get("_rnnfuse_twin")
    if cached is None or cached[0] != key:
        cached = (key, _restore(model))
        object.__setattr__(model, "_rnnfuse_twin", cached)
    return cached[1]


def weights_model(model) -> keras.Model:
    """`plain_twin(model)` holding `model`'s optimizer, so a weight file
    carries the optimizer state as Keras writes it."""
    plain = plain_twin(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        plain.optimizer = optimizer
    return plain


def export_model(model) -> keras.Model:
    """What an optimized model's `export` exports: `plain_twin(model)`, marked
    as called where `model` was (Keras' ONNX export asks for a model that has
    been called)."""
    plain = plain_twin(model)
    plain._called = getattr(model, "_called", False)
    return plain


def portable_model(model) -> keras.Model:
    """What an optimized model's `save` writes: `plain_twin(model)` with
    `model`'s compile() arguments and optimizer; jit_compile as given, so
    "auto" resolves for the original layers when the file is loaded."""
    plain = plain_twin(model)
    config = getattr(model, "_compile_config", None)
    if getattr(model, "compiled", False) and config is not None:
        arguments = dict(config.config)
        arguments["jit_compile"] = model.__dict__.get(
            "_rnnfuse_jit_compile", arguments.get("jit_compile", "auto")
        )
        plain.compile(**arguments)
        plain.optimizer = model.optimizer
    return plain


def in_original_order(model, variables: list) -> list:
    """`variables` sorted as the original (restored) model lists them (each list's order once)."""
    rank = model.__dict__.get("_rnnfuse_rank")
    if rank is None:
        if model.__dict__.get("_rnnfuse_ranking") or not model.built:
            return variables
        object.__setattr__(model, "_rnnfuse_ranking", True)
        try:
            plain = plain_twin(model)
            rank = {id(v): i for i, v in enumerate(plain.variables)}
        except Exception:  # noqa: BLE001 - a model restore cannot rebuild keeps its order
            rank = {}
        finally:
            object.__setattr__(model, "_rnnfuse_ranking", False)
        object.__setattr__(model, "_rnnfuse_rank", rank)
    if not rank:
        return variables
    key = tuple(map(id, variables))
    orders = model.__dict__.get("_rnnfuse_orders")
    if orders is None or len(orders) > 16:
        orders = {}
        object.__setattr__(model, "_rnnfuse_orders", orders)
    order = orders.get(key)
    if order is None:
        last = len(rank)
        order = sorted(range(len(key)), key=lambda i: (rank.get(key[i], last), i))
        order = orders[key] = () if order == sorted(order) else tuple(order)
    return [variables[i] for i in order] if order else variables


def is_fused_archive(filepath: Any) -> bool:
    """Whether `filepath` is a .keras archive of a model with FusedRNN layers."""
    try:
        path = os.fspath(filepath)
    except TypeError:
        return False
    if not path.endswith(".keras") or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        try:
            return _FUSED_NAME.encode() in archive.read("config.json")
        except KeyError:
            return False
