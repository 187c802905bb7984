"""rnnfuse.backends: the contract, get_backend, and the fallback."""

from __future__ import annotations

import importlib
import inspect

import keras
import pytest

from rnnfuse.backends import Backend, get_backend
from rnnfuse.backends.base import Capabilities, NoFusedKernel

CLASSES = {
    "tensorflow": "rnnfuse.backends.tensorflow.backend:TensorFlowBackend",
    "torch": "rnnfuse.backends.torch.backend:TorchBackend",
    "jax": "rnnfuse.backends.jax.backend:JaxBackend",
}


def _load(name):
    module, cls = CLASSES[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:  # the framework is not installed here
        pytest.skip(f"{name}: {err}")


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_backend_implements_the_whole_contract(name):
    cls = _load(name)
    assert issubclass(cls, Backend)
    assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)
    backend = cls()
    assert backend.name == name
    caps = backend.capabilities
    assert isinstance(caps, Capabilities) and caps.fused_kernel
    assert caps.plan_table in importlib.import_module("rnnfuse.tuning.table").TABLES


def test_get_backend_returns_the_active_backend_once():
    backend = get_backend()
    assert backend.name == keras.backend.backend()
    assert get_backend() is backend


def test_an_unknown_keras_backend_gets_no_fused_kernel():
    backend = get_backend("openvino")
    assert isinstance(backend, NoFusedKernel)
    assert not backend.capabilities.fused_kernel and not backend.is_available()
    assert "openvino" in backend.group_reason(None)
    with pytest.raises(NotImplementedError):
        backend.run_stack(None)
