"""Optimized models under jit_compile=True on a real GPU (Keras' torch
trainer torch.compiles each step, inductor included).

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch:

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_torch_compile.py

Each test compiles the optimized model and the original the same way, fits
both a few steps, and compares losses, weights and `predict`. Spies inside
the custom ops' bodies (what a compiled graph runs) count the kernels'
launches, and the fused layer's `last_path` names its kernel, so a silent
fallback to `torch._VF` or to the original layers fails: a float32 LSTM
stack and a bidirectional GRU stack on rnnfuse's cuDNN core (TF32 off:
outputs within 1e-4 of PyTorch's per-layer cuDNN), and a float16 LSTM
stack whose predict runs the wavefront kernel (Hopper), within float16
rounding.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import fused_layers, stack_model  # noqa: E402
from gpu_wavefront_checks import float16_lstm  # noqa: E402
from rnnfuse import PathKind  # noqa: E402
from rnnfuse.backends.torch import cudnn_core, wavefront  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402

L = keras.layers
pytestmark = pytest.mark.real_gpu_only


@pytest.fixture
def launches(monkeypatch):
    """Counts the cuDNN core's and the wavefront kernel's launches, from
    inside the custom ops (they still run)."""
    counts = {"core_forward": 0, "core_backward": 0, "wavefront": 0}
    for owner, name, key in ((cudnn_core, "core_forward", "core_forward"),
                             (cudnn_core, "core_backward", "core_backward"),
                             (wavefront, "forward_into", "wavefront")):
        real = getattr(owner, name)

        def spy(*args, _real=real, _key=key, **kwargs):
            counts[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    torch._dynamo.reset()
    yield counts
    torch._dynamo.reset()


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
    assert model.jit_compile is True
    return model


def _both(make, plan):
    """The original and the optimized model (running `plan`), both compiled;
    and the fused layer."""
    model = _compiled(make())
    fast = _compiled(rnnfuse.optimize(make(), plan=plan))
    (layer,) = fused_layers(fast)
    return model, fast, layer


def _assert_close(got, want, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               atol=atol)


def _fit_and_compare(make, x, y, launches, *, loss_rtol, output_atol, weight_atol,
                     plan=rnnfuse.FUSED):
    """Fits both models two epochs, then predicts: the same losses, weights
    and outputs. Returns the fused layer."""
    model, fast, layer = _both(make, plan)
    losses = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    fast_losses = fast.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    trained = layer.last_path
    print("GPU_REPORT torch_compile fit", layer.name, dict(launches), trained)
    assert trained.kind is PathKind.FUSED, trained
    np.testing.assert_allclose(fast_losses.history["loss"], losses.history["loss"],
                               rtol=loss_rtol)
    for a, b in zip(fast.weights, model.weights):
        _assert_close(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), weight_atol)
    _assert_close(fast.predict(x, batch_size=32, verbose=0),
                  model.predict(x, batch_size=32, verbose=0), output_atol)
    assert layer.last_path.kind is PathKind.FUSED, layer.last_path
    return layer


def _fit_and_compare_on_the_core(make, launches, seed, x_shape, y_shape):
    """`_fit_and_compare` at float32's tolerances on random float32 data of
    these shapes (from `seed`); the fused layer ran rnnfuse's cuDNN core."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype("float32")
    y = rng.standard_normal(y_shape).astype("float32")
    layer = _fit_and_compare(make, x, y, launches, loss_rtol=1e-4, output_atol=1e-4,
                             weight_atol=1e-5)
    assert layer.last_path.kernel.name == cudnn_core.KERNEL_NAME, layer.last_path


def test_a_float32_lstm_stack_fits_and_predicts_on_the_core(launches):
    def make():
        keras.utils.set_random_seed(1)
        return stack_model("lstm", 3, units=64, input_size=16, steps=40, head=True)

    _fit_and_compare_on_the_core(make, launches, 0, (128, 40, 16), (128, 3))
    # Two epochs of 4 steps train on the core; predict's 4 batches run it too.
    assert launches["core_backward"] >= 8 and launches["core_forward"] >= 12, launches


def test_a_bidirectional_gru_stack_fits_and_predicts_on_the_core(launches):
    def make():
        keras.utils.set_random_seed(2)
        inp = keras.Input((30, 8))
        x = L.Bidirectional(L.GRU(32, return_sequences=True))(inp)
        x = L.Bidirectional(L.GRU(32))(x)
        return keras.Model(inp, L.Dense(2)(x))

    _fit_and_compare_on_the_core(make, launches, 1, (64, 30, 8), (64, 2))
    assert launches["core_backward"] >= 4 and launches["core_forward"] >= 6, launches


_LAYERS, _UNITS, _STEPS = 2, 256, 120


def _float16_lstm():
    keras.utils.set_random_seed(3)
    return float16_lstm(_LAYERS, _UNITS, _STEPS)


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wavefront kernel runs on Hopper (compute capability 9.0)")


def test_a_float16_lstm_stack_predicts_on_the_wavefront_kernel(launches):
    _hopper()
    x = np.random.default_rng(2).standard_normal((64, _STEPS, _UNITS)).astype("float32")
    model, fast, layer = _both(_float16_lstm, Plan((_LAYERS,), kernel="wavefront"))
    got = fast.predict(x, batch_size=32, verbose=0)
    print("GPU_REPORT torch_compile predict", layer.name, dict(launches), layer.last_path)
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME, layer.last_path
    assert launches["wavefront"] == 2, launches  # predict's two batches
    want = model.predict(x, batch_size=32, verbose=0)
    diff = np.asarray(got, np.float64) - want
    assert float(np.linalg.norm(diff) / np.linalg.norm(want)) <= 2e-3
    assert float(np.max(np.abs(diff))) <= 2e-2


def test_a_float16_lstm_stack_fits_as_the_original_with_the_wavefront_plan(launches):
    """Training calls of the wavefront plan run its training kernels (or
    cuDNN where they refuse): the same losses and weights within float16
    rounding; predict then runs the wavefront kernel."""
    _hopper()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, _STEPS, _UNITS)).astype("float32")
    y = (0.1 * rng.standard_normal((64, _STEPS, _UNITS))).astype("float32")
    layer = _fit_and_compare(_float16_lstm, x, y, launches, loss_rtol=2e-2, output_atol=2e-2,
                             weight_atol=2e-3, plan=Plan((_LAYERS,), kernel="wavefront"))
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME, layer.last_path
    assert launches["wavefront"] >= 2, launches
