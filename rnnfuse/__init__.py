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
"""

__version__ = "0.1.0"

from rnnfuse import layers
from rnnfuse.api import TuneShape, analyze, optimize
from rnnfuse.fused import FusedRNN
from rnnfuse.passes.rewrite import FusionWarning
from rnnfuse.persistence import restore
from rnnfuse.reasons import CallPath, PathKind, Reason
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
