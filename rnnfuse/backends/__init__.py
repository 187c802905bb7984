"""Backends: run a whole stack of recurrent levels as one fused call.

`get_backend()` returns the active Keras backend's `Backend` (the kernel
interface, with its `capabilities`), `get_timing()` its `Timing` (the
tuner's) and `get_tooling()` its `Tooling` (bench, check, examples). This is
the only place in rnnfuse that reads `keras.backend.backend()`, and only
code under rnnfuse/backends/ imports TensorFlow, torch or JAX. A Keras
backend rnnfuse has no kernel for gets `NoFusedKernel`.

Adding a backend: a package `rnnfuse/backends/<name>/` with its kernels and
a `backend.py` subclassing the three contracts, and one line in `_CLASSES`.

Example:

    >>> get_backend().name
    'tensorflow'
"""

from __future__ import annotations

import importlib
from typing import Any

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

# Keras backend name -> (module, Backend, Tooling, Timing class names).
_CLASSES = {
    "tensorflow": ("rnnfuse.backends.tensorflow.backend", "TensorFlowBackend",
                   "TensorFlowTooling", "TensorFlowTiming"),
    "torch": ("rnnfuse.backends.torch.backend", "TorchBackend", "TorchTooling", "TorchTiming"),
    "jax": ("rnnfuse.backends.jax.backend", "JaxBackend", "JaxTooling", "JaxTiming"),
}

def get_backend(name: str | None = None) -> Backend:
    """The `Backend` for Keras backend `name` (default: the active one);
    `NoFusedKernel` for one rnnfuse has no kernel for."""
    return _instance(name, 1, NoFusedKernel)


def get_tooling(name: str | None = None) -> Tooling:
    """The `Tooling` for Keras backend `name` (default: the active one).

    >>> type(get_tooling()).__name__
    'TensorFlowTooling'"""
    return _instance(name, 2, NoTooling)


def get_timing(name: str | None = None) -> Timing:
    """The `Timing` the tuner times plans with for Keras backend `name`.

    >>> type(get_timing()).__name__
    'TensorFlowTiming'"""
    return _instance(name, 3, NoTiming)


def active_name() -> str:
    """The active Keras backend's name, read without importing its framework.

    >>> active_name()
    'tensorflow'"""
    return keras.backend.backend()


def _instance(name: str | None, which: int, missing):
    """One object per (backend name, class) for the process."""
    return _made(name or active_name(), which, missing)


_MADE: dict[tuple, Any] = {}  # memo: one object per (backend name, class)


def _made(name: str, which: int, missing):
    found = _MADE.get((name, which))
    if found is None:
        target = _CLASSES.get(name)
        found = missing(name) if target is None else getattr(
            importlib.import_module(target[0]), target[which])()
        _MADE[(name, which)] = found
    return found
