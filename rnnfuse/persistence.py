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
    "ModelFileError",
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


class ModelFileError(ValueError):
    """A file `load_model` cannot load as a Keras model: what and the fix.

    `str(error)` is one sentence pair, "rnnfuse.load_model: <problem>.
    Fix: <fix>."; the fields let a caller (the `rnnfuse` command) word the
    fix for its own options.
    """

    def __init__(self, kind: str, path: str, problem: str, fix: str, **details: Any):
        # A short name for the problem: "directory", "saved_model",
        # "unreadable", "weights_only", "not_a_model_file", "not_keras_zip",
        # "needs_keras_extension", "needs_h5_extension", "corrupt",
        # "custom_class", "unsafe", "not_a_model" or "load_failed".
        self.kind = kind
        # The path as given.
        self.path = path
        # What is wrong and how to fix it, each without a final period.
        self.problem = problem
        self.fix = fix
        # custom_class: `name`, and `module` where the archive records it.
        self.details = details
        super().__init__(f"rnnfuse.load_model: {problem}. Fix: {fix}.")


def load_model(
    filepath: Any,
    *,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model` with errors that say what is wrong.

    Loads any `.keras` file (optimized or not: importing rnnfuse registers
    its classes) and legacy `.h5` models. A missing file, a directory (a
    SavedModel), an unreadable file, a weights-only file, a file that is no
    Keras model or has the wrong extension, a truncated or corrupt archive,
    a Lambda layer refused by `safe_mode`, or a custom class that is not
    registered raise one clear error instead of Keras' internal one. The
    `rnnfuse` command loads files through this too.

    Args:
        filepath: path of a `.keras` file (or a legacy `.h5` model).
        custom_objects: as for `keras.models.load_model`.
        compile: as for `keras.models.load_model`.
        safe_mode: as for `keras.models.load_model`.

    Returns:
        The loaded model.

    Raises:
        FileNotFoundError: nothing at `filepath`.
        ModelFileError: (a ValueError) the file is not a loadable Keras
            model, with the reason and the fix.
    """
    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"rnnfuse.load_model: no file at '{path}'. Fix: check the path "
            "(a model saved with model.save('name.keras'))."
        )
    _check_file(path)
    try:
        model = keras.models.load_model(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        )
    except Exception as err:  # noqa: BLE001 - re-raised with the path and a fix
        raise _load_error(path, err) from err
    if not isinstance(model, keras.Model):
        raise ModelFileError(
            "not_a_model", path,
            f"'{path}' holds a {type(model).__name__}, not a keras.Model",
            "save the model itself with model.save('name.keras')",
        )
    return model


def _check_file(path: str) -> None:
    """Raises ModelFileError unless `path` looks like a loadable model file."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            raise ModelFileError(
                "saved_model", path,
                f"'{path}' is a directory (a TensorFlow SavedModel), which "
                "Keras 3 cannot load as a model",
                "save the model with model.save('name.keras') in the code that "
                "builds it; serve a SavedModel with tf.saved_model.load or "
                "keras.layers.TFSMLayer",
            )
        raise ModelFileError(
            "directory", path, f"'{path}' is a directory, not a model file",
            "pass the .keras file inside it",
        )
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise ModelFileError(
            "unreadable", path, f"cannot read '{path}': {err.strerror or err}",
            "check its permissions (it must be readable by you)",
        ) from err
    if path.endswith((".weights.h5", ".weights.json")):
        raise ModelFileError(
            "weights_only", path, f"'{path}' holds weights only, no model",
            "build the model in code and call model.load_weights(path)",
        )
    is_zip = zipfile.is_zipfile(path)
    if not is_zip and not head.startswith(b"\x89HDF"):
        raise ModelFileError(
            "not_a_model_file", path,
            f"'{path}' is not a Keras model file (not a .keras archive, which "
            "is a zip file, nor HDF5); it may be truncated or corrupt",
            "save the model again with model.save('name.keras')",
        )
    if is_zip:
        _check_archive(path)
        if not path.endswith(".keras"):
            raise ModelFileError(
                "needs_keras_extension", path,
                f"'{path}' looks like a Keras model, but Keras only loads it "
                "with a .keras extension",
                "rename it to end in .keras",
            )
    elif not path.endswith((".h5", ".hdf5")):
        raise ModelFileError(
            "needs_h5_extension", path,
            f"'{path}' is an HDF5 file; Keras loads legacy models only from "
            "files ending in .h5",
            "rename it, or re-save it with model.save('name.keras')",
        )


def _load_error(path: str, err: BaseException) -> ModelFileError:
    """Keras' loading error `err` (and its causes) as one ModelFileError."""
    chain: list = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = "\n".join(str(e) for e in chain)
    match = re.search(r"Could not locate (?:class|function) '([^']+)'", text)
    if match or "register_keras_serializable" in text:
        name = match.group(1) if match else None
        modules = [c["module"] for c in archived_configs(path, name) if c.get("module")] if name else []
        described = _describe_class(path, name) if name else "a custom class or function"
        return ModelFileError(
            "custom_class", path,
            f"'{path}' uses the custom class or function {described}, which "
            "is not registered in this process",
            "import the module that defines it (registered with "
            "@keras.saving.register_keras_serializable), or pass "
            "custom_objects={registered name: object}",
            name=name, module=modules[0] if modules else None,
        )
    if "safe_mode" in text or "unsafe_deserialization" in text:
        return ModelFileError(
            "unsafe", path,
            f"'{path}' contains a Lambda layer with Python code, which Keras "
            "refuses to load with safe_mode=True",
            "if you trust the file, pass safe_mode=False",
        )
    return ModelFileError(
        "load_failed", path,
        f"could not load '{path}' ({type(err).__name__}: {_first_line(err)}); "
        "the file may be truncated or written by an incompatible Keras version",
        "save the model again with model.save(path)",
    )


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
    """Raises a clear ModelFileError unless zip file `path` is a readable
    .keras archive (config.json and model.weights.h5, intact)."""
    try:
        with zipfile.ZipFile(path) as archive:
            missing = {"config.json", "model.weights.h5"} - set(archive.namelist())
            if missing:
                raise ModelFileError(
                    "not_keras_zip", path,
                    f"'{path}' is a zip file but not a .keras model "
                    f"({', '.join(sorted(missing))} missing)",
                    "save the model again with model.save('name.keras')",
                )
            json.loads(archive.read("config.json"))
            bad = archive.testzip()
    except (zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        bad, detail = True, f"{type(err).__name__}: {_first_line(err)}"
    else:
        detail = f"damaged member {bad}"
    if bad:
        raise ModelFileError(
            "corrupt", path, f"'{path}' is corrupt ({detail})",
            "save the model again with model.save(path)",
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
