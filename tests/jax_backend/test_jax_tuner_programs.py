"""The tuner's programs under JAX, on the CPU with the emulated cuDNN core:
the gradient check as one jitted program, the candidates' steps traced
and compiled ahead of their first call, and a candidate whose algorithm
the trace replaces left out before it is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import rnnfuse
from builders import stack_model
from rnnfuse.backends import get_timing
from rnnfuse.backends import jax as jax_kernels
from rnnfuse.plan import Plan
from rnnfuse.tuning import tuner

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ENV = {"device": "FakeGPU", "jax": "0", "backend": "jax", "rnnfuse": "0.1.0"}


@pytest.fixture
def compiles():
    """A list that gets one entry per XLA compile while the test runs."""
    seen = []

    def heard(event, seconds, **_):
        if event == COMPILE_EVENT:
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(heard)
    yield seen
    jax.monitoring.unregister_event_duration_listener(heard)


def _group(kind: str, layers: int = 2):
    model = stack_model(kind, layers, units=3, steps=2)  # each step is traced: few
    (group,) = rnnfuse.analyze(model).groups
    return group


def _unjitted_gradients(run, x, variables, training):
    """The gradients as `jax.grad` alone gives them, op by op."""

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = run(inputs, training)
        return sum(jnp.sum(jnp.square(t.astype(jnp.float32))) for t in jax.tree.leaves(y))

    return [np.asarray(g, np.float64) for g in jax.grad(loss)([v.value for v in variables], x)]


def test_gradients_of_all_calls_is_one_compiled_program(compiles):
    """Three calls (one in "float64", silently float32 with x64 off, as
    before): one XLA compile, each call's own gradients."""
    v = keras.Variable(np.array([1.0, 2.0], "float32"))
    w = keras.Variable(np.array([3.0], "float32"))
    x = np.array([0.5, -1.0], "float32")
    calls = [
        (lambda x, training: x * v, keras.ops.cast(x, "float64"), False),
        (lambda x, training: x * v + w, x, False),
        (lambda x, training: (x * v * w if training else x), x, True),
    ]
    keras.ops.convert_to_numpy(calls[0][1])  # the cast's own compile, before counting
    before = len(compiles)
    got = get_timing().gradients_of(calls, [v, w])
    assert len(compiles) - before == 1
    # d sum((x v)^2)/dv = 2 x^2 v; d sum((x v + w)^2)/dw = 2 sum(x v + w); ...
    np.testing.assert_allclose(got[0][0], 2 * x**2 * np.array([1.0, 2.0]))
    assert got[0][1].tolist() == [0.0]
    np.testing.assert_allclose(got[1][1], [2 * np.sum(x * np.array([1.0, 2.0]) + 3.0)])
    np.testing.assert_allclose(got[2][1], [2 * np.sum((x * np.array([1.0, 2.0])) ** 2 * 3.0)])
    assert all(g.dtype == np.float64 for each in got for g in each)


def test_the_gradient_check_is_one_compiled_program(emulated_core, compiles, monkeypatch):
    group = _group("lstm")
    programs = []
    real = type(get_timing()).gradients_of

    def counted(self, calls, variables):
        before = len(compiles)
        out = real(self, calls, variables)
        programs.append((len(calls), len(compiles) - before))
        return out

    monkeypatch.setattr(type(get_timing()), "gradients_of", counted)
    monkeypatch.setattr(tuner, "_on_layers", None)  # the core runs float64
    error = tuner.GradientCheck()(group, Plan((2,), "persistent_static+tc"),
                                  (2, 2, group.input_size), "float32")
    # The float64 reference (its own program: x64 is scoped), then plan and
    # twin together: one XLA compile each.
    assert programs == [(1, 1), (2, 1)], programs
    assert 0.0 < error < 1e-4
    x_types = [t["dtype"] for t in emulated_core.stacks]
    assert x_types == ["float64", "float32", "float32"], x_types


@pytest.mark.parametrize("kind, policy", [("lstm", "float32"), ("rnn_tanh", "float32"),
                                          ("bi_gru", "mixed_float16")])
def test_the_gradient_checks_reference_runs_float64_copies_of_the_layers(kind, policy):
    """With x64 off, float64 would be float32 (and Keras' JAX `tanh` makes a
    float64 tensor float32), and here no core runs a fused float64 call: the
    reference runs float64 copies of the layers, every op in float64,
    leaving the layers' own weights as they were."""
    if kind == "bi_gru":
        inputs = keras.Input((2, 4))
        h = inputs
        for _ in range(2):
            h = keras.layers.Bidirectional(keras.layers.GRU(3, return_sequences=True,
                                                            dtype=policy))(h)
        (group,) = rnnfuse.analyze(keras.Model(inputs, h)).groups
    else:
        group = _group(kind)
    before = [w.copy() for v in group.views for w in v.layer.get_weights()]
    x = tuner._input_batch((2, 2, group.input_size), "float32", seed=1)
    with get_timing().float64_reference_scope():
        copies, variables = tuner._float64_copies(group, keras.ops.cast(x, "float64"))
        y = tuner._on_layers(copies)(keras.ops.cast(x, "float64"), False)
    assert str(y.dtype) == "float64" and {str(w.dtype) for w in variables} == {"float64"}
    assert [tuple(w.shape) for w in variables] == [tuple(w.shape) for w in tuner._group_variables(group)]
    error = tuner.GradientCheck()(group, Plan((2,)), (2, 2, group.input_size), group.dtype)
    # The layers' own float32 (or float16) call against float64: close, not equal.
    assert 0.0 < error < (1e-2 if policy == "mixed_float16" else 1e-5)
    after = [w for v in group.views for w in v.layer.get_weights()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_jitted_gradients_are_those_of_jax_grad_alone(kind, emulated_core):
    group = _group(kind)
    variables = tuner._group_variables(group)
    x = tuner._input_batch((2, 2, group.input_size), "float32", seed=1)
    # The reference and a plan, as the gradient check passes them.
    calls = [
        (tuner._runner(group, Plan((2,)), dtype="float64"), keras.ops.cast(x, "float64"), False),
        (tuner._runner(group, Plan((2,), "persistent_static+tc")), x, False),
    ]
    jitted = get_timing().gradients_of(calls, variables)
    assert len(jitted) == 2
    for (run, inputs, training), got in zip(calls, jitted):
        want = _unjitted_gradients(run, inputs, variables, training)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    one = get_timing().gradients(calls[1][0], x, variables)
    assert all(np.array_equal(a, b) for a, b in zip(one, jitted[1]))


def test_a_step_traced_and_compiled_ahead_runs_what_jit_runs(emulated_core, compiles):
    group = _group("gru")
    variables = tuner._group_variables(group)
    x = tuner._input_batch((2, 2, group.input_size), "float32")
    run = tuner._runner(group, Plan((2,)))
    step = jax_kernels.timed_step(run, x, variables, training=True)
    step.trace()
    assert not compiles, "a trace compiles nothing"
    step.compile()
    first, again = float(step()), float(step())
    assert len(compiles) == 1, "one compile, before the first call"

    def loss(values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = run(inputs, True)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    want = float(jax.jit(jax.value_and_grad(loss))([v.value for v in variables], x)[0])
    assert first == again == pytest.approx(want, rel=1e-6)


def test_a_candidate_whose_algorithm_the_trace_replaces_is_left_out_uncompiled(
        emulated_core, monkeypatch):
    from rnnfuse.backends.cuda.cudnn_core import E_NOT_SUPPORTED, CoreError

    emulated_core.refuse = lambda c: (CoreError("persistent: no kernel for this shape",
                                                E_NOT_SUPPORTED) if c.algorithm >= 4 else None)
    compiled = []
    real_compile = jax_kernels.AheadOfTimeStep.compile

    def compile_(self):
        compiled.append(self)
        return real_compile(self)

    monkeypatch.setattr(jax_kernels.AheadOfTimeStep, "compile", compile_)
    timed = []

    def measure(steps):
        timed.append(sorted(steps))
        return {name: {"median": 1.0 if name == "fused" else 2.0} for name in steps}

    group = _group("lstm")
    plans = [rnnfuse.PER_LAYER, Plan((2,)), Plan((2,), "persistent_static+tc")]
    (result,) = tuner.tune_plans([group], lambda g: (2, 3, group.input_size), training=False,
                                 measure=measure, environment=dict(ENV), progress=False,
                                 candidates_of=lambda g: plans)
    refused = "fused @persistent_static+tc"
    assert "standard ran for persistent_static+tc" in result.rejected[refused]
    assert "cuDNN refused" in result.rejected[refused]
    assert timed == [["fused", "per-layer"]] and len(compiled) == 2
    assert result.plan == Plan((2,))


def test_a_failing_float64_reference_leaves_the_plans_it_checks_unchosen(monkeypatch):
    """No traceback out of tuning: the plan it would check is rejected with
    the reason, and the fastest plan needing no check is chosen."""
    from rnnfuse.plan import PER_LAYER

    calls = []

    def fails(group, x):
        calls.append(group)
        raise ValueError("Cannot lower jaxpr with verifier errors:\n  details")

    monkeypatch.setattr(tuner, "_float64_copies", fails)
    group = _group("lstm")
    check = tuner.GradientCheck()
    default, fast = Plan((2,)), Plan((2,), "persistent_static+tc")
    rejected = {}
    chosen = tuner._fastest_with_sound_gradients(
        [PER_LAYER, default, fast], {PER_LAYER.name: 3.0, default.name: 2.0, fast.name: 1.0},
        rejected, True, lambda p: check(group, p, (2, 2, group.input_size), "float32"), "float32")
    assert chosen == default
    assert rejected == {fast.name: "not checked: the float64 reference failed (ValueError: "
                                   "Cannot lower jaxpr with verifier errors:)"}
    # The failure is kept: another plan's check does not build the copies again.
    with pytest.raises(tuner.ReferenceFailed):
        check(group, Plan((2,), "persistent_dynamic+tc"), (2, 2, group.input_size), "float32")
    assert len(calls) == 1


def test_the_copies_gradients_pair_with_the_layers_trainable_variables():
    """A sublayer frozen after construction: its copy is trainable (its
    config says so), but the reference's gradients stay in the layers'
    trainable variables' order."""
    inputs = keras.Input((4, 6))
    first = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))
    model = keras.Model(inputs, keras.layers.Bidirectional(keras.layers.LSTM(3))(first(inputs)))
    first.forward_layer.cell.trainable = False
    (group,) = rnnfuse.analyze(model).groups
    x = tuner._input_batch((2, 4, 6), "float32", seed=1)
    with get_timing().float64_reference_scope():
        _, variables = tuner._float64_copies(group, keras.ops.cast(x, "float64"))
    assert [tuple(v.shape) for v in variables] == [tuple(v.shape) for v in tuner._group_variables(group)]
    assert len(variables) == len(tuner._group_variables(group)) == 9
    assert 0.0 < tuner.GradientCheck()(group, Plan((2,)), (2, 4, 6), "float32") < 1e-5


def test_a_reference_that_fails_fused_and_on_the_layers_names_both_failures(monkeypatch):
    def narrowed(copies):
        def run(x, training, mask=None, algorithm=None):
            raise TypeError("the float64 copies computed ['float32']")
        return run

    monkeypatch.setattr(tuner, "_on_layers", narrowed)
    group = _group("lstm")  # no core on the CPU: the fused call falls back, and says so
    with pytest.raises(tuner.ReferenceFailed) as failed:
        tuner.GradientCheck()(group, Plan((2,), "persistent_static+tc"), (2, 2, group.input_size),
                              "float32")
    assert "TypeError: the float64 copies computed ['float32']" in str(failed.value)
    assert "fused in float64: NotImplementedError: no fused float64 call here" in str(failed.value)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_the_fused_float64_reference_is_the_copies_own_float64(kind, emulated_core):
    """The binding packs float64 weights and states as it packs float32:
    the fused reference equals the copies' own calls to float64 rounding."""
    group = _group(kind)
    timing = get_timing()
    with timing.float64_reference_scope():
        x64 = keras.ops.cast(tuner._input_batch((2, 2, group.input_size), "float32", seed=1),
                             "float64")
        copies, variables = tuner._float64_copies(group, x64)
        (fused,) = timing.gradients_of([(tuner._fused_on(copies, group), x64, False)], variables)
        (layers,) = timing.gradients_of([(tuner._on_layers(copies), x64, False)], variables)
    assert [s["dtype"] for s in emulated_core.stacks] == ["float64"]
    # The standard algorithm: cuDNN's small-h one, PyTorch's choice at these
    # widths, has no float64.
    assert {attrs["algorithm"] for _, attrs in emulated_core.calls} == {0}
    for a, b in zip(fused, layers):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
