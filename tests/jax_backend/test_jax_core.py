"""The JAX backend's cuDNN path on the CPU, through an emulation of the
core's FFI targets (core_emulation.py: cuDNN's equations in jax.numpy).

Each fused model is compared with the original one (Keras' own JAX
layers), outputs and gradients; the emulation's record shows which
targets ran with which attributes, so the binding's argument packing,
custom_vjp wiring and fallbacks are checked without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import core_emulation
import rnnfuse
from builders import KINDS, fused_layers, max_abs_diff, random_inputs, rnn_layer, stack_model
from rnnfuse.backends.jax import cudnn_core

L = keras.layers


@pytest.fixture
def emulated(monkeypatch):
    return core_emulation.install(monkeypatch)


def _targets(emulation):
    return [t.removeprefix("rnnfuse_cudnn_ffi_") for t, _ in emulation.calls]


def _randomize(model, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-scale, scale, v.shape).astype(v.dtype))


def _grads(model, inputs, training=False):
    variables = model.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = model(inputs, training=training)
        return sum(jnp.sum(t * jnp.sin(jnp.arange(t.shape[-1]) + 1.0) + t**2)
                   for t in jax.tree.leaves(out))

    return jax.jit(jax.grad(loss))([v.value for v in variables])


def _check(model, fast, inputs, tol=1e-4):
    assert max_abs_diff(fast(inputs), model(inputs)) < tol
    for a, b in zip(_grads(fast, inputs), _grads(model, inputs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def _ran(fast):
    (layer,) = fused_layers(fast)
    kernel = layer.last_path.kernel
    assert kernel is not None and kernel.name == cudnn_core.KERNEL_NAME, layer.last_path
    return kernel


def _stack3(kind, bidirectional, steps=6, features=5, units=4, merge="concat"):
    inp = keras.Input((steps, features))
    x = inp
    for _ in range(3):
        layer = rnn_layer(kind, units, return_sequences=True)
        x = (L.Bidirectional(layer, merge_mode=merge) if bidirectional else layer)(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_every_kind_is_one_core_call_matching_keras(kind, bidirectional, emulated):
    model = _stack3(kind, bidirectional)
    _randomize(model)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = np.random.default_rng(1).standard_normal((3, 6, 5)).astype("float32")
    _check(model, fast, x)
    assert _ran(fast).algorithm == "standard"
    targets = _targets(emulated)
    assert targets[0] == "forward"
    # jax.grad: the training forward, then backward data, then weights.
    assert targets[1:4] == ["forward_training", "backward_data", "backward_weights"]
    attrs = emulated.calls[0][1]
    assert attrs["mode"] == cudnn_core.MODES.index(kind)
    assert (attrs["num_layers"], attrs["num_units"], attrs["directions"]) == (
        3, 4, 2 if bidirectional else 1)
    assert attrs["full_lengths"] == 1 and attrs["dropout"] == 0.0
