"""The `rnnfuse` command line: what fuses in a model, how fast, how exact.

Commands (MODEL is a `.keras` file, or `module:function` / `path/to/file.py:fn`
naming a function that takes no arguments and returns a built keras.Model):

    rnnfuse inspect MODEL [--json] [--plot FILE.png]
    rnnfuse bench   MODEL [--batch N] [--steps T] [--train] [--mixed-precision]
                          [--repeats K] [--warmup W] [--plan P] [--tune] [--json]
    rnnfuse check   MODEL [--tolerance X] [--batch N] [--steps T] [--seed S]
                          [--mixed-precision] [--plan P] [--json]

Options every command takes: `--min-layers N`, `--import MODULE` (import a
module first, for example the one that registers a model's custom layers;
repeatable), `--unsafe` (load a `.keras` file with `safe_mode=False`, for
Lambda layers you trust) and `--debug` (warnings, and the traceback of an
error). `--plan auto|fused|per-layer` picks how each group runs: auto is
`rnnfuse.optimize`'s own choice.

Exit codes: 0 success; 1 `check` found a difference above the tolerance;
2 a problem with the input (a missing or unreadable file, a file that is not
a Keras model, custom objects that cannot be found, a bad option, a function
that does not return a model): one line on stderr saying what and how to fix
it; 3 an unexpected internal error (also one line; `--debug` shows the
traceback). TensorFlow may print its own start-up lines on stderr first.

Random inputs (`bench`, `check`) follow each model input's shape and dtype:
the batch size from `--batch`; the time axis (axis 1) from the input's shape,
or from `--steps` where the shape leaves it open; floats are standard
normal; integer inputs that feed an `Embedding` get token ids below its
`input_dim` (from 1 when `mask_zero=True`, and then right-padded with 0 to
random lengths, so masks take the sequence-length path).

`bench` and `check` run on the TensorFlow and torch Keras backends.

Example:

    >>> from rnnfuse.cli import main
    >>> main(["inspect", "examples/text_classifier.py:build_model", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
import zipfile
from typing import Any, Sequence

__all__ = ["CliError", "load_model", "main", "random_inputs"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

# Default `check` tolerances (max abs difference), by compute dtype.
DEFAULT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


class CliError(Exception):
    """A problem with what the user passed: one line, what and how to fix."""


# -- entry point ---------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code.

    Args:
        argv: the arguments after the program name (default: sys.argv[1:]).

    Returns:
        0 on success, 1 when `check` finds a difference above the tolerance,
        2 for a problem with the input, 3 for an unexpected error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help, --version
        return int(done.code or 0)
    except CliError as err:
        return _fail(err, debug, EXIT_USAGE)
    try:
        with _quiet(debug):
            return args.run(args)
    except CliError as err:
        return _fail(err, debug, EXIT_USAGE)
    except KeyboardInterrupt:
        print("rnnfuse: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the last resort: one line, no traceback
        wrapped = CliError(
            f"unexpected {type(err).__name__}: {_first_line(err)}. This may be "
            "a bug in rnnfuse: run again with --debug and report the traceback"
        )
        wrapped.__cause__ = err
        return _fail(wrapped, debug, EXIT_INTERNAL)


def _fail(err: CliError, debug: bool, code: int) -> int:
    if debug:
        traceback.print_exception(err.__cause__ or err)
    print(f"rnnfuse: error: {_one_line(str(err))}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _quiet(debug: bool):
    """Hides Python warnings from Keras/TF (shown with --debug)."""
    with warnings.catch_warnings():
        if not debug:
            warnings.simplefilter("ignore")
        yield


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- arguments -----------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option as a one-line CliError."""

    def error(self, message):
        raise CliError(f"{message}. Run '{self.prog} --help' for the options")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, received {text!r}"
        )
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected a non-negative number such as 1e-4, received {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    from rnnfuse import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or module:function (or path/to/file.py:function) "
        "returning a built keras.Model",
    )
    common.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a name or path/to/file.py) first, e.g. the one "
        "that registers the model's custom layers; repeatable",
    )
    common.add_argument(
        "--unsafe",
        action="store_true",
        help="load the .keras file with safe_mode=False (Lambda layers); only "
        "for files you trust",
    )
    common.add_argument(
        "--min-layers",
        type=_positive_int,
        default=2,
        metavar="N",
        help="the least number of recurrent levels worth fusing (default 2)",
    )
    plan = argparse.ArgumentParser(add_help=False)
    plan.add_argument(
        "--plan",
        choices=("auto", "fused", "per-layer"),
        default="auto",
        help="how each group runs: optimize()'s choice (auto, the default), "
        "every group fused whole (fused), or its original layers (per-layer)",
    )
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show Python warnings, and the traceback of an error",
    )

    parser = _Parser(
        prog="rnnfuse",
        description="See which stacked recurrent layers of a Keras 3 model "
        "fuse into one cuDNN call, how much faster that is here, and that "
        "it computes the same thing.",
        epilog="examples:\n"
        "  rnnfuse inspect model.keras --plot graph.png\n"
        "  rnnfuse check model.keras\n"
        "  rnnfuse bench model.keras --batch 32 --steps 200 --train\n"
        "  rnnfuse inspect examples/speech_encoder.py:build_model\n\n"
        "exit codes: 0 ok, 1 check above tolerance, 2 bad input (one line on "
        "stderr),\n3 internal error. Run 'rnnfuse COMMAND --help' for a "
        "command's options.\nDocs: docs/guide.md (the fusion rules), "
        "docs/api.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rnnfuse {__version__}")
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="list the fused groups and why each other recurrent layer is not fused",
    )
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--plot", metavar="FILE.png", help="draw the layer graph, fused groups highlighted"
    )
    inspect.set_defaults(run=_cmd_inspect)

    bench = commands.add_parser(
        "bench",
        parents=[common, plan],
        help="time the original and the optimized model on this machine",
    )
    bench.add_argument("--batch", type=_positive_int, default=32, metavar="N", help="batch size (default 32)")
    bench.add_argument(
        "--steps",
        type=_positive_int,
        metavar="T",
        help="time steps, for inputs whose time dimension is None",
    )
    bench.add_argument(
        "--train",
        action="store_true",
        help="time a training step (forward and gradients) instead of inference",
    )
    bench.add_argument(
        "--mixed-precision",
        action="store_true",
        help="run both models under the mixed_float16 dtype policy",
    )
    bench.add_argument("--repeats", type=_positive_int, default=10, metavar="K", help="timed runs of each model (default 10)")
    bench.add_argument("--warmup", type=_positive_int, default=2, metavar="W", help="untimed runs first (default 2)")
    bench.add_argument(
        "--tune",
        action="store_true",
        help="let optimize() time each group's candidate plans on this device "
        "for this batch and length (cached on disk) instead of its rule table",
    )
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.set_defaults(run=_cmd_bench)

    check = commands.add_parser(
        "check",
        parents=[common, plan],
        help="compare outputs and gradients of the original and optimized model",
    )
    check.add_argument(
        "--tolerance",
        type=_tolerance,
        metavar="X",
        help="largest allowed max abs difference (default 1e-4; 2e-2 for float16)",
    )
    check.add_argument("--batch", type=_positive_int, default=4, metavar="N", help="batch size (default 4)")
    check.add_argument(
        "--steps",
        type=_positive_int,
        default=16,
        metavar="T",
        help="time steps, for inputs whose time dimension is None (default 16)",
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    check.add_argument(
        "--mixed-precision",
        action="store_true",
        help="run both models under the mixed_float16 dtype policy",
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    check.set_defaults(run=_cmd_check)

    parser.set_defaults(run=_no_command)
    return parser


def _no_command(args) -> int:
    raise CliError(
        "choose a command: inspect, bench or check (for example "
        "'rnnfuse inspect model.keras'). Run 'rnnfuse --help' for more"
    )


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
    found: list = []

    def visit(node):
        if isinstance(node, dict):
            if node.get("class_name") == class_name and node.get("module"):
                found.append(node["module"])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    try:
        with zipfile.ZipFile(path) as archive:
            visit(json.loads(archive.read("config.json")))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    return found[0] if found else None


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


# -- analysis helpers ----------------------------------------------------------


def _analyze(model, min_layers: int):
    import rnnfuse

    try:
        return rnnfuse.analyze(model, min_layers=min_layers)
    except (TypeError, ValueError) as err:
        raise CliError(_first_line(err, limit=600)) from err


def _optimize(model, report, args, *, tune=None, training=True):
    """(optimized model, [(group, plan name, how it was chosen)]).

    The plan of each group (fused whole, split, per layer) comes from
    `--plan`: "auto" is `optimize`'s own choice (the static rule table, or
    timing on this device with `tune`), "fused" forces every group fused.
    """
    import rnnfuse
    from rnnfuse.api import choose_plans

    forced = {"auto": None, "fused": rnnfuse.FUSED, "per-layer": rnnfuse.PER_LAYER}[args.plan]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rnnfuse.FusionWarning)
        try:
            chosen = choose_plans(model, report.groups, tune=tune, training=training, plan=forced)
            plans = {r.group.layers: r.plan for r in chosen}
            fast = rnnfuse.optimize(
                model,
                min_layers=args.min_layers,
                plan=lambda group: plans[group.layers],
            )
        except (TypeError, ValueError) as err:
            raise CliError(_first_line(err, limit=600)) from err
    for w in caught:
        if issubclass(w.category, rnnfuse.FusionWarning):
            print(f"rnnfuse: warning: {_one_line(str(w.message))}", file=sys.stderr)
    summary = [(" -> ".join(r.group.layers), r.plan.name, r.source) for r in chosen]
    return fast, summary


def _fused_layers(model) -> list:
    from rnnfuse import FusedRNN

    return [l for l in model._flatten_layers(include_self=False) if isinstance(l, FusedRNN)]


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120
    return Console(file=stream, width=width, highlight=False)


# -- random inputs -------------------------------------------------------------


def random_inputs(model, *, batch: int, steps: int | None, rng, notes: list | None = None):
    """Random arrays for every input of `model`, as `model(...)` takes them.

    Args:
        model: a built Functional or Sequential keras.Model.
        batch: the batch size.
        steps: the time steps for inputs whose axis 1 is None.
        rng: a numpy Generator.
        notes: a list that receives one line per remark (may be None).

    Returns:
        (inputs as the model takes them, list of one-line descriptions).

    Raises:
        CliError: the model has no inputs to read, or an open dimension
            other than batch and time.
    """
    import keras
    import numpy as np

    try:
        specs = list(model.inputs)
    except (AttributeError, ValueError) as err:
        raise CliError(
            f"cannot tell the input shapes of '{model.name}' "
            f"({type(model).__name__}). Fix: build it as a Functional or "
            "Sequential model starting with keras.Input(shape)"
        ) from err
    vocab = _embedding_inputs(model, specs)
    arrays, described = [], []
    for i, spec in enumerate(specs):
        name = getattr(spec, "name", f"input_{i}")
        shape = [batch]
        for axis, dim in enumerate(spec.shape[1:], start=1):
            if dim is not None:
                if axis == 1 and steps is not None and dim != steps and notes is not None:
                    notes.append(
                        f"input '{name}' has a fixed time dimension of {dim}; "
                        f"--steps {steps} does not apply to it"
                    )
                shape.append(int(dim))
            elif axis == 1:
                if steps is None:
                    raise CliError(
                        f"input '{name}' has no fixed time dimension (shape "
                        f"{tuple(spec.shape)}). Fix: pass --steps T"
                    )
                shape.append(steps)
            else:
                raise CliError(
                    f"input '{name}' has an open dimension at axis {axis} "
                    f"(shape {tuple(spec.shape)}), so rnnfuse cannot make random "
                    "inputs for it. Fix: give that dimension a size in "
                    "keras.Input(shape)"
                )
        dtype = str(spec.dtype)
        if "int" in dtype:
            high, mask_zero = vocab.get(i, (2, False))
            low = 1 if mask_zero and high > 1 else 0
            values = rng.integers(low, high, size=shape)
            text = f"{name}: {dtype} {shape}, token ids {low}..{high - 1}"
            if mask_zero and len(shape) >= 2:
                lengths = rng.integers(max(1, shape[1] // 2), shape[1] + 1, size=batch)
                for b, n in enumerate(lengths):
                    values[b, n:] = 0
                text += ", right-padded with 0"
            arrays.append(values.astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.random(shape) < 0.5)
            text = f"{name}: bool {shape}"
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
            text = f"{name}: {dtype} {shape}, standard normal"
        described.append(text)
    struct = getattr(model, "_inputs_struct", None)
    if struct is not None:
        packed = keras.tree.pack_sequence_as(struct, arrays)
    else:
        packed = arrays[0] if len(arrays) == 1 else arrays
    return packed, described


def _embedding_inputs(model, specs) -> dict[int, tuple[int, bool]]:
    """Input index -> (smallest input_dim, any mask_zero) of the Embeddings it feeds."""
    import keras

    from rnnfuse.passes.graph import build_layer_graph, is_graph_model

    if not is_graph_model(model):
        return {}
    graph = build_layer_graph(model)
    found = {}
    for i, spec in enumerate(specs):
        key = f"<input:{spec.name}>"
        if key not in graph:
            continue
        embeddings, seen, todo = [], {key}, [key]
        while todo:
            for nxt in graph.successors(todo.pop()):
                if nxt in seen:
                    continue
                seen.add(nxt)
                layer = graph.nodes[nxt].get("layer")
                if isinstance(layer, keras.layers.Embedding):
                    embeddings.append(layer)
                else:
                    todo.append(nxt)
        if embeddings:
            found[i] = (
                min(int(e.input_dim) for e in embeddings),
                any(bool(e.mask_zero) for e in embeddings),
            )
    return found


# -- backends: devices, timed steps, gradients -----------------------------------


def _engine(command: str):
    """The timing and gradient helpers of the active Keras backend."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _TensorFlowEngine()
    if backend == "torch":
        return _TorchEngine()
    raise CliError(
        f"rnnfuse {command} runs on the TensorFlow or torch Keras backend; this "
        f"process uses '{backend}'. Fix: set KERAS_BACKEND=tensorflow (or torch)"
    )


def _loss_weights(flat_shapes, seed: int) -> list:
    """One fixed random array per output, so gradients do not cancel."""
    import numpy as np

    return [
        np.random.default_rng(seed + 1 + i).standard_normal(shape).astype("float32")
        for i, shape in enumerate(flat_shapes)
    ]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_device(library: str) -> str:
    return f"CPU: {_cpu_name()}, {os.cpu_count()} cores, {library} (no GPU visible)"


class _TensorFlowEngine:
    """tf.function steps and GradientTape gradients."""

    def device(self) -> tuple[str, bool]:
        import tensorflow as tf

        library = f"TensorFlow {tf.__version__}"
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return _cpu_device(library), False
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
        except Exception:  # noqa: BLE001 - the name is cosmetic
            name = "GPU"
        cudnn = tf.sysconfig.get_build_info().get("cudnn_version")
        more = f" (+{len(gpus) - 1} more, unused)" if len(gpus) > 1 else ""
        return f"GPU: {name}{more}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu: bool) -> list[str]:
        return []

    def exact_float32(self) -> None:
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)

    def step(self, model, train: bool):
        """A compiled inference or training step; returns a float when done."""
        import keras
        import tensorflow as tf

        variables = list(model.trainable_variables)

        def loss_of(outputs):
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(outputs)]
            return tf.add_n([tf.reduce_mean(tf.square(t)) for t in flat])

        @tf.function
        def infer(inputs):
            return loss_of(model(inputs, training=False))

        @tf.function
        def train_step(inputs):
            with tf.GradientTape() as tape:
                loss = loss_of(model(inputs, training=True))
            grads = [g for g in tape.gradient(loss, variables) if g is not None]
            # Depend on every gradient so the step is timed to its end.
            return loss + tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads] or [0.0])

        fn = train_step if train and variables else infer
        return lambda inputs: float(fn(inputs).numpy())

    def outputs_and_grads(self, model, inputs, variables, seed: int):
        """Outputs (inference mode) and d(loss)/d(variables), as numpy.

        Runs eagerly: one step does not pay back tracing a graph.
        """
        import keras
        import numpy as np
        import tensorflow as tf

        with tf.GradientTape() as tape:
            outputs = model(inputs, training=False)
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(outputs)]
            weights = _loss_weights([tuple(t.shape) for t in flat], seed)
            loss = tf.add_n([tf.reduce_mean(t * w) for t, w in zip(flat, weights)])
        grads = tape.gradient(loss, variables)
        grads = [
            np.zeros(v.shape, np.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32).numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.numpy() for t in flat], grads


class _TorchEngine:
    """Eager torch steps and autograd gradients."""

    def device(self) -> tuple[str, bool]:
        import torch

        library = f"PyTorch {torch.__version__}"
        if not torch.cuda.is_available():
            return _cpu_device(library), False
        cudnn = torch.backends.cudnn.version()
        return f"GPU: {torch.cuda.get_device_name(0)}, {library}" + (f", cuDNN {cudnn}" if cudnn else ""), True

    def timing_notes(self, on_gpu: bool) -> list[str]:
        if on_gpu or "tensorflow" not in sys.modules or os.environ.get("OMP_WAIT_POLICY"):
            return []
        return [
            "TensorFlow is loaded in this process too (Keras imports it when it "
            "is installed); on a CPU its threads and PyTorch's spinning OpenMP "
            "threads can slow torch down 10-50x. Set OMP_WAIT_POLICY=PASSIVE "
            "in the environment for steady CPU timings"
        ]

    def exact_float32(self) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    @staticmethod
    def _tensors(inputs):
        import keras

        return keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)

    def step(self, model, train: bool):
        import keras
        import torch

        params = [v.value for v in model.trainable_variables]

        def run(inputs):
            x = self._tensors(inputs)
            with torch.set_grad_enabled(train):
                flat = keras.tree.flatten(model(x, training=train))
                loss = sum(torch.mean(torch.square(t.float())) for t in flat)
                if train and params:
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    loss = loss + sum(g.float().sum() for g in grads if g is not None)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return float(loss)

        return run

    def outputs_and_grads(self, model, inputs, variables, seed: int):
        import keras
        import numpy as np
        import torch

        flat = [t.float() for t in keras.tree.flatten(model(self._tensors(inputs), training=False))]
        weights = _loss_weights([tuple(t.shape) for t in flat], seed)
        loss = sum(torch.mean(t * torch.as_tensor(w, device=t.device)) for t, w in zip(flat, weights))
        params = [v.value for v in variables]
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
        grads = [
            np.zeros(tuple(v.shape), np.float32) if g is None else g.detach().float().cpu().numpy()
            for v, g in zip(variables, grads)
        ]
        return [t.detach().cpu().numpy() for t in flat], grads


def _run_model(fn, *args, command: str):
    """Calls `fn(*args)`; a failure of the user's model becomes a CliError."""
    try:
        return fn(*args)
    except CliError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's model failed on our inputs
        raise CliError(
            f"{command}: running the model on random inputs failed: "
            f"{type(err).__name__}: {_first_line(err)}. Fix: check that the "
            "model runs on inputs of these shapes (--debug shows the traceback)"
        ) from err


def _caveat(paths: dict, groups: int) -> str | None:
    """Why the two models should time alike here, if they should."""
    if not groups:
        return "nothing fuses in this model: both models run the same layers."
    if not paths:
        return "every group's plan keeps its layers: both models run the same layers."
    fallback = sorted({p[len("layers: "):] for p in paths.values() if p and p.startswith("layers: ")})
    if fallback:
        return (
            f"the fused layers ran the original layers here ({'; '.join(fallback)}), "
            "so expect about 1.0x. On a CUDA GPU each group runs as one cuDNN call."
        )
    return None


# -- inspect -------------------------------------------------------------------


def _cmd_inspect(args) -> int:
    model = load_model(args.model, imports=args.imports, safe_mode=not args.unsafe)
    report = _analyze(model, args.min_layers)
    if args.plot:
        _plot(model, report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_OK
    console = _console()
    fused, alone = report.tables()
    if report.groups:
        console.print(fused)
    else:
        console.print(f"rnnfuse: no fusable runs in '{report.model_name}'.")
    if report.skipped:
        console.print(alone)
    for note in report.notes:
        console.print(f"note: {note}")
    fused_count = sum(len(g.layers) for g in report.groups)
    console.print(
        f"{len(report.groups)} group(s) fuse {fused_count} layer(s); "
        f"{len(report.skipped)} recurrent layer(s) stay as they are."
    )
    if args.plot:
        console.print(f"layer graph drawn to {args.plot}")
    return EXIT_OK


def _plot(model, report, path: str) -> None:
    try:
        from rnnfuse.plotting import plot_layer_graph
    except ImportError as err:
        raise CliError(
            f"--plot needs matplotlib ({_first_line(err)}). Fix: pip install matplotlib"
        ) from err
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--plot: no such folder: '{folder}'. Fix: create it first")
    try:
        plot_layer_graph(model, path, report=report)
    except ValueError as err:
        raise CliError(f"--plot: {_first_line(err)}") from err
    except OSError as err:
        raise CliError(
            f"--plot: cannot write '{path}': {err.strerror or err}. Fix: pick a "
            "writable path ending in .png, .svg or .pdf"
        ) from err


# -- bench ---------------------------------------------------------------------


def _cmd_bench(args) -> int:
    import numpy as np

    import rnnfuse

    engine = _engine("bench")
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    report = _analyze(model, args.min_layers)
    notes: list[str] = []
    inputs, described = random_inputs(
        model, batch=args.batch, steps=args.steps, rng=np.random.default_rng(0), notes=notes
    )
    tune = None
    if args.tune:
        steps = next((np.shape(x)[1] for x in _flatten(inputs) if np.ndim(x) >= 2), 1)
        tune = rnnfuse.TuneShape(args.batch, int(steps))
    fast, summary = _optimize(model, report, args, tune=tune, training=args.train)
    device, on_gpu = engine.device()
    notes += engine.timing_notes(on_gpu)
    steps = {"original": engine.step(model, args.train), "optimized": engine.step(fast, args.train)}
    times = {"original": [], "optimized": []}
    with _progress(disable=args.json) as progress:
        task = progress.add_task("warming up", total=2 * (args.warmup + args.repeats))
        for _ in range(args.warmup):
            for fn in steps.values():
                _run_model(fn, inputs, command="bench")
                progress.advance(task)
        for i in range(args.repeats):
            progress.update(task, description=f"timing {i + 1}/{args.repeats}")
            # Alternate the order so drift does not favour either model.
            order = ["original", "optimized"] if i % 2 == 0 else ["optimized", "original"]
            for which in order:
                start = time.perf_counter()
                _run_model(steps[which], inputs, command="bench")
                times[which].append(1000 * (time.perf_counter() - start))
                progress.advance(task)
    paths = {l.name: l.last_path for l in _fused_layers(fast)}
    orig_ms, fast_ms = statistics.median(times["original"]), statistics.median(times["optimized"])
    result = {
        "model": model.name,
        "device": device,
        "gpu": on_gpu,
        "mode": "train" if args.train else "inference",
        "compute_dtype": _compute_dtype(model),
        "batch": args.batch,
        "inputs": described,
        "repeats": args.repeats,
        "groups": len(report.groups),
        "plans": {layers: f"{plan} ({source})" for layers, plan, source in summary},
        "fused_paths": paths,
        "original_ms": times["original"],
        "optimized_ms": times["optimized"],
        "original_median_ms": orig_ms,
        "optimized_median_ms": fast_ms,
        "speedup": orig_ms / fast_ms if fast_ms > 0 else float("nan"),
        "caveat": _caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_bench(result)
    return EXIT_OK


@contextlib.contextmanager
def _progress(disable: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console(stderr=True),
        disable=disable,
        transient=True,
    )
    with progress:
        yield progress


def _flatten(x):
    import keras

    return keras.tree.flatten(x)


def _print_header(console, result: dict) -> None:
    console.print(f"device: {result['device']}")
    for line in result["inputs"]:
        console.print(f"  input {line}")
    for layers, plan in result["plans"].items():
        console.print(f"  group {layers}: plan {plan}")
    for name, path in result["fused_paths"].items():
        console.print(f"  {name} ran: {path}")
    for note in result["notes"]:
        console.print(f"note: {note}")


def _print_bench(result: dict) -> None:
    from rich.table import Table

    console = _console()
    console.print(
        f"rnnfuse bench '{result['model']}': {result['groups']} fused group(s); "
        f"{result['mode']}, batch {result['batch']}, {result['compute_dtype']}, "
        f"{result['repeats']} timed runs each"
    )
    _print_header(console, result)
    table = Table(title="milliseconds per step")
    for col in ("model", "median", "min", "max"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for which in ("original", "optimized"):
        t = result[f"{which}_ms"]
        table.add_row(which, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}")
    console.print(table)
    console.print(f"speedup (original / optimized, medians): {result['speedup']:.2f}x")
    if not result["gpu"]:
        console.print("no GPU visible: these are CPU timings.")
    if result["caveat"]:
        console.print(result["caveat"])


# -- check ---------------------------------------------------------------------


def _cmd_check(args) -> int:
    import numpy as np

    engine = _engine("check")
    # Keep float32 matmuls exact on GPUs, so the comparison shows rnnfuse's
    # differences rather than TF32 rounding in either model.
    engine.exact_float32()
    model = load_model(
        args.model,
        imports=args.imports,
        safe_mode=not args.unsafe,
        mixed_precision=args.mixed_precision,
    )
    report = _analyze(model, args.min_layers)
    rng = np.random.default_rng(args.seed)
    notes: list[str] = []
    inputs, described = random_inputs(model, batch=args.batch, steps=args.steps, rng=rng, notes=notes)
    fast, summary = _optimize(model, report, args)
    variables = list(model.trainable_variables)
    run = engine.outputs_and_grads
    out_orig, grads_orig = _run_model(run, model, inputs, variables, args.seed, command="check")
    out_fast, grads_fast = _run_model(run, fast, inputs, variables, args.seed, command="check")
    if len(out_orig) != len(out_fast):
        raise CliError(
            f"the optimized model returns {len(out_fast)} outputs and the "
            f"original {len(out_orig)}. Fix: this is a bug in rnnfuse; please report it"
        )
    out_diff, out_scale = _max_diff(out_orig, out_fast)
    grad_diff, grad_scale, worst = 0.0, 0.0, None
    for v, a, b in zip(variables, grads_orig, grads_fast):
        d, s = _max_diff([a], [b])
        grad_scale = max(grad_scale, s)
        if worst is None or d > grad_diff:
            grad_diff, worst = d, v.path
    compute = _compute_dtype(model)
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE.get(compute, 1e-4)
    passed = out_diff <= tolerance and grad_diff <= tolerance
    paths = {l.name: l.last_path for l in _fused_layers(fast)}
    result = {
        "model": model.name,
        "device": engine.device()[0],
        "compute_dtype": compute,
        "groups": len(report.groups),
        "plans": {layers: f"{plan} ({source})" for layers, plan, source in summary},
        "fused_paths": paths,
        "inputs": described,
        "outputs_max_abs_diff": out_diff,
        "outputs_max_abs": out_scale,
        "gradients_max_abs_diff": grad_diff,
        "gradients_max_abs": grad_scale,
        "gradients_worst_variable": worst,
        "variables": len(variables),
        "tolerance": tolerance,
        "passed": passed,
        "caveat": _caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_check(result)
    return EXIT_OK if passed else EXIT_MISMATCH


def _compute_dtype(model) -> str:
    """The narrowest compute dtype among the model's layers."""
    dtypes = {str(getattr(l, "compute_dtype", "float32")) for l in model._flatten_layers(include_self=False)}
    for narrow in ("float16", "bfloat16"):
        if narrow in dtypes:
            return narrow
    return "float32"


def _max_diff(a: list, b: list) -> tuple[float, float]:
    """(max abs difference, max abs value of `a`) over paired arrays."""
    import numpy as np

    diff, scale = 0.0, 0.0
    for x, y in zip(a, b):
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x64.shape != y64.shape:
            return float("inf"), scale
        if x64.size:
            diff = max(diff, float(np.max(np.abs(x64 - y64))))
            scale = max(scale, float(np.max(np.abs(x64))))
    return diff, scale


def _print_check(result: dict) -> None:
    console = _console()
    console.print(
        f"rnnfuse check '{result['model']}': {result['groups']} fused group(s), "
        f"{result['compute_dtype']}"
    )
    _print_header(console, result)
    console.print(
        f"outputs:   max abs diff {result['outputs_max_abs_diff']:.3g} "
        f"(largest output {result['outputs_max_abs']:.3g})"
    )
    worst = f", worst {result['gradients_worst_variable']}" if result["gradients_max_abs_diff"] else ""
    console.print(
        f"gradients: max abs diff {result['gradients_max_abs_diff']:.3g} over "
        f"{result['variables']} trainable variables (largest gradient "
        f"{result['gradients_max_abs']:.3g}{worst})"
    )
    if result["caveat"]:
        console.print(result["caveat"])
    tol = result["tolerance"]
    if result["passed"]:
        console.print(f"PASS: both within the tolerance {tol:g}")
    else:
        console.print(f"FAIL: above the tolerance {tol:g}")
