"""Backends: run a whole stack of recurrent levels as one fused call.

`get_backend()` returns the `Backend` (rnnfuse.backends.base) of the active
Keras backend: an object implementing the kernel interface, with its
`capabilities` as fields. It is the only place in rnnfuse that reads
`keras.backend.backend()`; everything else asks the object. A Keras backend
rnnfuse has no kernel for gets `NoFusedKernel` (every group keeps its
layers, with a reason). `get_timing()` returns its `Timing`, what only the
tuner uses (timed steps, gradients, the device environment), and
`get_tooling()` its `Tooling`, what `rnnfuse bench` / `check` and the
examples use (device description, model steps and gradients); both are
kept out of the `Backend` contract.

Each backend is a package, `rnnfuse/backends/<name>/`: the package module
holds the kernels (packing, the fused call, its timed step) and
`backend.py` the contract class that delegates to them, its `Timing` and
its `Tooling`.
Only code under `rnnfuse/backends/` imports TensorFlow, torch or JAX.

Adding a backend: a package `rnnfuse/backends/<name>/` with its kernels and
a `backend.py` subclassing `Backend`, `Timing` and `Tooling`, and one line in
`_CLASSES` below.

Example:

    >>> get_backend().name
    'tensorflow'
"""

from __future__ import annotations

import functools
import importlib

import keras

from rnnfuse.backends.base import (
    Backend,
    Capabilities,
    NoFusedKernel,
    NoTiming,
    NoTooling,
    StackCall,
    StackSpec,
    Timing,
    Tooling,
)

__all__ = [
    "Backend",
    "Capabilities",
    "StackCall",
    "StackSpec",
    "Timing",
    "Tooling",
    "active_name",
    "get_backend",
    "get_timing",
    "get_tooling",
]

# Keras backend name -> the module of its contract implementations, and
# their class names (Backend, Tooling, Timing).
_CLASSES = {
    "tensorflow": ("rnnfuse.backends.tensorflow.backend", "TensorFlowBackend",
                   "TensorFlowTooling", "TensorFlowTiming"),
    "torch": ("rnnfuse.backends.torch.backend", "TorchBackend", "TorchTooling", "TorchTiming"),
    "jax": ("rnnfuse.backends.jax.backend", "JaxBackend", "JaxTooling", "JaxTiming"),
}

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


def get_timing(name: str | None = None) -> Timing:
    """The `Timing` for Keras backend `name` (default: the active one), what
    the tuner times plans with; `NoTiming` for a Keras backend rnnfuse has
    no kernel for.

    >>> type(get_timing()).__name__
    'TensorFlowTiming'
    """
    return _instance(name, 3, NoTiming)


def active_name() -> str:
    """The active Keras backend's name, read without importing its
    framework (what `get_backend()` would return the backend of).

    >>> active_name()
    'tensorflow'
    """
    return keras.backend.backend()


def _instance(name: str | None, which: int, missing):
    """One object per (backend name, class) for the process."""
    return _made(name or active_name(), which, missing)


@functools.cache  # memo: one object per (backend name, class)
def _made(name: str, which: int, missing):
    target = _CLASSES.get(name)
    if target is None:
        return missing(name)
    return getattr(importlib.import_module(target[0]), target[which])()
