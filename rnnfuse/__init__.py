"""rnnfuse: run stacked Keras recurrent layers as one multi-layer cuDNN call.

    fast = rnnfuse.optimize(model)   # shares every variable with `model`

Public API: `analyze`, `optimize`, `restore`, `load_model`, `FusedRNN`,
the report records `FusionReport` and `FusionGroup`, `Reason`,
`FusionWarning` and `ModelFileError`.

`import rnnfuse` imports keras and registers rnnfuse's layers, so
`keras.models.load_model` reads rnnfuse's fused files too; a missing
backend raises an ImportError naming the extra to install. Only the
`rnnfuse` command defers that until its arguments are parsed. Messages go
to the `rnnfuse` logger (no handler added); problems with what you passed
are `FusionWarning`s.

Example:
    >>> import keras, rnnfuse
    >>> m = keras.Sequential([keras.Input((20, 4)),
    ...                       keras.layers.LSTM(8, return_sequences=True),
    ...                       keras.layers.LSTM(8)])
    >>> len(rnnfuse.analyze(m).groups)
    1

The dependency rule: the package is in layers, lowest first, and a module
imports only from its own layer or those below (tests/test_layering.py):

    records        reasons, report, report_text, plan, _version, _deps,
                   schema/, scoped
    describe/graph recurrent
    rules          rules/
    backends       backends/ (the only code importing TensorFlow, torch
                   or JAX)
    layers         fused, layers/
    passes         passes/ (run in order by passes/pipeline.py)
    tuning         tuning/, placement
    saving         optimized, persistence
    api            api, model_files, this package's __init__
    cli/render     cli/, plotting, __main__

`LAYERS` below is that list; `LAYER_EXCEPTIONS` names the imports that
break it for now, each with the reason.
"""

from __future__ import annotations

import contextvars
import os
import sys

from rnnfuse._version import __version__

__all__ = [
    "FUSED",
    "PER_LAYER",
    "CallPath",
    "OptimizeResult",
    "PathKind",
    "RewriteFailure",
    "Plan",
    "TuneShape",
    "FusedRNN",
    "FusionGroup",
    "FusionReport",
    "FusionWarning",
    "ModelFileError",
    "Reason",
    "analyze",
    "layers",
    "load_model",
    "optimize",
    "restore",
]

# The dependency rule (see the module doc): module-name prefixes per layer,
# lowest first.
LAYER_NAMES = (
    "records",
    "describe/graph",
    "rules",
    "backends",
    "layers",
    "passes",
    "tuning",
    "saving",
    "api",
    "cli/render",
)
LAYERS = (
    (
        "rnnfuse.reasons",
        "rnnfuse.report",
        "rnnfuse.report_text",
        "rnnfuse.plan",
        "rnnfuse._version",
        "rnnfuse._deps",
        "rnnfuse.schema",
        "rnnfuse.scoped",
    ),
    ("rnnfuse.recurrent",),
    ("rnnfuse.rules",),
    ("rnnfuse.backends",),
    ("rnnfuse.fused", "rnnfuse.layers"),
    ("rnnfuse.passes",),
    ("rnnfuse.tuning", "rnnfuse.placement"),
    ("rnnfuse.optimized", "rnnfuse.persistence"),
    ("rnnfuse.api", "rnnfuse.model_files"),
    ("rnnfuse.cli", "rnnfuse.plotting", "rnnfuse.__main__"),
)
# (importer, imported) -> why it is allowed for now.
LAYER_EXCEPTIONS: dict = {}


# True while this thread imports the API: a nested `rnnfuse.X` lookup then
# waits for the import instead of starting it again.
_LOADING = contextvars.ContextVar("rnnfuse_loading_api", default=False)


def _load_api() -> None:
    """Imports keras and the public API into this module (idempotent)."""
    if _LOADING.get() or "optimize" in globals():
        return
    from rnnfuse.scoped import scoped

    with scoped(_LOADING, True):
        _import_public_names()


def _import_public_names() -> None:
    from rnnfuse._deps import import_keras

    import_keras()
    import rnnfuse.layers as layers
    from rnnfuse.api import TuneShape, analyze, optimize
    from rnnfuse.fused import FusedRNN
    from rnnfuse.model_files import ModelFileError, load_model
    from rnnfuse.persistence import restore
    from rnnfuse.reasons import CallPath, FusionWarning, PathKind, Reason
    from rnnfuse.report import FusionGroup, FusionReport, OptimizeResult, RewriteFailure
    from rnnfuse.plan import FUSED, PER_LAYER, Plan

    # A lazy import, not state: these names are bound once, to the same objects.
    globals().update(
        CallPath=CallPath,
        PathKind=PathKind,
        OptimizeResult=OptimizeResult,
        RewriteFailure=RewriteFailure,
        FUSED=FUSED,
        PER_LAYER=PER_LAYER,
        Plan=Plan,
        TuneShape=TuneShape,
        FusedRNN=FusedRNN,
        FusionGroup=FusionGroup,
        FusionReport=FusionReport,
        FusionWarning=FusionWarning,
        Reason=Reason,
        analyze=analyze,
        layers=layers,
        load_model=load_model,
        ModelFileError=ModelFileError,
        optimize=optimize,
        restore=restore,
    )


def __getattr__(name: str):
    # Reached only while the `rnnfuse` command defers the import (below).
    if name in __all__:
        _load_api()
        return globals()[name]
    raise AttributeError(f"module 'rnnfuse' has no attribute {name!r}")


def _started_by_command_line() -> bool:
    """Whether this import is the `rnnfuse` script's (or `python -m
    rnnfuse`'s), which loads the API itself after parsing its arguments."""
    if os.environ.get("RNNFUSE_EAGER_IMPORT") == "1":
        return False
    argv0 = os.path.basename(sys.argv[0] if sys.argv else "").lower()
    if argv0 in ("rnnfuse", "rnnfuse.exe", "rnnfuse-script.py"):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    for i, arg in enumerate(orig[:-1]):
        if arg == "-m":
            return orig[i + 1] in ("rnnfuse", "rnnfuse.cli")
    return False


if not _started_by_command_line():
    _load_api()
