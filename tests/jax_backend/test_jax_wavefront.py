"""rnnfuse's wavefront kernel under JAX (rnnfuse/backends/jax/wavefront.py),
on the CPU: the FFI calls are emulated (wavefront_emulation.py: what the
binding passes to `jax.ffi.ffi_call`, checked against the handlers'
contracts, answered with the kernel's arithmetic in jax.numpy), the FFI
library's registration is skipped and the device's plan is a fake limit
(a stack fits when layers x units <= LIMIT). Everything between FusedRNN
and `jax.ffi.ffi_call` is the real code: the plan's kernel, the packing,
the custom_vjp and its GEMMs, the fallbacks with their reasons, Keras'
jitted train and predict steps. The real kernel: tests/gpu/test_gpu_wavefront_jax.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff, wavefront_inputs, wavefront_stack
from cudnn_reference import cudnn_rnn
from fake_clock import FakeTimer
from rnnfuse.backends import get_backend
from rnnfuse.backends.cuda import library
from rnnfuse.backends.jax import wavefront
from rnnfuse.passes import build_layer_graph, plan_fusion
from rnnfuse.plan import Plan
from wavefront_emulation import install, targets

WAVEFRONT = Plan((2,), kernel="wavefront")
LIMIT = 48  # the fake on-chip plan: layers x units above this do not fit
FP16_TOL = 5e-3


@pytest.fixture
def emulated(monkeypatch):
    return install(monkeypatch, LIMIT)


def _targets(emulation):
    return targets(emulation.calls)


# -- the binding: packing and custom_vjp against cuDNN's equations -------------------------


def _canonical(kind, layers, units, inputs, rng):
    g = 4 if kind == "lstm" else 3
    mats, biases = [], []
    for layer in range(layers):
        n = inputs if layer == 0 else units
        mats += [rng.standard_normal(g * units * n) * 0.4, rng.standard_normal(g * units * units) * 0.4]
        biases += [rng.standard_normal(g * units) * 0.2, rng.standard_normal(g * units) * 0.2]
    return jnp.asarray(np.concatenate(mats + biases), jnp.float32)


def _reference(kind, x, params, h0, c0, lengths):
    y, hy, cy = cudnn_rnn(jnp, x, h0, c0, params, lengths, kind, False)
    return y, hy, cy


@pytest.mark.parametrize("kind,backward", [("lstm", "stack"), ("lstm", "layer"), ("gru", "layer")])
@pytest.mark.parametrize("ragged", [False, True])
def test_outputs_and_gradients_are_cudnns_equations(emulated, kind, backward, ragged):
    """Float32 through the emulation (the real kernel runs float16 and
    bfloat16; the wiring is the same): forward and jax.grad of every input
    against cuDNN's equations differentiated by JAX."""
    rng = np.random.default_rng(0)
    layers, units, inputs, batch, steps = 2, 4, 3, 3, 5
    params = _canonical(kind, layers, units, inputs, rng)
    x = jnp.asarray(rng.standard_normal((steps, batch, inputs)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((layers, batch, units)) * 0.3, jnp.float32)
    c0 = jnp.asarray(rng.standard_normal((layers, batch, units)) * 0.3, jnp.float32)
    lengths = jnp.asarray([5, 2, 1] if ragged else [5] * batch, jnp.int32)
    weights = [jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in [(steps, batch, units), (layers, batch, units), (layers, batch, units)]]

    def loss(run, x, params, h0, c0):
        y, hy, cy = run(x, params, h0, c0)
        out = jnp.sum(y * weights[0]) + jnp.sum(hy * weights[1])
        return out + (jnp.sum(cy * weights[2]) if cy is not None else 0.0)

    def kernel(x, params, h0, c0):
        return wavefront.forward(x, params, h0, c0 if kind == "lstm" else None,
                                 lengths if ragged else None, kind=kind, backward=backward)

    def reference(x, params, h0, c0):
        return _reference(kind, x, params, h0, c0 if kind == "lstm" else None, lengths)

    got = jax.jit(kernel)(x, params, h0, c0)
    want = reference(x, params, h0, c0)
    assert _targets(emulated) == ["forward"]
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3)))(x, params, h0, c0)
    ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(x, params, h0, c0)
    backward_targets = ["backward_stack"] if backward == "stack" else ["backward_layer"] * layers
    assert _targets(emulated) == ["forward", "forward_saving"] + backward_targets
    for name, g, w in zip(["dx", "dparams", "dh0", "dc0"], grads, ref):
        if kind == "gru" and name == "dc0":
            continue
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)
    assert float(jnp.max(jnp.abs(grads[1]))) > 0


def test_the_gradient_is_not_the_reference_with_a_wrong_gemm(emulated, monkeypatch):
    """The gradient test above can fail: a transposed weight gradient breaks it."""
    rng = np.random.default_rng(1)
    params = _canonical("lstm", 2, 4, 4, rng)
    x = jnp.asarray(rng.standard_normal((5, 3, 4)), jnp.float32)
    h0 = c0 = jnp.zeros((2, 3, 4), jnp.float32)
    lengths = jnp.full((3,), 5, jnp.int32)

    def grad(run):
        return jax.grad(lambda p: jnp.sum(run(p)[0] ** 2))(params)

    want = grad(lambda p: _reference("lstm", x, p, h0, c0, lengths))
    good = grad(lambda p: wavefront.forward(x, p, h0, c0, None, kind="lstm"))
    np.testing.assert_allclose(good, want, rtol=1e-4, atol=1e-5)
    real = wavefront._matmul
    monkeypatch.setattr(wavefront, "_matmul",
                        # The weight GEMMs (over T * B = 15 rows) read dgates reversed.
                        lambda a, b, dt: real(a[:, ::-1] if b.shape[0] == 15 else a, b, dt))
    bad = grad(lambda p: wavefront.forward(x, p, h0, c0, None, kind="lstm"))
    assert float(jnp.max(jnp.abs(bad - want))) > 1e-2


def test_the_forward_passes_the_handlers_attributes_and_the_librarys_variants(emulated,
                                                                               monkeypatch):
    # Two steps: the gradient below compiles the emulation's unrolled loop.
    x = jnp.ones((2, 4, 5), jnp.float16)
    params = jnp.zeros((4 * 8 * (5 + 8) + 4 * 8 * 16 + 2 * 2 * 32,), jnp.float16)
    h0 = jnp.zeros((2, 4, 8), jnp.float16)
    wavefront.forward(x, params, h0, h0, jnp.full((4,), 2), kind="lstm")
    (target, attrs), = emulated.calls
    assert target == "rnnfuse_wf_ffi_forward"
    assert attrs == {"gru": 0, "input_size": 5, "variant": library.FORWARD_VARIANT}
    monkeypatch.setattr(library, "FORWARD_VARIANT", 1)
    monkeypatch.setattr(library, "STACK_BACKWARD_VARIANT", 2)
    jax.grad(lambda p: jnp.sum(wavefront.forward(x, p, h0, h0, None, kind="lstm",
                                                 backward="stack")[0].astype(jnp.float32)))(params)
    assert [a["variant"] for _, a in emulated.calls[1:]] == [1, 2]


@pytest.mark.parametrize("bad,match", [
    (dict(kind="simple_rnn"), "kind must be one of"),
    (dict(kind="lstm", backward="auto"), "backward must be 'stack' or 'layer'"),
    (dict(kind="gru", backward="stack"), "runs LSTM stacks only"),
])
def test_bad_arguments_say_what_was_received(emulated, bad, match):
    z = jnp.zeros((1, 1, 1), jnp.float16)
    with pytest.raises(ValueError, match=match):
        wavefront.forward(z, jnp.zeros((8,), jnp.float16), z, z, None, **bad)


# -- the backend: plans, Keras' steps, fallbacks --------------------------------------------


def _optimized(model, plan):
    """`model` optimized with `plan` for its group (the static plan under
    JAX keeps the layers)."""
    return rnnfuse.optimize(model, tune=False, plan=lambda g: plan.for_length(g.num_layers))


def _fused(model, plan):
    (layer,) = fused_layers(_optimized(model, plan))
    return layer


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


def _grads(layer, x, weights):
    variables = layer.trainable_variables

    def loss(values, x):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = layer(x, training=True)
        return jnp.sum(y.astype(jnp.float32) * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))([v.value for v in variables], x)
    return [np.asarray(g, np.float64) for g in (*grads[0], grads[1])]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_layer_on_the_wavefront_plan_matches_the_original_layers(emulated, half, kind):
    model = wavefront_stack(kind)
    layer = _fused(model, WAVEFRONT)
    x = wavefront_inputs()
    y = layer(x, training=False)
    ran = layer.last_path.kernel
    assert layer.last_path.kind == "fused" and ran.name == wavefront.KERNEL_NAME
    assert ran.note is None and _targets(emulated) == ["forward"]
    assert str(y.dtype) == "float16"
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((4, 7, 8)), jnp.float32)
    grads = _grads(layer, jnp.asarray(x), weights)
    assert layer.last_path.kernel.algorithm == ("backward=stack" if kind == "lstm"
                                                else "backward=layer")
    assert "forward_saving" in _targets(emulated)
    layer.set_plan(Plan(()))  # the original layers
    assert max_abs_diff(y, layer(x, training=False)) <= FP16_TOL
    want = _grads(layer, jnp.asarray(x), weights)
    for g, w in zip(grads, want):
        assert np.max(np.abs(g - w)) <= 2 * FP16_TOL * max(1.0, np.max(np.abs(w)))
    assert all(np.max(np.abs(g)) > 0 for g in grads)


def test_assigning_a_variable_changes_the_fused_output(emulated, half):
    layer = _fused(wavefront_stack(), WAVEFRONT)
    x = wavefront_inputs()
    before = np.asarray(layer(x), np.float32)
    cell = layer.fused_layers[0].cell
    cell.recurrent_kernel.assign(cell.recurrent_kernel.value * 0.5)
    assert np.max(np.abs(np.asarray(layer(x), np.float32) - before)) > 1e-3


def test_a_shape_the_kernel_refuses_runs_the_layers_with_both_reasons(emulated, half):
    """A float16 LSTM that the kernel's plan refuses, where the cuDNN core
    cannot run either (no GPU): the original layers run, saying why."""
    model = wavefront_stack(layers=4, units=16)
    layer = _fused(model, Plan((4,), kernel="wavefront"))
    x = wavefront_inputs()
    y = layer(x, training=False)
    assert emulated.calls == [] and layer.last_path.kind == "layers"
    reason = str(layer.last_path.reason)
    assert "4 layers of 16 units do not fit on chip" in reason and "JAX runs on the cpu" in reason
    assert max_abs_diff(y, model(x)) <= FP16_TOL


def test_a_float32_lstm_on_the_wavefront_plan_runs_cudnn_with_the_reason(
        emulated, emulated_core):
    layer = _fused(wavefront_stack(), WAVEFRONT)
    layer(wavefront_inputs(), training=False)
    ran = layer.last_path.kernel
    assert emulated.calls == [] and ran.name == "rnnfuse cuDNN core (XLA FFI)"
    assert [t for t, _ in emulated_core.calls] == ["rnnfuse_cudnn_ffi_forward"]
    assert "float16 and bfloat16, not float32" in ran.note and "cuDNN runs it" in ran.note


def test_a_missing_ffi_library_runs_the_layers_with_the_build_failure(emulated, half,
                                                                     monkeypatch):
    monkeypatch.setattr(wavefront, "register",
                        lambda: "rnnfuse's XLA FFI library of the wavefront kernel is not available: "
                        "no nvcc found")
    layer = _fused(wavefront_stack("gru"), WAVEFRONT)
    layer(wavefront_inputs(), training=False)
    assert emulated.calls == [] and layer.last_path.kind == "layers"
    assert "no nvcc found" in str(layer.last_path.reason)


def test_registration_off_the_gpu_says_why(monkeypatch):
    monkeypatch.setattr(wavefront, "_REGISTERED", {})
    assert "CUDA GPUs only" in wavefront.register()


def test_the_plan_record_of_the_backend(emulated, half):
    backend = get_backend()
    assert "wavefront" in backend.capabilities.inference_kernels
    assert "wavefront" in backend.capabilities.training_kernels
    model = wavefront_stack()
    (group,) = _groups(model)
    assert backend.kernel_reason("wavefront", group, (4, 7, 5)) is None
    assert emulated.asked[-1] == ("lstm", 2, 8, 4, 7, 5)
    big = _groups(wavefront_stack(layers=4, units=16))[0]
    assert backend.kernel_reason("wavefront", big, (4, 7, 5), training=True) == \
        "4 layers of 16 units do not fit on chip"
    assert "no 'stock' kernel" in backend.kernel_reason("stock", group, (4, 7, 5))
    keras.config.set_dtype_policy("float32")
    group32 = _groups(wavefront_stack())[0]
    assert "not float32" in backend.kernel_reason("wavefront", group32, (4, 7, 5))


def test_fit_and_predict_trace_once_and_call_no_host_callback(emulated, half):
    """Keras' JAX trainer compiles the step once: the kernel is traced into
    it (one forward_saving and its backward a trace), and more steps and
    epochs neither retrace nor call back to the host."""
    model = wavefront_stack()
    fast = _optimized(model, WAVEFRONT)
    fast.compile(optimizer="sgd", loss="mse")
    x, y = wavefront_inputs(batch=16), np.zeros((16, 7, 8), "float32")
    callbacks = []
    real = jax.pure_callback

    def spy(*args, **kwargs):
        callbacks.append(args)
        return real(*args, **kwargs)

    jax.pure_callback = spy
    try:
        fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
        traced = _targets(emulated)
        fast.fit(x, y, batch_size=4, epochs=2, verbose=0)
        assert _targets(emulated) == traced  # 12 more steps, no new trace
        fast.predict(x, batch_size=4, verbose=0)
        predicted = _targets(emulated)
        fast.predict(x, batch_size=4, verbose=0)
        assert _targets(emulated) == predicted
    finally:
        jax.pure_callback = real
    assert traced.count("forward_saving") == 1 and traced.count("backward_stack") == 1
    assert predicted[len(traced):].count("forward") == 1
    assert callbacks == []


def test_the_jitted_step_lowers_to_the_ffi_custom_call(half):
    """The real binding (no emulation) lowers to XLA custom calls of the
    handlers' targets, with no host callback in the module."""
    x = jnp.zeros((7, 4, 5), jnp.float16)
    params = jnp.zeros((4 * 8 * (5 + 8) + 4 * 8 * 16 + 2 * 2 * 32,), jnp.float16)
    h0 = jnp.zeros((2, 4, 8), jnp.float16)

    def step(params):
        y, _, _ = wavefront.forward(x, params, h0, h0, None, kind="lstm", backward="stack")
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.grad(step)).lower(params).as_text()
    assert 'rnnfuse_wf_ffi_forward_saving' in text and 'rnnfuse_wf_ffi_backward_stack' in text
    assert "callback" not in text.lower()


# -- the tuner ----------------------------------------------------------------------------


ENV = {"device": "FakeGPU", "jax": jax.__version__, "backend": "jax", "rnnfuse": "0.1.0"}


@pytest.mark.parametrize("kind,training", [("lstm", False), ("lstm", True), ("gru", True)])
def test_the_tuner_times_the_wavefront_plan_under_jax(emulated, half, monkeypatch, kind,
                                                       training):
    from rnnfuse.tuning import tuner

    monkeypatch.setattr(tuner, "_steps", lambda group, plans, *a, **k: {p.name: None
                                                                       for p in plans})
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (result,) = tuner.tune_plans(_groups(wavefront_stack(kind)), lambda g: (8, 7, 5),
                                 training=training, cache=None, measure=timer, environment=ENV,
                                 progress=False, check_gradients=lambda g, p, s, d: 1e-6)
    assert "fused on wavefront" in timer.names[0]
    assert result.plan == WAVEFRONT and result.timings["fused on wavefront"] == 0.5
    assert emulated.asked == [(kind, 2, 8, 8, 7, 5)]


def test_tune_times_the_kernels_jitted_step(emulated, half):
    """`optimize(model, tune=...)`'s timing on the emulated kernel: its
    candidate is a real jitted training step (forward and backward targets
    traced)."""
    from rnnfuse.api import choose_plans

    model = wavefront_stack()
    (result,) = choose_plans(model, rnnfuse.analyze(model).groups,
                             tune=rnnfuse.TuneShape(4, 7), cache=False)
    assert result.source == "measured"
    assert "fused on wavefront" in result.timings, result
    assert {"forward_saving", "backward_stack"} <= set(_targets(emulated))


def test_first_batch_tuning_under_jax_times_the_kernel(emulated, half, monkeypatch):
    """`optimize(model)` on an accelerator (faked) makes a switchable layer;
    `fit`'s first batch times the candidates outside Keras' trace, the
    kernel's jitted training step among them, and fits on the choice."""
    from rnnfuse.tuning import first_batch, per_shape

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    monkeypatch.setattr(per_shape, "device_environment", lambda: dict(ENV))
    fast = rnnfuse.optimize(wavefront_stack(), cache=False)
    fast._rnnfuse_autotune.fit_share = None  # a 1-step fit times everything
    (layer,) = fused_layers(fast)
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(wavefront_inputs(batch=8), np.zeros((8, 7, 8), "float32"), batch_size=8, epochs=1,
             verbose=0)
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["source"] == "measured"
    assert "fused on wavefront" in record["timings_ms"], record
    assert layer.plan.name == record["chosen"]
    assert {"forward_saving", "backward_stack"} <= set(_targets(emulated))
