"""rnnfuse's cuDNN core under Keras' JAX backend on a real GPU (XLA FFI).

Runs only with KERAS_BACKEND=jax and a GPU visible to JAX (the handlers
and the core are built on first use: g++, jaxlib's FFI headers, cuDNN's
headers):

    KERAS_BACKEND=jax python3 -m pytest -q -s tests/gpu/test_gpu_core_jax.py

Every test spies on the binding's `ffi_call` (the targets traced into each
step), reads the fused layer's `last_path` and checks that the compiled
step holds the handlers' custom calls, so a silent fallback (the original
layers) fails. Outputs, final states and every gradient (jax.grad of a
weighted sum, jitted) are compared with the original Keras layers, as the
largest error relative to the reference's largest magnitude: float32 runs
with JAX's matmul precision "highest" on both sides (the core then runs
IEEE float32, the layers exact float32 matmuls): LSTM/GRU within 5e-4
(outputs) and 1e-3 (gradients) (cuDNN's and XLA's float32 sums differ in
order over 3 levels and 40-50 steps), SimpleRNN within 2e-3 / 2e-2
(cuDNN's tanh); half precision against the same layers in float32, as
||a - b|| / ||b||, within 1e-2 (float16) and 6e-2 (bfloat16). A packing
mistake gives O(1). Each test prints what it measured and the path taken.

RNNFUSE_GPU_DRYRUN=1 runs the tests on the CPU with the emulated targets
(tests/jax_backend/core_emulation.py) to check the tests themselves; it
proves nothing about cuDNN.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX GPU tests need KERAS_BACKEND=jax", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rnnfuse  # noqa: E402
from builders import fused_layers, random_inputs, rnn_layer, stack_model  # noqa: E402
from rnnfuse.backends.jax import cudnn_core  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402

L = keras.layers
DRYRUN = bool(os.environ.get("RNNFUSE_GPU_DRYRUN"))
HALF_TOLERANCE = {"float16": 1e-2, "bfloat16": 6e-2}


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    if DRYRUN:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "jax_backend"))
        import core_emulation

        core_emulation.install(monkeypatch)
    else:
        reason = cudnn_core.register()
        print(f"\ncuDNN core FFI registration: {reason or 'ok'}; device "
              f"{jax.devices()[0].device_kind}")
        assert reason is None, reason
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", previous)
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def traced(monkeypatch):
    """The core's FFI targets traced into steps, with their attributes (the
    calls still run)."""
    calls = []
    real = cudnn_core.ffi_call

    def spy(target, results, *operands, **kwargs):
        calls.append((target.removeprefix("rnnfuse_cudnn_ffi_"),
                      {k: v for k, v in kwargs.items() if k != "input_output_aliases"}))
        return real(target, results, *operands, **kwargs)

    monkeypatch.setattr(cudnn_core, "ffi_call", spy)
    return calls


def _names(calls):
    return [name for name, _ in calls]


def _weighted_loss(out):
    return sum(jnp.sum(t.astype(jnp.float32) * jnp.sin(jnp.arange(t.shape[-1]) + 1.0)
                       + t.astype(jnp.float32) ** 2) for t in jax.tree.leaves(out))


def _grad_fn(model, variables, training=False):
    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = model(inputs, training=training)
        return _weighted_loss(out)

    return jax.jit(jax.grad(loss))


def _outputs_and_grads(model, inputs, variables, training=False):
    out = [np.asarray(t, np.float64) for t in jax.tree.leaves(model(inputs, training=training))]
    grads = _grad_fn(model, variables, training)([v.value for v in variables], inputs)
    return out, [np.asarray(g, np.float64) for g in grads]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-6))


def _norm_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-12))


def _compare(model, fast, inputs, *, out_tol, grad_tol, measure=_rel, label=""):
    o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
    o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    assert len(o0) == len(o1), (len(o0), len(o1))
    worst_out = max(measure(b, a) for a, b in zip(o0, o1))
    worst_grad = max(measure(b, a) for a, b in zip(g0, g1))
    print(f"{label}: worst error: outputs {worst_out:.2e}, gradients {worst_grad:.2e}")
    assert worst_out <= out_tol and worst_grad <= grad_tol, (worst_out, worst_grad)
    return worst_out, worst_grad


def _randomize(model, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-scale, scale, v.shape).astype(v.dtype))


# A narrow state's call without a plan algorithm: PyTorch's choice.
SMALL_H = "persistent_static_small_h"


def _on_core(fast, algorithm="standard"):
    (layer,) = fused_layers(fast)
    path = layer.last_path
    print(f"path: {path}")
    ran = path.kernel
    assert ran is not None and ran.name == cudnn_core.KERNEL_NAME, path
    if algorithm is not None:
        assert ran.algorithm.startswith(algorithm), ran
    return ran


def _compiled_holds_the_core(fast, inputs, variables):
    """The compiled gradient step holds the handlers' custom calls."""
    if DRYRUN:
        return
    text = _grad_fn(fast, variables).lower([v.value for v in variables], inputs).compile().as_text()
    for target in ("rnnfuse_cudnn_ffi_forward_training", "rnnfuse_cudnn_ffi_backward_data",
                   "rnnfuse_cudnn_ffi_backward_weights"):
        assert target in text, f"{target} is not in the compiled step"


def _stack3(kind, bidirectional, steps=50, features=16, units=32):
    inp = keras.Input((steps, features))
    x = inp
    for _ in range(3):
        layer = rnn_layer(kind, units, return_sequences=True)
        x = (L.Bidirectional(layer) if bidirectional else layer)(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_core_matches_keras(kind, bidirectional, traced):
    model = _stack3(kind, bidirectional)
    _randomize(model, scale=0.5 if kind in ("lstm", "gru") else 0.1)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = np.random.default_rng(1).standard_normal((8, 50, 16)).astype("float32")
    tols = dict(out_tol=5e-4, grad_tol=1e-3) if kind in ("lstm", "gru") else dict(
        out_tol=2e-3, grad_tol=2e-2)
    _compare(model, fast, inputs, label=f"{kind} bidirectional={bidirectional}", **tols)
    _on_core(fast, SMALL_H)
    print(f"targets traced: {_names(traced)}")
    assert _names(traced)[:4] == ["forward", "forward_training", "backward_data",
                                  "backward_weights"], traced
    attrs = traced[0][1]
    assert int(attrs["mode"]) == cudnn_core.MODES.index(kind)
    assert int(attrs["directions"]) == (2 if bidirectional else 1)
    _compiled_holds_the_core(fast, inputs, model.trainable_variables)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_right_padded_masks_run_as_lengths(kind, traced):
    model = stack_model(kind, 3, units=32, input_size=16, steps=40, masked=True,
                        last_return_sequences=True, last_return_state=True)
    _randomize(model, 2)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    tokens = random_inputs(model, 8, np.random.default_rng(3), padding="right")
    tokens[0, 5:] = 0
    print(f"lengths: {(tokens != 0).sum(axis=1).tolist()}")
    _compare(model, fast, tokens, out_tol=5e-4, grad_tol=1e-3, label=f"masked {kind}")
    _on_core(fast)
    core = [attrs for name, attrs in traced if name == "forward"]
    assert core and int(core[0]["full_lengths"]) == 0, traced


@pytest.mark.parametrize("kind", ["gru", "rnn_tanh"])
def test_initial_state_go_backwards_and_return_state(kind, traced):
    model = stack_model(kind, 3, units=32, input_size=16, steps=40, initial_state=True,
                        go_backwards_first=True, last_return_state=True)
    _randomize(model, 4, scale=0.5 if kind == "gru" else 0.1)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((8, 40, 16)).astype("float32")]
    inputs += [rng.standard_normal((8, 32)).astype("float32")
               for _ in range(len(model.inputs) - 1)]
    tols = dict(out_tol=5e-4, grad_tol=1e-3) if kind == "gru" else dict(out_tol=2e-3, grad_tol=2e-2)
    _compare(model, fast, inputs, label=f"{kind} initial state, go_backwards", **tols)
    _on_core(fast, SMALL_H)
    assert "backward_data" in _names(traced)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("algorithm", [SMALL_H, "persistent_static+tc"])
def test_half_precision_and_algorithms(policy, kind, algorithm, traced):
    """Bidirectional, as speech encoders are, against the same weights in
    float32 (Keras' own half-precision LSTM fails on JAX's GPU). cuDNN may
    refuse a persistent algorithm for a shape: then the call must say so
    in its note and still be right."""
    dtype = policy.removeprefix("mixed_")
    tol = HALF_TOLERANCE[dtype]
    twin = _stack3(kind, True, steps=40, units=64)
    _randomize(twin, 6, scale=0.2)
    inputs = np.random.default_rng(7).standard_normal((16, 40, 16)).astype("float32")
    o_ref, g_ref = _outputs_and_grads(twin, inputs, twin.trainable_variables)
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = _stack3(kind, True, steps=40, units=64)
        model.set_weights(twin.get_weights())
        plan = Plan((3,), None if algorithm == SMALL_H else algorithm)
        fast = rnnfuse.optimize(model, plan=plan)
        o, g = _outputs_and_grads(fast, inputs, model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    worst_out = max(_norm_rel(a, b) for a, b in zip(o, o_ref))
    worst_grad = max(_norm_rel(a, b) for a, b in zip(g, g_ref))
    ran = _on_core(fast, None)
    print(f"{policy} {kind} {algorithm}: ran {ran}; from float32: outputs {worst_out:.2e}, "
          f"gradients {worst_grad:.2e}")
    assert worst_out <= tol and worst_grad <= 2 * tol, (worst_out, worst_grad)
    assert ran.algorithm == algorithm or "refused" in (ran.note or ""), ran
    assert "backward_weights" in _names(traced)


def test_between_layer_dropout_is_cudnns_seeded_and_trains(traced):
    """An absorbed Dropout runs as cuDNN's: a training call differs from
    inference (which equals Keras'), two training calls draw new masks, and
    the backward runs on the forward's reserve (finite gradients)."""
    inp = keras.Input((30, 16))
    x = L.LSTM(32, return_sequences=True)(inp)
    x = L.Dropout(0.5, seed=3)(x)
    out = L.LSTM(32, return_sequences=True)(x)
    model = keras.Model(inp, out)
    _randomize(model, 8)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    inputs = np.random.default_rng(9).standard_normal((8, 30, 16)).astype("float32")
    ref = np.asarray(model(inputs, training=False))
    assert _rel(fast(inputs, training=False), ref) <= 5e-4
    _on_core(fast, None)
    if DRYRUN:
        return  # the emulation applies no dropout
    a = np.asarray(fast(inputs, training=True))
    b = np.asarray(fast(inputs, training=True))
    print(f"dropout: training vs inference {_rel(a, ref):.2e}, two training calls "
          f"{_rel(a, b):.2e}")
    assert _rel(a, ref) > 1e-3 and _rel(a, b) > 1e-3
    training = [attrs for name, attrs in traced if name == "forward_training"]
    assert training and abs(float(training[-1]["dropout"]) - 0.5) < 1e-6, traced
    grads = _grad_fn(fast, model.trainable_variables, training=True)(
        [v.value for v in model.trainable_variables], inputs)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_fit_compiles_the_step_once_and_trains(traced):
    """Keras' jitted train step runs the core: traced once (no retrace per
    step), the loss falls, the variables move."""
    model = stack_model("gru", 3, units=32, input_size=16, steps=30, head=True)
    _randomize(model, 12, scale=0.3)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(13)
    x = rng.standard_normal((64, 30, 16)).astype("float32")
    y = rng.standard_normal((64,) + tuple(fast.output_shape[1:])).astype("float32")
    before = [np.asarray(v.value).copy() for v in fast.trainable_variables]
    history = fast.fit(x, y, batch_size=16, epochs=3, verbose=0)
    losses = history.history["loss"]
    after = [np.asarray(v.value) for v in fast.trainable_variables]
    names = _names(traced)
    print(f"fit losses {losses}; targets traced {names}")
    # Traced once or twice (Keras may trace a step twice), not once a step (12).
    assert 1 <= names.count("forward_training") <= 2, names
    assert losses[-1] < losses[0]
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    _on_core(fast, SMALL_H)


@pytest.mark.parametrize("policy, tol", [("float32", 5e-4), ("mixed_float16", 1e-2)])
def test_projected_lstm_stack_runs_the_cores_projection(policy, tol, traced):
    """An optimized ProjectedLSTM stack (LSTMP) against Keras' generic loop."""
    from rnnfuse.layers import ProjectedLSTM

    keras.mixed_precision.set_global_policy(policy)
    try:
        inp = keras.Input((40, 16))
        x = inp
        for _ in range(3):
            x = L.Bidirectional(ProjectedLSTM(64, 16, return_sequences=True))(x)
        model = keras.Model(inp, x)
        _randomize(model, 10, 0.3)
        inputs = np.random.default_rng(11).standard_normal((8, 40, 16)).astype("float32")
        o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
        fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
        o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    worst = (_norm_rel(o1[0], o0[0]), max(_norm_rel(b, a) for a, b in zip(g0, g1)))
    print(f"ProjectedLSTM {policy}: worst (out, grad) {worst}")
    _on_core(fast)
    assert worst[0] <= tol and worst[1] <= 10 * tol
    assert int(traced[0][1]["proj_size"]) == 16


def _keras_step_fails(model, x, y) -> str | None:
    """Keras' own one-step fit of `model`: None, or the error's first line."""
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", auto_scale_loss=False)
    try:
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    except Exception as err:  # noqa: BLE001 - what Keras raises is the observation
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return None


@pytest.mark.call_budget  # one-step calls under the library's own budget
@pytest.mark.parametrize("tune", [False, "auto"])
def test_mixed_float16_lstm_runs_fused_by_default_and_trains(tune, traced, monkeypatch):
    """A mixed_float16 LSTM stack, whose Keras step fails on JAX's GPU
    (jaxlib's cuDNN RNN takes float32 and float64 only), under optimize()'s
    defaults (tune=False, or first-batch tuning with a one-step predict and
    fit, too short to time: nothing is timed): the static plan fuses it with
    the reason, one fit step runs the core's training calls, and the step's
    update matches Keras' float32 one from the same weights."""
    from rnnfuse.backends import jax as jax_backend
    from rnnfuse.backends.jax import keras_paths
    from rnnfuse.tuning import first_batch

    if DRYRUN:  # the CPU has no jaxlib cuDNN path to fail: say Keras sees a GPU,
        monkeypatch.setattr(keras_paths, "keras_sees_gpu", lambda: True)
        # and first-batch tuning a device to time on.
        monkeypatch.setattr(jax_backend, "device_environment",
                            lambda: {"device": "FakeGPU", "jax": jax.__version__})
    tol = HALF_TOLERANCE["float16"]
    twin = stack_model("lstm", 3, units=32, input_size=16, steps=40, head=True)
    _randomize(twin, 14, scale=0.3)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((16, 40, 16)).astype("float32")
    y = rng.standard_normal((16, 3)).astype("float32")
    start = twin.get_weights()
    reference = np.asarray(twin.predict(x, verbose=0), np.float64)
    assert _keras_step_fails(twin, x, y) is None
    twin_delta = [a - b for a, b in zip(twin.get_weights(), start)]
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        if not DRYRUN:
            own = stack_model("lstm", 3, units=32, input_size=16, steps=40, head=True)
            own.set_weights(start)
            print(f"Keras' own mixed_float16 step: {_keras_step_fails(own, x, y) or 'ran'}")
        model = stack_model("lstm", 3, units=32, input_size=16, steps=40, head=True)
        model.set_weights(start)
        (chosen,) = rnnfuse.optimize(model, tune=tune, cache=False, return_result=True).plans
        fast = rnnfuse.optimize(model, tune=tune, cache=False)
        fast.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", auto_scale_loss=False)
        before = np.asarray(fast.predict(x, verbose=0), np.float64)
        traced.clear()
        fast.fit(x, y, batch_size=16, epochs=1, verbose=0)
        fast_delta = [a - b for a, b in zip(model.get_weights(), start)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"tune={tune}: plan {chosen.plan.name} ({chosen.source}); targets {_names(traced)}")
    assert chosen.plan.name == "fused", chosen
    assert "Keras' cuDNN LSTM on JAX fails in float16" in chosen.source, chosen.source
    records = first_batch.decisions(fast)
    assert all(r["source"].startswith("static: a call of 1 steps cannot pay")
               and not r["timings_ms"] for r in records), records
    assert {r["mode"] for r in records} == ({"inference", "training"} if tune else set())
    (layer,) = fused_layers(fast)
    assert layer.plan.name == "fused", layer.plan
    _on_core(fast, None)
    assert {"forward_training", "backward_data", "backward_weights"} <= set(_names(traced))
    out = _norm_rel(before, reference)
    worst_delta = max(_norm_rel(a, b) for a, b in zip(fast_delta, twin_delta))
    print(f"mixed_float16 LSTM 3x32 against Keras float32: outputs {out:.2e}, "
          f"one step's update {worst_delta:.2e}")
    assert out <= tol and worst_delta <= 2 * tol, (out, worst_delta)
