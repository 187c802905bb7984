"""Which gradients are wrong on the GPU: fused, or Keras' cuDNN LSTM?

tests/gpu/test_gpu_jax.py found, for a 2-layer LSTM stack with initial
states and a go_backwards first layer, outputs within 4e-7 but gradients
3.8 (relative) apart between rnnfuse's fused call and Keras' per-layer
cuDNN calls. This compares both with Keras' generic loop
(`use_cudnn=False`, same weights) on the GPU, for each feature alone.

    KERAS_BACKEND=jax python3 bench/diag_jax_states.py
"""

import sys

sys.path[:0] = ["tests", "."]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from builders import random_inputs  # noqa: E402


def build(initial_state, go_backwards, use_cudnn):
    x = keras.Input((40, 16))
    states = [keras.Input((32,)), keras.Input((32,))] if initial_state else None
    y = keras.layers.LSTM(32, return_sequences=True, go_backwards=go_backwards, use_cudnn=use_cudnn)(
        x, initial_state=states)
    y = keras.layers.LSTM(32, return_sequences=True, use_cudnn=use_cudnn)(y)
    return keras.Model([x] + (states or []), y)


def grads(model, inputs):
    variables = model.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = model(inputs)
        return jnp.sum(out * jnp.sin(jnp.arange(out.shape[-1]) + 1.0) + out**2), out

    (_, out), g = jax.value_and_grad(loss, has_aux=True)([v.value for v in variables])
    return out, g


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


with jax.default_matmul_precision("highest"):
    for initial_state, go_backwards in ((False, False), (True, False), (False, True), (True, True)):
        loop = build(initial_state, go_backwards, False)
        rng = np.random.default_rng(0)
        for v in loop.weights:
            v.assign(rng.uniform(-0.5, 0.5, v.shape).astype("float32"))
        keras_cudnn = build(initial_state, go_backwards, "auto")
        keras_cudnn.set_weights(loop.get_weights())
        fused = rnnfuse.optimize(keras_cudnn, plan=rnnfuse.FUSED)
        inputs = random_inputs(loop, 8, np.random.default_rng(1))
        ref_out, ref_g = grads(loop, inputs)
        row = {}
        for name, m in (("keras_cudnn", keras_cudnn), ("fused", fused)):
            out, g = grads(m, inputs)
            row[name] = (rel(out, ref_out), max(rel(a, b) for a, b in zip(g, ref_g)))
        print(f"initial_state={initial_state} go_backwards={go_backwards} vs Keras' loop "
              f"(out, grad): " + "  ".join(f"{k} {o:.1e} {g:.1e}" for k, (o, g) in row.items()), flush=True)
