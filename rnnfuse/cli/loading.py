"""Loading MODEL for the command line: a .keras file or `module:function`.

Every failure becomes a `CliError` with one line saying what and how to fix.

Example:

    >>> _looks_like_function("models.py:build")
    True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import zipfile
from typing import Any, Sequence

from rnnfuse.cli.errors import CliError, _first_line

__all__ = ["load_model"]


# -- loading a model -----------------------------------------------------------


def load_model(
    source: str,
    *,
    imports: Sequence[str] = (),
    safe_mode: bool = True,
    mixed_precision: bool = False,
):
    """The keras.Model that `source` names, or a one-line `CliError`.

    Args:
        source: a `.keras` (or legacy `.h5`) file, or `module:function` /
            `path/to/file.py:function` returning a built keras.Model.
        imports: modules to import first (names or .py paths).
        safe_mode: Keras' `safe_mode` for loading files.
        mixed_precision: rebuild the model under `mixed_float16`.

    Returns:
        A built keras.Model.

    Raises:
        CliError: what went wrong and how to fix it.
    """
    import keras

    for module in imports:
        _import_module(module, what="--import")
    policy = keras.config.dtype_policy()
    try:
        if mixed_precision:
            keras.config.set_dtype_policy("mixed_float16")
        from_file = os.path.exists(source)
        if from_file:
            model = _load_file(source, safe_mode)
        elif _looks_like_function(source):
            model = _call_function(source)
        else:
            raise CliError(_missing_source(source))
    finally:
        keras.config.set_dtype_policy(policy)
    if not model.built:
        raise CliError(
            f"the model from '{source}' is not built, so its layers have no "
            "weights or shapes yet. Fix: start it with keras.Input(shape) or "
            "call model.build(input_shape) before returning it"
        )
    if mixed_precision and from_file:
        # A saved file pins every layer's policy; a function already built
        # its layers under the global mixed_float16 policy set above.
        model = _to_mixed_precision(model, source)
    return model


def _looks_like_function(source: str) -> bool:
    module, sep, fn = source.rpartition(":")
    return bool(sep and module and fn.isidentifier())


def _missing_source(source: str) -> str:
    if source.endswith((".keras", ".h5", ".hdf5")) or os.sep in source or "/" in source:
        return (
            f"no such file: '{source}'. Fix: check the path (relative paths "
            f"start at {os.getcwd()})"
        )
    return (
        f"'{source}' is neither an existing file nor module:function. Fix: "
        "pass a model saved with model.save('model.keras'), or "
        "module:function naming a function that returns the model"
    )


def _load_file(path: str, safe_mode: bool):
    import keras

    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            raise CliError(
                f"'{path}' is a TensorFlow SavedModel directory, which Keras 3 "
                "cannot load as a model. Fix: save the model with "
                "model.save('model.keras') in the code that builds it, or pass "
                "module:function"
            )
        raise CliError(
            f"'{path}' is a directory, not a model file. Fix: pass the "
            ".keras file inside it"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise CliError(
            f"cannot read '{path}': {err.strerror or err}. Fix: check its "
            "permissions (it must be readable by you)"
        ) from err
    is_zip = zipfile.is_zipfile(path)
    is_h5 = head.startswith(b"\x89HDF")
    if path.endswith(".weights.h5"):
        raise CliError(
            f"'{path}' holds weights only, not a model. Fix: pass "
            "module:function that builds the model and calls "
            "model.load_weights(...), or save it with model.save('model.keras')"
        )
    if not (is_zip or is_h5):
        raise CliError(
            f"'{path}' is not a Keras model file (a .keras file is a zip "
            "archive). Fix: save the model with model.save('model.keras')"
        )
    if is_zip:
        with zipfile.ZipFile(path) as archive:
            if "config.json" not in archive.namelist():
                raise CliError(
                    f"'{path}' is a zip archive but not a Keras model (it has "
                    "no config.json). Fix: save the model with "
                    "model.save('model.keras')"
                )
        if not path.endswith(".keras"):
            raise CliError(
                f"'{path}' looks like a Keras model, but Keras only loads it "
                "with a .keras extension. Fix: rename it to end in .keras"
            )
    elif not path.endswith((".h5", ".hdf5")):
        raise CliError(
            f"'{path}' is an HDF5 file; Keras loads legacy models only from "
            "files ending in .h5. Fix: rename it, or re-save it with "
            "model.save('model.keras')"
        )
    try:
        model = keras.saving.load_model(path, compile=False, safe_mode=safe_mode)
    except Exception as err:  # noqa: BLE001 - translated into one line below
        raise CliError(_load_error(path, err)) from err
    if not isinstance(model, keras.Model):
        raise CliError(f"'{path}' holds a {type(model).__name__}, not a keras.Model")
    return model


def _load_error(path: str, err: BaseException) -> str:
    chain = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = "\n".join(str(e) for e in chain)
    found = re.search(r"Could not locate (?:class|function) '([^']+)'", text)
    if found or "register_keras_serializable" in text:
        name = found.group(1) if found else "a custom object"
        module = _module_of(path, name) or "MODULE"
        return (
            f"'{path}' uses the custom object '{name}', which is not "
            f"registered in this process. Fix: pass --import {module} (the "
            "module that defines it, decorated with "
            "@keras.saving.register_keras_serializable()), or pass "
            "module:function that builds or loads the model"
        )
    if "safe_mode" in text or "unsafe_deserialization" in text:
        return (
            f"'{path}' contains a Lambda layer with Python code, which Keras "
            "refuses to load by default. Fix: if you trust the file, pass "
            "--unsafe"
        )
    return (
        f"could not load '{path}' as a Keras model: {_first_line(err)}. Fix: "
        "check that Keras 3 saved it with model.save(...) (run with --debug "
        "for the traceback)"
    )


def _module_of(path: str, class_name: str) -> str | None:
    """The module a .keras archive records for `class_name`, if any."""
    from rnnfuse.persistence import archived_configs

    modules = [c["module"] for c in archived_configs(path, class_name) if c.get("module")]
    return modules[0] if modules else None


def _import_module(spec: str, *, what: str):
    """Imports a module by name (from the cwd) or from a .py path."""
    if spec.endswith(".py") or "/" in spec or os.sep in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise CliError(
                f"{what}: no such Python file: '{spec}'. Fix: check the path "
                f"(relative paths start at {os.getcwd()})"
            )
        name = os.path.splitext(os.path.basename(path))[0]
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(name, None)
            raise CliError(
                f"{what}: running '{spec}' failed: {type(err).__name__}: "
                f"{_first_line(err)}. Fix: correct that code (--debug shows the traceback)"
            ) from err
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        if err.name and (spec == err.name or spec.startswith(err.name + ".")):
            raise CliError(
                f"{what}: cannot import module '{spec}': not found from "
                f"{os.getcwd()}. Fix: run rnnfuse from the folder that holds "
                "it, or give its path, like path/to/file.py"
            ) from err
        raise CliError(
            f"{what}: importing '{spec}' failed: {_first_line(err)}. Fix: "
            "install the missing package"
        ) from err
    except Exception as err:
        raise CliError(
            f"{what}: importing '{spec}' failed: {type(err).__name__}: "
            f"{_first_line(err)}. Fix: correct that code (--debug shows the traceback)"
        ) from err


def _call_function(source: str):
    import keras

    module_spec, _, fn_name = source.rpartition(":")
    module = _import_module(module_spec, what=f"MODEL '{source}'")
    fn = getattr(module, fn_name, None)
    if fn is None:
        names = sorted(
            n for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        known = ", ".join(names[:8]) or "none"
        raise CliError(
            f"'{module_spec}' has no function '{fn_name}'. Fix: name one of "
            f"its functions ({known})"
        )
    if not callable(fn):
        raise CliError(
            f"'{source}' is a {type(fn).__name__}, not a function. Fix: name "
            "a function that returns the model"
        )
    try:
        model = fn()
    except TypeError as err:
        if "required" in str(err) and "argument" in str(err):
            raise CliError(
                f"calling {source}() failed: {_first_line(err)}. Fix: the "
                "function must take no required arguments"
            ) from err
        raise CliError(
            f"calling {source}() failed: TypeError: {_first_line(err)}. Fix: "
            "correct that code (--debug shows the traceback)"
        ) from err
    except Exception as err:
        raise CliError(
            f"calling {source}() failed: {type(err).__name__}: "
            f"{_first_line(err)}. Fix: correct that code (--debug shows the traceback)"
        ) from err
    if not isinstance(model, keras.Model):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        hint = "return the keras.Model itself"
        if isinstance(model, keras.layers.Layer):
            hint = "wrap the layer in a model, e.g. keras.Sequential([keras.Input(shape), layer])"
        elif kind.startswith(("tf_keras", "keras.engine", "tensorflow.python.keras")):
            hint = "build it with Keras 3 (`import keras`), not tf.keras"
        raise CliError(f"{source}() returned {kind}, not a keras.Model. Fix: {hint}")
    return model


def _to_mixed_precision(model, source: str):
    """`model` rebuilt with every float32 layer under mixed_float16."""
    import keras

    config = keras.saving.serialize_keras_object(model)
    if not _set_mixed_policies(config):
        return model
    try:
        new = keras.saving.deserialize_keras_object(config)
        new.set_weights(model.get_weights())
    except Exception as err:  # noqa: BLE001 - translated into one line
        raise CliError(
            f"--mixed-precision: could not rebuild the model from '{source}' "
            f"under mixed_float16 ({type(err).__name__}: {_first_line(err)}). "
            "Fix: build it after keras.config.set_dtype_policy('mixed_float16') "
            "in a module:function"
        ) from err
    return new


def _set_mixed_policies(node: Any) -> int:
    """Rewrites float32 DTypePolicy entries of a config; returns how many."""
    count = 0
    if isinstance(node, dict):
        if node.get("class_name") == "DTypePolicy" and node.get("config", {}).get("name") == "float32":
            node["config"]["name"] = "mixed_float16"
            return 1
        for value in node.values():
            count += _set_mixed_policies(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            count += _set_mixed_policies(value)
    return count
