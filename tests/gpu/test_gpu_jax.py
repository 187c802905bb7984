"""FusedRNN under Keras' JAX backend on a real GPU (rnnfuse's cuDNN core).

Runs only with KERAS_BACKEND=jax and a GPU visible to JAX. A spy on the
binding's single call site (`rnnfuse.backends.jax.cudnn_core.ffi_call`)
proves the multi-layer call ran (a silent fallback to Keras' layers
fails); the traced train step must hold the core's custom calls.
tests/gpu/test_gpu_core_jax.py covers every kind, dtype and dropout.

    KERAS_BACKEND=jax python3 -m pytest -q tests/gpu/test_gpu_jax.py

Tolerances: float32 relative error <= 5e-4 (outputs), 1e-3 (gradients);
matmul precision "highest" (no TF32), as Keras' own cuDNN LSTM then runs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX backend's GPU tests need KERAS_BACKEND=jax", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rnnfuse  # noqa: E402
from builders import assert_fastest_or_kept_original, fit_from_same_start, fused_layers, random_inputs, stack_model  # noqa: E402
from rnnfuse.backends.jax import cudnn_core  # noqa: E402

L = keras.layers


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def lstm_calls(monkeypatch):
    """The core's forward calls traced (their attributes)."""
    calls = []
    real = cudnn_core.ffi_call

    def spy(target, results, *operands, **kwargs):
        if "forward" in target:
            calls.append(dict(num_layers=int(kwargs["num_layers"]),
                              bidirectional=int(kwargs["directions"]) == 2,
                              platform=jax.default_backend()))
        return real(target, results, *operands, **kwargs)

    monkeypatch.setattr(cudnn_core, "ffi_call", spy)
    return calls


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def _loss_and_grads(model, inputs):
    variables = model.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = model(inputs)
        leaves = jax.tree.leaves(out)
        return sum(jnp.sum(t * jnp.sin(jnp.arange(t.shape[-1]) + 1.0) + t**2) for t in leaves), leaves

    (_, outs), grads = jax.value_and_grad(loss, has_aux=True)([v.value for v in variables])
    return outs, grads


def _compare(model, fast, inputs, out_tol=5e-4, grad_tol=1e-3):
    (o0, g0), (o1, g1) = _loss_and_grads(model, inputs), _loss_and_grads(fast, inputs)
    worst_out = max(_rel(b, a) for a, b in zip(o0, o1))
    worst_grad = max(_rel(b, a) for a, b in zip(g0, g1))
    print(f"worst relative (out, grad): {worst_out:.2e} {worst_grad:.2e}")
    assert worst_out <= out_tol and worst_grad <= grad_tol, (worst_out, worst_grad)


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-0.5, 0.5, v.shape).astype(v.dtype))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_lstm_stack_matches_keras_on_gpu(bidirectional, lstm_calls):
    inp = keras.Input((50, 16))
    x = inp
    for _ in range(3):
        layer = L.LSTM(32, return_sequences=True)
        x = (L.Bidirectional(layer) if bidirectional else layer)(x)
    model = keras.Model(inp, x)
    _randomize(model)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    inputs = np.random.default_rng(1).standard_normal((8, 50, 16)).astype("float32")
    _compare(model, fast, inputs)
    assert lstm_calls and {c["num_layers"] for c in lstm_calls} == {3}
    assert all(c["bidirectional"] is bidirectional and c["platform"] == "gpu" for c in lstm_calls)


def test_masked_calls_and_initial_and_final_states_fuse_on_gpu(lstm_calls):
    model = stack_model("lstm", 3, units=32, input_size=16, steps=40, masked=True,
                        last_return_sequences=True)
    _randomize(model, 2)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    tokens = random_inputs(model, 8, np.random.default_rng(3), padding="right")
    tokens[0, 5:] = 0
    _compare(model, fast, tokens, out_tol=5e-4, grad_tol=1e-3)
    assert lstm_calls and lstm_calls[0]["num_layers"] == 3
    lstm_calls.clear()
    model = stack_model("lstm", 2, units=32, input_size=16, steps=40, initial_state=True,
                        last_return_state=True)
    _randomize(model, 4)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    _compare(model, fast, random_inputs(model, 8, np.random.default_rng(5)))
    assert lstm_calls and lstm_calls[0]["num_layers"] == 2


def test_jitted_train_step_holds_one_multi_layer_cudnn_call(lstm_calls):
    model = stack_model("lstm", 3, units=64, input_size=32, steps=30, head=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 16, np.random.default_rng(6))
    variables = fast.trainable_variables

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return jnp.mean(fast(inputs) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower([v.value for v in variables], x).as_text()
    cudnn = [line for line in hlo.splitlines() if "rnnfuse_cudnn_ffi" in line and "custom_call" in line]
    print("cuDNN core custom calls in the train step:", len(cudnn))
    assert cudnn, "no cuDNN core custom call in the jitted step"
    assert {c["num_layers"] for c in lstm_calls} == {3}


def test_fit_on_gpu_matches_the_original(lstm_calls):
    model = stack_model("lstm", 3, units=32, input_size=16, steps=30, head=True)
    rng = np.random.default_rng(7)
    x = random_inputs(model, 16, rng)
    y = rng.standard_normal((16, 3)).astype("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    _, original, fused = fit_from_same_start(model, fast, x, y, batch_size=8)
    assert lstm_calls
    assert fast.jit_compile is True, "Keras' JAX trainer fell back to eager steps"
    worst = max(_rel(b, a) for a, b in zip(original, fused))
    print(f"fit: worst relative weight difference {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("batch, units", [(8, 256), (64, 512)])
def test_tuner_keeps_the_faster_of_keras_and_fused(batch, units, lstm_calls):
    from rnnfuse.api import choose_plans

    model = stack_model("lstm", 4, units=units, input_size=units, steps=200, last_return_sequences=True)
    (result,) = choose_plans(model, rnnfuse.analyze(model).groups,
                             tune=rnnfuse.TuneShape(batch, 200), cache=False)
    print(f"B{batch} H{units} tuner ms:", {n: round(t * 1e3, 2) for n, t in result.timings.items()},
          "->", result.plan.name)
    assert result.source == "measured"
    assert {"per-layer", "fused"} <= set(result.timings)
    # A split runs in the second stage only where its whole run came close.
    assert "split 2+2" in result.timings or "not timed" in result.rejected["split 2+2"]
    assert_fastest_or_kept_original(result)
    assert lstm_calls, "the fused candidates never ran the multi-layer call"


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_gradient_check_is_one_compile_with_jax_grads_numbers(kind, monkeypatch):
    """The float64 reference (the cuDNN core in float64, not layer copies),
    then plan and twin: one XLA compile each (jax.grad alone compiled over a
    hundred programs op by op), and the plan's gradients are those of
    jax.grad alone."""
    from rnnfuse.backends import get_timing
    from rnnfuse.plan import Plan
    from rnnfuse.tuning import tuner

    monkeypatch.setattr(tuner, "_on_layers", None)  # calling it fails the check

    model = stack_model(kind, 2, units=64, input_size=32, steps=40, last_return_sequences=True)
    (group,) = rnnfuse.analyze(model).groups
    compiles, programs = [], []

    def heard(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    timing = get_timing()
    real = timing.gradients_of

    def counted(calls, variables):
        before = len(compiles)
        out = real(calls, variables)
        programs.append((len(calls), len(compiles) - before))
        return out

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        timing.gradients_of = counted
        error = tuner.GradientCheck()(group, Plan((2,), "persistent_static+tc"), (16, 40, 32),
                                      "float32")
    finally:
        del timing.gradients_of
        jax.monitoring.unregister_event_duration_listener(heard)
    print(f"{kind}: gradient check programs (calls, compiles) {programs}, error {error:.2e}")
    # A wrong float64 core would put the float32 plan far from it.
    assert programs == [(1, 1), (2, 1)] and 0 < error < 1e-4
    variables = tuner._group_variables(group)
    x = tuner._input_batch((16, 40, 32), "float32", seed=1)
    run = tuner._runner(group, Plan((2,)))

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = run(inputs, False)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    alone = jax.grad(loss)([v.value for v in variables], x)
    for got, want in zip(timing.gradients(run, x, variables), alone):
        assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("kind", ["lstm", "gru", "bi_gru"])
def test_the_float64_reference_on_the_core_is_the_layers_own_float64(kind):
    """The gradient check's reference, one core call in float64, against
    the float64 copies' own calls (Keras' loop): equal to float64 rounding,
    where a float32 computation would differ by about 1e-7."""
    from rnnfuse.backends import get_timing
    from rnnfuse.tuning import tuner

    if kind == "bi_gru":
        inputs = keras.Input((40, 32))
        h = inputs
        for _ in range(2):
            h = keras.layers.Bidirectional(keras.layers.GRU(64, return_sequences=True))(h)
        (group,) = rnnfuse.analyze(keras.Model(inputs, h)).groups
    else:
        model = stack_model(kind, 2, units=64, input_size=32, steps=40, last_return_sequences=True)
        (group,) = rnnfuse.analyze(model).groups
    timing = get_timing()
    with timing.float64_reference_scope():
        x64 = keras.ops.cast(tuner._input_batch((16, 40, 32), "float32", seed=1), "float64")
        copies, variables = tuner._float64_copies(group, x64)
        (fused,) = timing.gradients_of([(tuner._fused_on(copies, group), x64, False)], variables)
        (layers,) = timing.gradients_of([(tuner._on_layers(copies), x64, False)], variables)
    worst = max(_rel(a, b) for a, b in zip(fused, layers))
    print(f"{kind}: float64 reference, core against Keras' loop: {worst:.2e}")
    assert worst < 1e-9


@pytest.mark.call_budget  # one-step calls under the library's own budget
def test_a_short_half_precision_fit_where_keras_fails_runs_the_persistent_algorithm(monkeypatch):
    """A mixed_float16 BiLSTM (Keras' own step fails on JAX's GPU) at batch 24
    under `optimize`'s defaults: a one-step predict and fit, too short to
    time, run the static plan, cuDNN's persistent algorithm in every core
    call, close to the float32 twin's outputs and SGD step."""
    from rnnfuse.tuning import first_batch

    algorithms = []
    real = cudnn_core.ffi_call

    def spy(target, results, *operands, **kwargs):
        algorithms.append(int(kwargs["algorithm"]) // 4)
        return real(target, results, *operands, **kwargs)

    monkeypatch.setattr(cudnn_core, "ffi_call", spy)

    def model(policy):
        keras.mixed_precision.set_global_policy(policy)
        try:
            inputs = keras.Input((100, 80))
            h = inputs
            for _ in range(2):
                h = L.Bidirectional(L.LSTM(256, return_sequences=True))(h)
            return keras.Model(inputs, L.Dense(3, dtype="float32")(L.GlobalAveragePooling1D()(h)))
        finally:
            keras.mixed_precision.set_global_policy("float32")

    twin, half = model("float32"), model("mixed_float16")
    half.set_weights(twin.get_weights())
    start = twin.get_weights()
    rng = np.random.default_rng(8)
    x = rng.standard_normal((24, 100, 80)).astype("float32")
    y = rng.standard_normal((24, 3)).astype("float32")
    fast = rnnfuse.optimize(half, cache=False)
    assert _rel(fast.predict(x, batch_size=24, verbose=0), twin.predict(x, batch_size=24, verbose=0)) <= 2e-2
    for m in (fast, twin):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", auto_scale_loss=False)
        m.fit(x, y, batch_size=24, epochs=1, verbose=0)
    (layer,) = fused_layers(fast)
    assert layer.plan.name == "fused @persistent_static+tc", layer.plan
    assert algorithms and set(algorithms) == {1}, algorithms  # persistent_static, never standard
    records = first_batch.decisions(fast)
    assert records and all(r["chosen"] == layer.plan.name and not r["timings_ms"] for r in records)
    deltas = [np.concatenate([(a - b).ravel() for a, b in zip(m.get_weights(), start)])
              for m in (half, twin)]
    assert _rel(*deltas) <= 5e-2
