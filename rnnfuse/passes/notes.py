"""Notes on a whole model that the planning pass adds to its report.

Example:
    >>> import keras
    >>> from rnnfuse.report import FusionReport
    >>> m = keras.Sequential([keras.Input((6, 2)), keras.layers.Dense(1)])
    >>> model_notes(m, FusionReport(model_name=m.name, groups=(), skipped={}))
    []
"""

from __future__ import annotations

import keras

from rnnfuse.backends import get_backend
from rnnfuse.fused import fused_layers
from rnnfuse.report import FusionReport

__all__ = ["fused_layer_notes", "model_notes", "xla_cost_notes"]


def model_notes(model: keras.Model, report: FusionReport) -> list[str]:
    """The FusedRNN layers already in `model`, then what fusing costs in XLA."""
    xla = xla_cost_notes(model, report)
    return fused_layer_notes(model) + xla


def xla_cost_notes(model: keras.Model, report: FusionReport) -> list[str]:
    """A note when fusing would cost the model XLA here: Keras compiles the
    original with XLA under jit_compile="auto" (every layer supports it, as
    for a SimpleRNN stack), and the fused kernel on this device cannot be
    XLA-compiled, so a fused model runs without XLA."""
    backend = get_backend()
    caps = backend.capabilities
    if not report.groups or not caps.auto_jit_from_layers or caps.jit_compiles_fused_call:
        return []
    if not backend.is_available():
        return []  # no fused kernel runs here; the fused layers keep XLA
    if not all(layer.supports_jit for layer in model._flatten_layers(include_self=False)):
        return []
    return [
        f"fusing costs '{model.name}' XLA here: Keras compiles the original with "
        "XLA (jit_compile='auto'), and the fused cuDNN kernel cannot be compiled "
        "by XLA, so the optimized model runs without it; first-batch tuning "
        "times the original XLA-compiled and keeps the original layers where "
        "they are faster."
    ]


def fused_layer_notes(model: keras.Model) -> list[str]:
    """One line per `FusedRNN` already in `model` (an optimized model, or one
    loaded from its .keras file): the layers it runs and how."""
    notes = []
    for layer in fused_layers(model):
        stack = layer.stack
        kinds = sorted({type(l).__name__ for l in layer.fused_layers})
        shape = (
            f"{stack.kind}, {stack.num_levels} level(s)"
            + (" x 2 directions" if stack.num_directions == 2 else "")
            + f", {stack.units} units"
            + (f", proj_size {stack.proj_size}" if stack.proj_size else "")
        )
        dropout = f", absorbing {len(layer.absorbed_dropout)} Dropout" if layer.absorbed_dropout else ""
        notes.append(
            f"'{layer.name}' is a FusedRNN (already optimized): it runs "
            f"{' -> '.join(l.name for l in layer.fused_layers)} "
            f"({'/'.join(kinds)}; {shape}{dropout}) on the plan '{layer.plan.name}'; "
            "rnnfuse.restore(model) gives back the original layers."
        )
    return notes
