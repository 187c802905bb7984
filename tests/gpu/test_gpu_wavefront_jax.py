"""rnnfuse's wavefront kernel through JAX's FFI on a real Hopper GPU.

Runs only with KERAS_BACKEND=jax and a GPU visible to JAX:

    KERAS_BACKEND=jax python3 -m pytest -q -s tests/gpu/test_gpu_wavefront_jax.py

A FusedRNN on the "wavefront" plan, in mixed_float16 and mixed_bfloat16,
against the same layers run by Keras' generic loop in float32 (Keras' own
JAX LSTM runs jax.experimental.rnn in float32 only): outputs, final states
and every gradient (jax.grad of a weighted sum, jitted), as ||a - b|| /
||b|| within the element type's tolerance. A spy on the binding's
`ffi_call` records the FFI targets traced into each step, so a silent
fallback (the layers, or the cuDNN core) fails the test; the
compiled step is checked to hold the handlers' custom calls. The last
test times Keras' jitted fit and predict steps of a 4 x 512 LSTM at batch
64, T=1000, float16, on the kernel against Keras-on-JAX (GPU_REPORT line).

RNNFUSE_GPU_DRYRUN=1 runs the correctness tests on the CPU with the
emulated FFI calls (tests/jax_backend/wavefront_emulation.py) to check the
tests themselves; it proves nothing about the kernel.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX GPU tests need KERAS_BACKEND=jax", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rnnfuse  # noqa: E402
from builders import fused_layers, stack_model  # noqa: E402
from gpu_compare import fused_and_generic_twin, rel as _rel  # noqa: E402
from gpu_report import report  # noqa: E402
from gpu_timing import median_seconds  # noqa: E402
from jax_wavefront_device import DRYRUN, hopper_or_emulation, traced_targets  # noqa: E402
from rnnfuse.backends.jax import wavefront  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402

# ||a - b|| / ||b|| against float32 (outputs, states; gradients twice this).
TOLERANCE = {"float16": 1e-2, "bfloat16": 6e-2}


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    hopper_or_emulation(monkeypatch)


@pytest.fixture
def traced(monkeypatch):
    """The FFI targets traced into steps (the calls still run)."""
    return traced_targets(monkeypatch)


def _models(kind, layers, units, steps, policy):
    """(the fused model on the wavefront plan in `policy`, the same layers'
    float32 model on Keras' generic loop, sharing no variables: its
    weights are the first's)."""
    return fused_and_generic_twin(
        lambda: stack_model(kind, layers, units=units, input_size=32, steps=steps,
                            last_return_sequences=True, last_return_state=True), policy)


def _outputs_and_grads(model, x, weights):
    variables = model.trainable_variables

    def loss(values, x):
        outs, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables],
                                       x, training=True)
        flat = [o.astype(jnp.float32) for o in jax.tree.leaves(outs)]
        return sum(jnp.sum(o * w) for o, w in zip(flat, weights)), flat

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        [v.value for v in variables], x)
    return outs, grads


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind,layers,units", [("lstm", 3, 128), ("gru", 2, 64)])
def test_outputs_states_and_gradients_match_float32(kind, layers, units, policy, traced):
    steps, batch = (12, 4) if DRYRUN else (60, 16)
    fast, reference = _models(kind, layers, units, steps, policy)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((batch, steps, 32)), jnp.float32)
    shapes = [tuple(o.shape) for o in jax.tree.leaves(reference(x))]
    weights = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    outs, grads = _outputs_and_grads(fast, x, weights)
    (layer,) = fused_layers(fast)
    assert layer.last_path.kind == "fused", layer.last_path
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME, layer.last_path.kernel
    backward = "backward_stack" if kind == "lstm" else "backward_layer"
    assert "forward_saving" in traced and backward in traced, traced
    want_outs, want_grads = _outputs_and_grads(reference, x, weights)
    dtype = policy.removeprefix("mixed_")
    tol = TOLERANCE[dtype]
    errors = {f"out{i}": _rel(o, w) for i, (o, w) in enumerate(zip(outs, want_outs))}
    errors.update({f"grad_{v.path}": _rel(g, w)
                   for v, g, w in zip(fast.trainable_variables, grads, want_grads)})
    report(f"jax_wavefront_{kind}_{dtype}", errors)
    for name, err in errors.items():
        assert err <= (2 * tol if name.startswith("grad") else tol), (name, err)
    predicted = np.asarray(fast.predict(x, verbose=0)[0], np.float32)
    assert "forward" in traced
    assert _rel(predicted, want_outs[0]) <= tol


@pytest.mark.real_gpu_only
def test_the_compiled_step_holds_the_handlers(traced):
    keras.config.set_dtype_policy("mixed_float16")
    fast, _ = _models("lstm", 2, 64, 10, "mixed_float16")
    x = jnp.ones((8, 10, 32), jnp.float32)
    variables = [v.value for v in fast.trainable_variables]
    frozen = [v.value for v in fast.non_trainable_variables]

    def loss(values):
        outs, _ = fast.stateless_call(values, frozen, x, training=True)
        return jnp.sum(outs[0].astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).lower(variables).as_text()
    assert "rnnfuse_wf_ffi_forward_saving" in text and "rnnfuse_wf_ffi_backward_stack" in text
    assert "callback" not in text.lower()


def _step_ms(run, repeats):
    return 1000 * median_seconds(run, repeats)  # after one call that compiles


@pytest.mark.real_gpu_only
def test_fit_and_predict_steps_at_4x512_batch_64(traced):
    """Keras' jitted fit and predict steps (ms a batch of 64, T=1000,
    float16): rnnfuse's kernel against Keras-on-JAX's LSTM (mixed_float16
    where Keras runs it, its float32 cuDNN call, and its generic loop)."""
    steps, batch, n = 1000, 64, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * n, steps, 512)).astype("float32")
    y = rng.standard_normal((batch * n, steps, 512)).astype("float32")
    rows = {}

    def timed(name, model):
        model.compile(optimizer="sgd", loss="mse")
        try:
            rows[f"{name}_fit_ms"] = _step_ms(
                lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0), 2) / n
            rows[f"{name}_predict_ms"] = _step_ms(
                lambda: model.predict(x, batch_size=batch, verbose=0), 2) / n
        except Exception as exc:  # noqa: BLE001 - a Keras path that fails here is a row
            rows[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    def lstm_model(policy, use_cudnn="auto"):
        keras.config.set_dtype_policy(policy)
        inp = keras.Input((steps, 512))
        h = inp
        for _ in range(4):
            h = keras.layers.LSTM(512, return_sequences=True, use_cudnn=use_cudnn)(h)
        out = keras.layers.Activation("linear", dtype="float32")(h)
        return keras.Model(inp, out)

    original = lstm_model("mixed_float16")
    fast = rnnfuse.optimize(original, tune=False,
                            plan=lambda g: Plan((g.num_layers,), kernel="wavefront"))
    timed("rnnfuse_wavefront_fp16", fast)
    assert "forward_saving" in traced and "backward_stack" in traced, traced
    (layer,) = fused_layers(fast)
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME
    timed("keras_fp16", lstm_model("mixed_float16"))
    timed("keras_fp16_generic_loop", lstm_model("mixed_float16", use_cudnn=False))
    timed("keras_fp32_cudnn", lstm_model("float32"))
    keras.config.set_dtype_policy("float32")
    rows["device"] = jax.devices()[0].device_kind
    report("jax_wavefront_4x512_b64_t1000", rows)
    assert "rnnfuse_wavefront_fp16_fit_ms" in rows, rows
