"""Under JAX on the GPU: which is right, the fused call or Keras' cuDNN LSTM?

tests/gpu/test_gpu_jax.py found gradients 3.8 (relative) apart between
rnnfuse's fused call and Keras' layers for a masked stack (outputs within
4e-7), and a go_backwards first layer whose output Keras orders
differently. This compares both with Keras' generic loop (`use_cudnn=False`,
same weights) on the GPU, feature by feature (initial states, returned
states, go_backwards), including the test's own model, and runs a
right-padded masked call through the fused kernel against the same loop.
Results (measured when the fused call was jax.experimental.rnn's; it is
rnnfuse's cuDNN core now): docs/benchmarks.md, "JAX".

    KERAS_BACKEND=jax python3 bench/diag_jax_states.py [--test-model-only]
"""

import sys

sys.path[:0] = ["tests", "."]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.backends import jax as jax_backend  # noqa: E402

# Fuse every LSTM run, including those the backend leaves to Keras.
jax_backend.group_reason = lambda group: None


def build(initial_state, go_backwards, return_state, use_cudnn, masked=False, last_sequences=True):
    if masked:
        tokens = keras.Input((40,), dtype="int32")
        x_in = tokens
        x = keras.layers.Embedding(50, 16, mask_zero=True)(tokens)
    else:
        x_in = x = keras.Input((40, 16))
    states = [keras.Input((32,)), keras.Input((32,))] if initial_state else None
    first = keras.layers.LSTM(32, return_sequences=True, go_backwards=go_backwards, use_cudnn=use_cudnn)
    y = first(x, initial_state=states) if states else first(x)
    y = keras.layers.LSTM(32, return_sequences=last_sequences, return_state=return_state,
                          use_cudnn=use_cudnn)(y)
    return keras.Model([x_in] + (states or []), y)


def grads(model, inputs):
    variables = model.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = jax.tree.leaves(model(inputs))
        return sum(jnp.sum(t * jnp.sin(jnp.arange(t.shape[-1]) + 1.0) + t**2) for t in out), out

    (_, out), g = jax.value_and_grad(loss, has_aux=True)([v.value for v in variables])
    return out, g


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def compare(initial_state, go_backwards, return_state, masked=False, last_sequences=True, tag="",
            builder=None):
    builder = builder or (lambda cudnn: build(initial_state, go_backwards, return_state, cudnn, masked,
                                              last_sequences))
    loop = builder(False)
    rng = np.random.default_rng(0)
    for v in loop.weights:
        v.assign(rng.uniform(-0.5, 0.5, v.shape).astype("float32"))
    keras_cudnn = builder("auto")
    keras_cudnn.set_weights(loop.get_weights())
    fused = rnnfuse.optimize(keras_cudnn, plan=rnnfuse.FUSED)
    rng = np.random.default_rng(1)
    if masked:
        tokens = rng.integers(1, 50, (8, 40)).astype("int32")
        for i, n in enumerate([40, 5, 17, 40, 1, 33, 2, 39]):
            tokens[i, n:] = 0
        inputs = [tokens]
    else:
        inputs = [rng.standard_normal((8, 40, 16)).astype("float32")]
    if initial_state:
        inputs += [rng.standard_normal((8, 32)).astype("float32") for _ in range(2)]
    ref_out, ref_g = grads(loop, inputs)
    row = {}
    for name, m in (("keras_cudnn", keras_cudnn), ("fused", fused)):
        out, g = grads(m, inputs)
        row[name] = (max(rel(a, b) for a, b in zip(out, ref_out)), max(rel(a, b) for a, b in zip(g, ref_g)))
        if tag:
            print("   ", name, "per variable:", [f"{rel(a, b):.1e}" for a, b in zip(g, ref_g)])
    print(f"{tag}initial_state={initial_state} go_backwards={go_backwards} return_state={return_state} "
          f"masked={masked} last_sequences={last_sequences} vs Keras' loop (out, grad): "
          + "  ".join(f"{k} {o:.1e} {g:.1e}" for k, (o, g) in row.items()), flush=True)


def test_model(use_cudnn):
    """tests/gpu/test_gpu_jax.py's model: stack_model(initial_state, last_return_state)."""
    from builders import stack_model

    model = stack_model("lstm", 2, units=32, input_size=16, steps=40, initial_state=True,
                        last_return_state=True)
    for layer in model.layers:
        if isinstance(layer, keras.layers.LSTM):
            layer.use_cudnn = use_cudnn
    return model


with jax.default_matmul_precision("highest"):
    compare(True, False, True, last_sequences=False, tag="stack_model ", builder=test_model)
    if "--test-model-only" in sys.argv:
        sys.exit(0)
    for initial_state, go_backwards, return_state in (
        (False, False, False), (True, False, False), (False, True, False), (True, True, False),
        (False, False, True), (True, False, True),
    ):
        try:
            compare(initial_state, go_backwards, return_state)
        except Exception as e:  # noqa: BLE001
            print("ERROR", initial_state, go_backwards, return_state, type(e).__name__, e, flush=True)
    for last_sequences in (True, False):
        compare(True, False, True, last_sequences=last_sequences)
    for return_state in (False, True):
        compare(False, False, return_state, masked=True)
