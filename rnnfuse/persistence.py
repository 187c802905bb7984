"""Saving, loading and un-fusing optimized models.

`rnnfuse.optimize` returns an `OptimizedModel` (Functional) or an
`OptimizedSequential`: the plain Keras classes with their weight-file
methods in the original layout (below) and a clear error for a forced
`jit_compile=True` while cuDNN may run, registered as
"rnnfuse>OptimizedModel" / "rnnfuse>OptimizedSequential" so
`keras.models.load_model` rebuilds them (with rnnfuse imported).

What goes where:

| call                                 | file layout                          |
|--------------------------------------|--------------------------------------|
| `optimized.save("m.keras")`          | the optimized structure (FusedRNN)   |
| `keras.models.load_model("m.keras")` | the same fused model back            |
| `optimized.save_weights(path)`       | the *original* model's layout        |
| `optimized.load_weights(path)`       | the original layout, or a fused .keras |
| `restore(optimized)`                 | a plain model; `save()` needs no rnnfuse |

Why weight files use the original layout. Keras 3 names each variable in
a weights file by where it sits in the object tree (`saving_lib._walk_saveable`):
a model's `layers` list becomes ``layers/<class name in snake case>[_k]``,
numbered per class in list order, then each layer's own variables
(``vars/0``, ``vars/1``, ...) and its tracked sublayers (``cell/vars/0``).
The original LSTM stack ``[lstm, lstm, dense, lstm]`` writes
``layers/lstm``, ``layers/lstm_1``, ``layers/dense``, ``layers/lstm_2``;
the optimized ``[fused_rnn, dense, lstm]`` writes
``layers/fused_rnn/fused_layers/lstm``, ..., ``layers/dense`` and
``layers/lstm`` for what was ``lstm_2``, so a file of one would load into
the wrong layers of the other (silently, when shapes agree). No per-layer
hook can fix that: the names are given by the parent's list, not by
`FusedRNN.save_own_variables`. So the optimized model's `save_weights` and
`load_weights` go through `restore(self)`, a plain model over the same
layer objects in the original order: its weight paths are the original
model's, and loading into it assigns the shared variables. Files are then
interchangeable in both directions, and a weights checkpoint written while
training the optimized model (`ModelCheckpoint(save_weights_only=True)`)
loads into the original model code.

Example:

    >>> import keras, numpy as np, rnnfuse, tempfile, os
    >>> model = keras.Sequential([keras.Input((6, 3)),
    ...     keras.layers.GRU(4, return_sequences=True), keras.layers.GRU(4)])
    >>> fast = rnnfuse.optimize(model)
    >>> plain = rnnfuse.restore(fast)
    >>> [type(l).__name__ for l in plain.layers]
    ['GRU', 'GRU']
    >>> path = os.path.join(tempfile.mkdtemp(), "w.weights.h5")
    >>> fast.save_weights(path); model.load_weights(path)
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zipfile
from typing import Any

import keras
from keras import tree
from keras.src.models.functional import Functional

from rnnfuse.fused import FusedRNN, call_members, first_call_kwargs
from rnnfuse.reasons import FusionWarning
from rnnfuse.tuning import first_batch

__all__ = [
    "OptimizedModel",
    "OptimizedSequential",
    "as_optimized",
    "load_model",
    "restore",
]

_FUSED_NAME = "rnnfuse>FusedRNN"


class _OptimizedMixin:
    """save_weights/load_weights in the original model's file layout.

    Also refuses `jit_compile=True` with a clear error while a FusedRNN may
    run its cuDNN kernel (Keras alone would only warn that the model "doesn't
    support" it and quietly run without XLA).
    """

    def _cudnn_layers(self) -> list[str]:
        """Names of the FusedRNN layers that would run the fused kernel here."""
        return [
            layer.name
            for layer in self._flatten_layers(include_self=False)
            if isinstance(layer, FusedRNN) and layer.fused_call_blocks_xla
        ]

    @property
    def jit_compile(self):
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        if value is True:
            cudnn = self._cudnn_layers()
            if cudnn:
                raise ValueError(
                    f"jit_compile=True: model '{self.name}' runs its fused "
                    f"layers ({', '.join(repr(n) for n in cudnn)}) as cuDNN "
                    "kernels on this machine, and XLA cannot compile cuDNN "
                    "ops (nor Keras' own cuDNN LSTM/GRU). Fix: compile with "
                    "jit_compile='auto' (the default) or False."
                )
        keras.Model.jit_compile.fset(self, value)

    def compile(self, *args, **kwargs):
        # Remember whether XLA was left to Keras ("auto"): first-batch tuning
        # compares against the original layers the way Keras would run them.
        state = getattr(self, "_rnnfuse_autotune", None)
        if state is not None:
            state.jit_auto = kwargs.get("jit_compile", "auto") == "auto"
        return super().compile(*args, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.fit`, with plans first chosen on the first batch
        (`rnnfuse.tuning.first_batch`; nothing is timed without a GPU)."""
        first_batch.prepare(self, x, batch_size, training=True)
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.evaluate`, with plans first chosen on the first batch."""
        first_batch.prepare(self, x, batch_size, training=False)
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        """`keras.Model.predict`, with plans first chosen on the first batch."""
        first_batch.prepare(self, x, batch_size, training=False)
        return super().predict(x, batch_size, *args, **kwargs)

    def compile_from_config(self, config):
        # A model compiled with jit_compile=True where no GPU was visible
        # may be loaded where one is: fall back to "auto" rather than fail.
        if (
            isinstance(config, dict)
            and config.get("jit_compile") is True
            and self._cudnn_layers()
        ):
            config = {**config, "jit_compile": "auto"}
        # Keras' own compile_from_config, which skips a model whose compile()
        # is overridden (ours only records the jit_compile argument).
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    # Variables in the original model's order. Keras numbers an optimizer's
    # slot variables by the position of their model variable in the list the
    # optimizer was built with (`model.trainable_variables`), and a weights
    # file stores them by number; so the optimized model lists its variables
    # as the original model does (as `restore(self)` does), and the optimizer
    # state in a weights file means the same in both models. `get_weights()`
    # and `set_weights()` are then interchangeable too.

    @property
    def weights(self):
        return _in_original_order(self, super().weights)

    @property
    def variables(self):
        return _in_original_order(self, super().variables)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the weights as the original (unfused) model would.

        The file (weights and, once built, the optimizer's state) loads into
        the original model, into `rnnfuse.restore(self)` and into this
        model. Arguments are those of `keras.Model.save_weights`.
        """
        return _weights_model(self).save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads weights saved by the original model or by this model.

        A `.keras` archive saved from an optimized model (it holds FusedRNN
        layers) loads as Keras loads it; every other file (`.weights.h5`,
        `.weights.json`, a `.keras` of the original model, a legacy `.h5`)
        is read in the original layout. Arguments are those of
        `keras.Model.load_weights`.
        """
        if _is_fused_archive(filepath):
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        return _weights_model(self).load_weights(
            filepath, skip_mismatch=skip_mismatch, **kwargs
        )


def _weights_model(model) -> keras.Model:
    """`_restore(model)` holding `model`'s optimizer, for weight files.

    Keras writes (and reads) a model's optimizer state with its weights
    (``optimizer/vars/<i>``); the plain stand-in shares the optimizer
    object, so both go through it. As in Keras, an optimizer that is not
    built yet has no state to load (Keras warns and skips it).
    """
    plain = _restore(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        plain.optimizer = optimizer
    return plain


def _in_original_order(model, variables: list) -> list:
    """`variables` sorted as the original (restored) model lists them."""
    rank = model.__dict__.get("_rnnfuse_rank")
    if rank is None:
        if model.__dict__.get("_rnnfuse_ranking") or not model.built:
            return variables
        object.__setattr__(model, "_rnnfuse_ranking", True)
        try:
            plain = _restore(model)
            rank = {id(v): i for i, v in enumerate(plain.variables)}
        except Exception:  # noqa: BLE001 - a model restore cannot rebuild keeps its order
            rank = {}
        finally:
            object.__setattr__(model, "_rnnfuse_ranking", False)
        object.__setattr__(model, "_rnnfuse_rank", rank)
    if not rank:
        return variables
    last = len(rank)
    order = sorted(range(len(variables)), key=lambda i: (rank.get(id(variables[i]), last), i))
    return [variables[i] for i in order]


@keras.saving.register_keras_serializable(package="rnnfuse")
class OptimizedModel(_OptimizedMixin, Functional):
    """A Functional model made by `rnnfuse.optimize`.

    Exactly a Functional model (same constructor, config and `.keras`
    format) whose `save_weights`/`load_weights` use the original model's
    file layout (see the module docstring).
    """


@keras.saving.register_keras_serializable(package="rnnfuse")
class OptimizedSequential(_OptimizedMixin, keras.Sequential):
    """A Sequential model made by `rnnfuse.optimize`; see `OptimizedModel`."""


def as_optimized(model: keras.Model, like: keras.Model | None = None) -> keras.Model:
    """`model` (a rewritten Sequential or Functional) as an Optimized* model.

    Builds an `OptimizedSequential` / `OptimizedModel` over the same layers
    and graph, with `model`'s name, trainable flag and compile() arguments.
    When `like` (the original model) was built under a `tf.distribute`
    strategy and none is active now, the new model is made under that
    strategy's scope, so `optimize` may be called outside it. Any other kind
    of model is returned as it is.
    """
    if isinstance(model, (OptimizedModel, OptimizedSequential)):
        return model
    if not isinstance(model, keras.Sequential) and type(model) is not Functional:
        return model
    with _strategy_scope(like):
        if isinstance(model, keras.Sequential):
            layers = list(model.layers)
            first = model._layers[0] if model._layers else None
            if isinstance(first, keras.layers.InputLayer):
                # The same InputLayer: sub-models cut from this model's
                # layers see one input, as in the original.
                layers.insert(0, first.output)
            new = OptimizedSequential(layers, name=model.name, trainable=model.trainable)
        else:
            new = OptimizedModel(
                model.input, model.output, name=model.name, trainable=model.trainable
            )
        copy_compile(model, new)
    return new


def _strategy_scope(like: Any):
    """The scope of `like`'s distribution strategy, if it has one and none is active."""
    from rnnfuse.backends import get_backend

    return get_backend().strategy_scope(getattr(like, "_distribute_strategy", None))


def restore(model: keras.Model) -> keras.Model:
    """A plain Keras model with the original layers of an optimized model.

    Every `FusedRNN` (also inside nested models) is replaced by the layers
    it holds, called as the original model called them (absorbed Dropout
    layers back in place). The layers are the same objects, so the result
    has the current (trained) weights and shares them with `model`. Its
    config names only Keras classes (except rnnfuse's own layers, such as
    `rnnfuse.layers.ProjectedLSTM`, which need `import rnnfuse` to load):
    `restore(fast).save("m.keras")` loads where rnnfuse is not installed. `model`'s compile() arguments are
    carried over (a fresh optimizer with the same config).

    Args:
        model: a model returned by `rnnfuse.optimize` (or loaded from its
            `.keras` file); any other Sequential or Functional model is
            rebuilt as a plain model with the same layers.

    Returns:
        A `keras.Sequential` or Functional `keras.Model`.

    Raises:
        TypeError: `model` is not a Sequential or Functional Keras model.

    Example:

        >>> import keras, rnnfuse
        >>> m = keras.Sequential([keras.Input((5, 2)),
        ...     keras.layers.LSTM(3, return_sequences=True),
        ...     keras.layers.LSTM(3)])
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


def load_model(
    filepath: Any,
    *,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model` with errors that say what is wrong.

    Loads any `.keras` file (optimized or not: importing rnnfuse registers
    its classes). A missing file, a directory (a SavedModel), a weights-only
    file, a truncated or corrupt archive, or a custom class that is not
    registered raise one clear error instead of Keras' internal one.

    Args:
        filepath: path of a `.keras` file.
        custom_objects: as for `keras.models.load_model`.
        compile: as for `keras.models.load_model`.
        safe_mode: as for `keras.models.load_model`.

    Returns:
        The loaded model.

    Raises:
        FileNotFoundError: nothing at `filepath`.
        ValueError: the file is not a loadable `.keras` model, with the
            reason and the fix.
    """
    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"rnnfuse.load_model: no file at '{path}'. Fix: check the path "
            "(a model saved with model.save('name.keras'))."
        )
    if os.path.isdir(path):
        raise ValueError(
            f"rnnfuse.load_model: '{path}' is a directory (a SavedModel "
            "export?), not a .keras file. Fix: load a file written by "
            "model.save('name.keras'); serve a SavedModel with "
            "tf.saved_model.load or keras.layers.TFSMLayer."
        )
    if path.endswith((".weights.h5", ".weights.json")):
        raise ValueError(
            f"rnnfuse.load_model: '{path}' holds weights only, no model. "
            "Fix: build the model in code and call model.load_weights(path)."
        )
    if path.endswith(".keras"):
        _check_archive(path)
    try:
        return keras.models.load_model(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        )
    except Exception as err:  # noqa: BLE001 - re-raised with the path and a fix
        match = re.search(r"Could not locate (?:class|function) '([^']+)'", str(err))
        if match:
            raise ValueError(
                f"rnnfuse.load_model: '{path}' uses the custom class or function "
                f"{_describe_class(path, match.group(1))}, which is not "
                "registered in this process. Fix: import the module that "
                "defines it (registered with "
                "@keras.saving.register_keras_serializable), or pass "
                "custom_objects={registered name: object}."
            ) from err
        raise ValueError(
            f"rnnfuse.load_model: could not load '{path}' "
            f"({type(err).__name__}: {_first_line(err)}). The file may be "
            "truncated or written by an incompatible Keras version. Fix: "
            "save the model again with model.save(path)."
        ) from err


# -- restoring ---------------------------------------------------------------


def _holds_fused(model: Any) -> bool:
    return any(
        isinstance(layer, FusedRNN) for layer in model._flatten_layers(include_self=False)
    )


def _restore(model: Any) -> keras.Model:
    """`model` with every FusedRNN expanded, as plain Keras classes."""
    replacements = {}
    for layer in model.layers:
        if isinstance(layer, (keras.Sequential, Functional)) and _holds_fused(layer):
            replacements[id(layer)] = _restore(layer)
    if isinstance(model, keras.Sequential):
        return _restore_sequential(model, replacements)
    return _restore_functional(model, replacements)


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
    rest = {"training": first["training"]} if "training" in first else {}
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


# -- archives ----------------------------------------------------------------


def _is_fused_archive(filepath: Any) -> bool:
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


def _check_archive(path: str) -> None:
    """Raises a clear ValueError unless `path` is a readable .keras archive."""
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"rnnfuse.load_model: '{path}' is not a .keras archive (not a zip "
            "file); it may be truncated or corrupt. Fix: save the model again "
            "with model.save(path)."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            missing = {"config.json", "model.weights.h5"} - set(archive.namelist())
            if missing:
                raise ValueError(
                    f"rnnfuse.load_model: '{path}' is a zip file but not a "
                    f".keras model ({', '.join(sorted(missing))} missing). Fix: "
                    "save the model again with model.save(path)."
                )
            json.loads(archive.read("config.json"))
            bad = archive.testzip()
    except (zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        bad, detail = True, f"{type(err).__name__}: {_first_line(err)}"
    else:
        detail = f"damaged member {bad}"
    if bad:
        raise ValueError(
            f"rnnfuse.load_model: '{path}' is corrupt ({detail}). Fix: save "
            "the model again with model.save(path)."
        )


def archived_configs(path: str, class_name: str) -> list[dict]:
    """Every config node of class `class_name` in a .keras archive, in
    order ([] when the archive or its config.json cannot be read)."""
    found: list = []

    def visit(node):
        if isinstance(node, dict):
            if node.get("class_name") == class_name:
                found.append(node)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    try:
        with zipfile.ZipFile(path) as archive:
            visit(json.loads(archive.read("config.json")))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return []
    return found


def _describe_class(path: str, name: str) -> str:
    """'name' plus the registered name and module the archive records for it."""
    found = archived_configs(path, name)
    if not found:
        return f"'{name}'"
    entry = found[0]
    registered = entry.get("registered_name") or name
    module = entry.get("module")
    where = f", defined in module '{module}'" if module else ""
    return f"'{name}' (registered name '{registered}'{where})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""
