"""rnnfuse.backends: the contracts (Backend, Timing, Tooling), get_backend,
get_timing, get_tooling, and the fallbacks."""

from __future__ import annotations

import importlib
import inspect

import keras
import pytest

from rnnfuse.backends import Backend, StackCall, Timing, Tooling, get_backend, get_timing, get_tooling
from rnnfuse.backends.base import Capabilities, NoFusedKernel, NoTiming, NoTooling

CLASSES = {
    "tensorflow": ("rnnfuse.backends.tensorflow.backend:TensorFlowBackend:TensorFlowTooling"
                   ":TensorFlowTiming"),
    "torch": "rnnfuse.backends.torch.backend:TorchBackend:TorchTooling:TorchTiming",
    "jax": "rnnfuse.backends.jax.backend:JaxBackend:JaxTooling:JaxTiming",
}
# What the tools call, kept out of the Backend contract.
TOOLING = ("describe_device", "timing_notes", "exact_float32", "model_step", "outputs_and_grads")
# What only the tuner calls, kept out of the Backend contract.
TIMING = ("device_environment", "timed_step", "timed_steps", "gradients", "gradients_of",
          "timing_context")


def _load(name, which=1):
    module, *classes = CLASSES[name].split(":")
    try:
        return getattr(importlib.import_module(module), classes[which - 1])
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
    tooling = _load(name, 2)
    assert issubclass(tooling, Tooling) and not inspect.isabstract(tooling)
    timing = _load(name, 3)
    assert issubclass(timing, Timing) and not inspect.isabstract(timing)


def _implementations():
    """(contract, class) for every class implementing a contract here."""
    found = [(Backend, NoFusedKernel), (Timing, NoTiming), (Tooling, NoTooling)]
    for name in sorted(CLASSES):
        module, *classes = CLASSES[name].split(":")
        try:
            loaded = importlib.import_module(module)
        except ImportError:  # the framework is not installed here
            continue
        found += [(contract, getattr(loaded, cls))
                  for contract, cls in zip((Backend, Tooling, Timing), classes)]
    return found


@pytest.mark.parametrize("contract, cls", _implementations(),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_implementation_takes_its_contracts_arguments(contract, cls):
    """Each method a class defines takes the parameters its contract names,
    so a caller passing them by keyword reaches every backend."""
    defaults = {"timed_steps", "gradients_of", "kernel_reason", "in_xla_context",
                "keras_runs_cudnn", "strategy_scope"}
    for name in sorted(contract.__abstractmethods__ | defaults):
        if not hasattr(contract, name) or isinstance(getattr(contract, name), property):
            continue
        want = list(inspect.signature(getattr(contract, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got}: the contract's is {want}"


def test_the_tuners_methods_are_not_part_of_the_backend_contract():
    assert not set(TIMING) & set(dir(Backend))
    assert set(TIMING) <= set(dir(Timing))
    timing = get_timing()
    assert timing is get_timing() and not isinstance(timing, Backend)
    assert type(timing).__name__ == f"{type(get_backend()).__name__[:-len('Backend')]}Timing"


def test_the_tools_methods_are_not_part_of_the_backend_contract():
    assert not set(TOOLING) & set(dir(Backend))
    assert set(TOOLING) <= set(Tooling.__abstractmethods__)
    assert get_tooling() is get_tooling() and not isinstance(get_tooling(), Backend)


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
        backend.run_stack(None, StackCall(None))
    tooling = get_tooling("openvino")
    assert isinstance(tooling, NoTooling)
    with pytest.raises(NotImplementedError, match="openvino"):
        tooling.model_step(None, train=False)
    timing = get_timing("openvino")
    assert isinstance(timing, NoTiming) and timing.timing_context() is None
    assert timing.device_environment() == {}


def test_no_timing_refuses_a_training_gradient_with_its_reason():
    """The tuner asks for gradients with `training` (by keyword, through
    `gradients_of`): the stand-in says why it cannot, not a TypeError."""
    timing = get_timing("openvino")
    with pytest.raises(NotImplementedError, match="no gradients for the openvino backend"):
        timing.gradients(None, None, [], training=True)
    with pytest.raises(NotImplementedError, match="openvino"):
        timing.gradients_of([(None, None, True)], [])
    with pytest.raises(NotImplementedError, match="no timing for the openvino backend"):
        timing.timed_step(None, None, [], training=False, jit=False)


def test_tensorflows_device_environment_reads_the_gpus_details_once(monkeypatch):
    """Read at every fit/evaluate/predict call: the GPU's details (about a
    millisecond to read) are read once a process, the list of GPUs every time."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("TensorFlow's device environment")
    import tensorflow as tf

    from rnnfuse.backends import tensorflow as tf_backend

    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    reads = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [gpu])
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda d: reads.append(d.name) or {"device_name": "FakeGPU"})
    tf_backend._gpu_name.cache_clear()
    try:
        envs = [tf_backend.device_environment() for _ in range(3)]
    finally:
        tf_backend._gpu_name.cache_clear()
    assert [e["device"] for e in envs] == ["FakeGPU"] * 3
    assert reads == ["/physical_device:GPU:0"]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    assert tf_backend.device_environment()["device"] == "cpu"
