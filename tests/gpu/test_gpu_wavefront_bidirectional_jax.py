"""Bidirectional stacks on rnnfuse's wavefront kernel through JAX's FFI on a
real Hopper GPU (rnnfuse/backends/jax/wavefront_bidirectional.py, its
switch turned on here):

    KERAS_BACKEND=jax python3 -m pytest -q -s tests/gpu/test_gpu_wavefront_bidirectional_jax.py

A FusedRNN of Keras Bidirectional LSTM / GRU layers on the "wavefront"
plan in mixed_float16, against the same layers in float32 on Keras'
generic loop: outputs and every gradient (jax.grad of a weighted sum,
jitted) as ||a - b|| / ||b||, a masked call included, and a predict step.
A spy on the binding's `ffi_call` records the FFI targets traced into
each step (one-layer calls a direction), so a silent fallback fails.

RNNFUSE_GPU_DRYRUN=1 runs them on the CPU with the emulated FFI calls
(tests/jax_backend/wavefront_emulation.py) to check the tests themselves.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX GPU tests need KERAS_BACKEND=jax", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from builders import bidirectional_stack, fused_layers  # noqa: E402
from gpu_compare import fused_and_generic_twin, rel as _rel  # noqa: E402
from gpu_report import report  # noqa: E402
from jax_wavefront_device import DRYRUN, hopper_or_emulation, traced_targets  # noqa: E402
from rnnfuse.backends.jax import wavefront  # noqa: E402
from rnnfuse.backends.jax import wavefront_bidirectional as bidir  # noqa: E402

TOLERANCE = 1e-2  # float16 against float32, ||a - b|| / ||b||; gradients twice this
FEATURES = 32


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    hopper_or_emulation(monkeypatch)


@pytest.fixture
def traced(monkeypatch):
    """The FFI targets traced into steps (the calls still run)."""
    return traced_targets(monkeypatch)


def _models(kind, layers, units, steps, merge_mode, masked):
    """(the fused mixed_float16 model on the wavefront plan, the same layers
    in float32 on Keras' generic loop with its weights)."""
    return fused_and_generic_twin(
        lambda: bidirectional_stack(kind, merge_mode, layers, units, steps, features=FEATURES,
                                    masked=masked), "mixed_float16")


def _outputs_and_grads(model, x, weights):
    variables = model.trainable_variables

    def loss(values, x):
        out, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables],
                                      x, training=True)
        out = out.astype(jnp.float32)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        [v.value for v in variables], x)
    return out, grads


@pytest.mark.parametrize("kind,layers,units,merge_mode,masked", [
    ("lstm", 2, 128, "concat", True), ("gru", 3, 64, "sum", False)])
def test_outputs_and_gradients_match_keras_bidirectional_in_float32(
        kind, layers, units, merge_mode, masked, traced):
    steps, batch = (10, 4) if DRYRUN else (40, 16)
    fast, reference = _models(kind, layers, units, steps, merge_mode, masked)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, steps, FEATURES)).astype("float32")
    if masked:  # right-padded lengths down to 1; the padding is zeros
        lengths = np.linspace(steps, 1, batch).astype(int)
        x[np.arange(steps)[None, :] >= lengths[:, None]] = 0.0
    x = jnp.asarray(x)
    weights = jnp.asarray(rng.standard_normal(reference(x).shape), jnp.float32)
    out, grads = _outputs_and_grads(fast, x, weights)
    (layer,) = fused_layers(fast)
    ran = layer.last_path.kernel
    assert layer.last_path.kind == "fused" and ran.name == wavefront.KERNEL_NAME, layer.last_path
    assert ran.note is None and ran.algorithm.startswith(bidir.ALGORITHM), ran
    backward = "backward_stack" if ran.algorithm.endswith("stack") else "backward_layer"
    # One call a direction of each layer (a masked step traces its cond's branches again).
    assert traced.count("forward_saving") >= 2 * layers, traced
    assert traced.count(backward) >= 2 * layers, traced
    want_out, want_grads = _outputs_and_grads(reference, x, weights)
    errors = {"out": _rel(out, want_out)}
    errors.update({f"grad_{v.path}": _rel(g, w)
                   for v, g, w in zip(fast.trainable_variables, grads, want_grads)})
    report(f"jax_wavefront_bidirectional_{kind}", errors)
    for name, err in errors.items():
        assert err <= (2 * TOLERANCE if name.startswith("grad") else TOLERANCE), (name, err)
    del traced[:]
    predicted = np.asarray(fast.predict(x, verbose=0), np.float32)
    assert traced.count("forward") >= 2 * layers, traced
    assert _rel(predicted, want_out) <= TOLERANCE
