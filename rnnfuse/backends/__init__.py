"""Backends: run a whole stack of recurrent levels as one fused call.

`get_backend()` returns the `Backend` (rnnfuse.backends.base) of the active
Keras backend: an object implementing the whole contract, with its
`capabilities` as fields. It is the only place in rnnfuse that reads
`keras.backend.backend()`; everything else asks the object. A Keras backend
rnnfuse has no kernel for gets `NoFusedKernel` (every group keeps its
layers, with a reason). `get_tooling()` returns its `Tooling`, what
`rnnfuse bench` / `check` and the examples use (device description, model
steps and gradients), kept out of the `Backend` contract.

Each backend is a package, `rnnfuse/backends/<name>/`: the package module
holds the kernels (packing, the fused call, its timed step) and
`backend.py` the contract class that delegates to them, and its `Tooling`.
Only code under `rnnfuse/backends/` imports TensorFlow, torch or JAX.

Adding a backend: a package `rnnfuse/backends/<name>/` with its kernels and
a `backend.py` subclassing `Backend` and `Tooling`, and one line in
`_CLASSES` below.

Example:

    >>> get_backend().name
    'tensorflow'
"""

from __future__ import annotations

import importlib

import keras

from rnnfuse.backends.base import Backend, Capabilities, NoFusedKernel, NoTooling, StackSpec, Tooling

__all__ = ["Backend", "Capabilities", "StackSpec", "Tooling", "get_backend", "get_tooling"]

# Keras backend name -> the module of its contract implementations, and
# their class names (Backend, Tooling).
_CLASSES = {
    "tensorflow": ("rnnfuse.backends.tensorflow.backend", "TensorFlowBackend", "TensorFlowTooling"),
    "torch": ("rnnfuse.backends.torch.backend", "TorchBackend", "TorchTooling"),
    "jax": ("rnnfuse.backends.jax.backend", "JaxBackend", "JaxTooling"),
}

_INSTANCES: dict[tuple[str, int], object] = {}


def get_backend(name: str | None = None) -> Backend:
    """The `Backend` for Keras backend `name` (default: the active one).

    A Keras backend rnnfuse has no fused kernel for gets `NoFusedKernel`,
    whose `capabilities.fused_kernel` is False.
    """
    return _instance(name, 1, NoFusedKernel)


def get_tooling(name: str | None = None) -> Tooling:
    """The `Tooling` for Keras backend `name` (default: the active one);
    `NoTooling` for a Keras backend rnnfuse has no kernel for.

    >>> type(get_tooling()).__name__
    'TensorFlowTooling'
    """
    return _instance(name, 2, NoTooling)


def _instance(name: str | None, which: int, missing):
    """One object per (backend name, class) for the process."""
    name = name or keras.backend.backend()
    found = _INSTANCES.get((name, which))
    if found is None:
        target = _CLASSES.get(name)
        if target is None:
            found = missing(name)
        else:
            found = getattr(importlib.import_module(target[0]), target[which])()
        _INSTANCES[(name, which)] = found
    return found
