"""Backends: run a whole stack of recurrent levels as one fused call.

Each backend module exposes the same functions (the contract below); the
`FusedRNN` layer picks the module for the active Keras backend with
`get_backend()` and never branches on the backend itself.

- `is_available() -> bool`: the fused kernel can run in this process now
  (for TensorFlow: a GPU is visible).
- `unsupported_reason(stack, dtype) -> str | None`: a configuration the
  fused kernel cannot run (the layer then calls the original layers).
- `mask_is_supported(mask) -> bool tensor`: the mask is right-padded with no
  empty sequence, so it can become sequence lengths.
- `run_stack(sequences, *, stack, initial_h, initial_c, mask, reverse,
  dropout, seed) -> (outputs, final_h, final_c)`: the fused call itself;
  raises `NotImplementedError` when it cannot run.
- For the tuner: `device_environment() -> dict` (device and versions for
  the plan cache), `timed_step(run, x, variables, training)` (a callable
  returning a scalar), `TUNED_ALGORITHMS` (cuDNN algorithms to time).

Optional: `group_reason(group)` (why the backend never runs a fusion
group; the planner reports it), `ABSORBS_DROPOUT = False` (no between-level
dropout: the planner does not absorb Dropout layers),
`TUNES_ONE_CALL_PER_LAYER = True` (the tuner also times one fused call per
layer) and `XLA_COMPILES_FUSED_CALL = True` (the fused call compiles under XLA, so
`FusedRNN.supports_jit` stays True).

Example:

    >>> get_backend().__name__
    'rnnfuse.backends.tensorflow'
"""

from __future__ import annotations

import importlib
from types import ModuleType

import keras

from rnnfuse.backends.base import StackSpec

__all__ = ["StackSpec", "get_backend"]

_MODULES = {
    "tensorflow": "rnnfuse.backends.tensorflow",
    "torch": "rnnfuse.backends.torch",
    "jax": "rnnfuse.backends.jax",
}


def get_backend(name: str | None = None) -> ModuleType | None:
    """The backend module for Keras backend `name` (default: the active one).

    Returns None for a Keras backend rnnfuse has no fused kernel for; the
    fused layer then runs the original layers.
    """
    name = name or keras.backend.backend()
    module = _MODULES.get(name)
    return importlib.import_module(module) if module else None
