"""rnnfuse: run stacked Keras recurrent layers as one multi-layer cuDNN call.

    fast = rnnfuse.optimize(model)   # shares every variable with `model`

Public API: `analyze`, `optimize`, `restore`, `FusedRNN`, the report records
`FusionReport` and `FusionGroup`, `Reason`, and `FusionWarning`.

Example:

    >>> import keras, rnnfuse
    >>> m = keras.Sequential([keras.Input((20, 4)),
    ...                       keras.layers.LSTM(8, return_sequences=True),
    ...                       keras.layers.LSTM(8)])
    >>> len(rnnfuse.analyze(m).groups)
    1

The dependency rule. The package is in layers, lowest first; a module
imports only from its own layer or the layers below it (also inside
functions; tests/test_layering.py checks every import):

    records        reasons.py (Reason, CallPath), report.py, _version.py
    describe/graph recurrent.py (RecurrentView), passes/graph.py
    rules          rules/ (the registry and every fusion rule)
    backends       backends/ (the Backend contract and one package per
                   framework; the only code importing TensorFlow, torch or
                   JAX, and get_backend the only reader of
                   keras.backend.backend())
    layers         fused.py (FusedRNN), layers/ (ProjectedLSTM)
    planning       passes/planning.py
    tuning         tuning/
    rewrite/saving passes/rewrite.py, persistence.py, passes/__init__.py
    api            api.py, this package's __init__
    cli/render     cli/, plotting.py, __main__.py

`LAYERS` below is that list; `LAYER_EXCEPTIONS` names the imports that
break it for now, each with the reason.
"""

from rnnfuse._version import __version__

from rnnfuse import layers
from rnnfuse.api import TuneShape, analyze, optimize
from rnnfuse.fused import FusedRNN
from rnnfuse.persistence import restore
from rnnfuse.reasons import CallPath, FusionWarning, PathKind, Reason
from rnnfuse.report import FusionGroup, FusionReport, OptimizeResult, RewriteFailure
from rnnfuse.tuning.plans import FUSED, PER_LAYER, Plan

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
    "Reason",
    "analyze",
    "layers",
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
    "planning",
    "tuning",
    "rewrite/saving",
    "api",
    "cli/render",
)
LAYERS = (
    ("rnnfuse.reasons", "rnnfuse.report", "rnnfuse._version"),
    ("rnnfuse.recurrent", "rnnfuse.passes.graph"),
    ("rnnfuse.rules",),
    ("rnnfuse.backends",),
    ("rnnfuse.fused", "rnnfuse.layers"),
    ("rnnfuse.passes.planning",),
    ("rnnfuse.tuning",),
    ("rnnfuse.passes", "rnnfuse.passes.rewrite", "rnnfuse.persistence"),
    ("rnnfuse.api",),
    ("rnnfuse.cli", "rnnfuse.plotting", "rnnfuse.__main__"),
)
# (importer, imported) -> why it is allowed for now.
LAYER_EXCEPTIONS: dict = {}
