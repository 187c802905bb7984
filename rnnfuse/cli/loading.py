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
import sys
from typing import Any, Sequence

from rnnfuse.cli.errors import CliError, _first_line

__all__ = ["check_source", "load_model"]


# -- loading a model -----------------------------------------------------------


def load_model(
    source: str,
    *,
    imports: Sequence[str] = (),
    safe_mode: bool = True,
    mixed_precision: bool = False,
):
    """The built keras.Model that `source` names (a `.keras`/`.h5` file, or
    `module:function` / `file.py:function`), after importing `imports`;
    `mixed_precision` rebuilds it under `mixed_float16`. Every failure is a
    one-line `CliError` saying what and how to fix it."""
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


def check_source(source: str) -> None:
    """A one-line `CliError` where `source` is neither an existing file nor
    module:function: checked before keras (and TensorFlow) is imported, so a
    mistyped path fails at once."""
    if not os.path.exists(source) and not _looks_like_function(source):
        raise CliError(_missing_source(source))


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
    """`rnnfuse.model_files.read_model`, its errors as one-line CliErrors
    (with the command line's own fixes where it has other options)."""
    from rnnfuse.model_files import ModelFileError, read_model

    try:
        return read_model(path, compile=False, safe_mode=safe_mode)
    except FileNotFoundError as err:
        raise CliError(_missing_source(path)) from err
    except ModelFileError as err:
        raise CliError(_file_error(err)) from err


def _file_error(err) -> str:
    """The CLI's line for a `ModelFileError`: its problem and a fix in
    terms of this command's options."""
    fix = err.fix
    if err.kind == "custom_class":
        name = err.details.get("name")
        module = err.details.get("module") or "MODULE"
        what = f"the custom object '{name}'" if name else "a custom object"
        return (
            f"'{err.path}' uses {what}, which is not registered in this "
            f"process. Fix: pass --import {module} (the module that defines "
            "it, decorated with @keras.saving.register_keras_serializable()), "
            "or pass module:function that builds or loads the model"
        )
    if err.kind == "unsafe":
        fix = "if you trust the file, pass --unsafe"
    elif err.kind == "weights_only":
        fix = (
            "pass module:function that builds the model and calls "
            "model.load_weights(...), or save it with model.save('model.keras')"
        )
    elif err.kind == "saved_model":
        fix = (
            "save the model with model.save('model.keras') in the code that "
            "builds it, or pass module:function"
        )
    elif err.kind == "load_failed":
        fix += " (run with --debug for the traceback)"
    return f"{err.problem}. Fix: {fix}"


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
