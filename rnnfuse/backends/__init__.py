"""Backends: run a whole stack of recurrent levels as one fused call.

`get_backend()` returns the `Backend` (rnnfuse.backends.base) of the active
Keras backend: an object implementing the whole contract, with its
`capabilities` as fields. It is the only place in rnnfuse that reads
`keras.backend.backend()`; everything else asks the object. A Keras backend
rnnfuse has no kernel for gets `NoFusedKernel` (every group keeps its
layers, with a reason).

Each backend is a package, `rnnfuse/backends/<name>/`: the package module
holds the kernels (packing, the fused call, its timed step) and
`backend.py` the contract class that delegates to them. Only code under
`rnnfuse/backends/` imports TensorFlow, torch or JAX.

Adding a backend: a package `rnnfuse/backends/<name>/` with its kernels and
a `backend.py` subclassing `Backend`, and one line in `_CLASSES` below.

Example:

    >>> get_backend().name
    'tensorflow'
"""

from __future__ import annotations

import importlib

import keras

from rnnfuse.backends.base import Backend, Capabilities, NoFusedKernel, StackSpec

__all__ = ["Backend", "Capabilities", "StackSpec", "get_backend"]

# Keras backend name -> "module:class" of its contract implementation.
_CLASSES = {
    "tensorflow": "rnnfuse.backends.tensorflow.backend:TensorFlowBackend",
    "torch": "rnnfuse.backends.torch.backend:TorchBackend",
    "jax": "rnnfuse.backends.jax.backend:JaxBackend",
}

_INSTANCES: dict[str, Backend] = {}


def get_backend(name: str | None = None) -> Backend:
    """The `Backend` for Keras backend `name` (default: the active one).

    A Keras backend rnnfuse has no fused kernel for gets `NoFusedKernel`,
    whose `capabilities.fused_kernel` is False.
    """
    name = name or keras.backend.backend()
    backend = _INSTANCES.get(name)
    if backend is None:
        target = _CLASSES.get(name)
        if target is None:
            backend = NoFusedKernel(name)
        else:
            module, cls = target.split(":")
            backend = getattr(importlib.import_module(module), cls)()
        _INSTANCES[name] = backend
    return backend
