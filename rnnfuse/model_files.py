"""Loading model files: `rnnfuse.load_model` (a `.keras` file, optimized
again with its optimizer state) and `read_model` (the file's model as
saved), with one `ModelFileError` naming the path, the problem and the fix
for each problem a file can have.

>>> import os, tempfile, keras, rnnfuse
>>> m = keras.Sequential([keras.Input((5, 2)), keras.layers.GRU(3)])
>>> path = os.path.join(tempfile.mkdtemp(), "m.weights.h5")
>>> m.save_weights(path)
>>> try:
...     rnnfuse.load_model(path)
... except rnnfuse.ModelFileError as err:
...     print(err.kind)
weights_only
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any

import keras

from rnnfuse.api import optimize
from rnnfuse.persistence import holds_fused, restore

__all__ = ["ModelFileError", "archived_configs", "load_model", "read_model"]


class ModelFileError(ValueError):
    """A file `load_model` / `read_model` cannot load as a Keras model:
    "rnnfuse.load_model: <problem>. Fix: <fix>."; the fields let a caller
    word the fix for its own options."""

    def __init__(self, kind: str, path: str, problem: str, fix: str, **details: Any):
        # A short name for the problem ("directory", "weights_only", "corrupt", ...).
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
    fuse: bool = True,
) -> keras.Model:
    """Loads a saved Keras model and optimizes it again, with the file's
    compile() arguments and optimizer state, so training resumes where it
    stopped. The file is an optimized model's `save`, the original model's own
    file, or rnnfuse's fused format; `custom_objects`, `compile`, `safe_mode`
    as for `keras.models.load_model`; `fuse=False` returns it as saved.

    Raises:
        FileNotFoundError: nothing at `filepath`.
        ModelFileError: the file is not a loadable Keras model.
    """
    model = read_model(
        filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
    )
    if not fuse:
        return model
    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    if holds_fused(model):
        model = restore(model)
    fast = optimize(model)
    if optimizer is not None and fast is not model:
        fast.optimizer = optimizer  # with the state read from the file
    return fast


def read_model(
    filepath: Any,
    *,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model` with errors that say what is wrong (see the
    module doc); the arguments as for `load_model`.

    Raises:
        FileNotFoundError: nothing at `filepath`.
        ModelFileError: the file is not a loadable Keras model.
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
