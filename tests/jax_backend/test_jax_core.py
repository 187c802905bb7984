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
    assert _ran(fast).algorithm == "persistent_static_small_h"  # a narrow state, as PyTorch runs it
    targets = _targets(emulated)
    assert targets[0] == "forward"
    # jax.grad: the training forward, then backward data, then weights.
    assert targets[1:4] == ["forward_training", "backward_data", "backward_weights"]
    attrs = emulated.calls[0][1]
    assert attrs["mode"] == cudnn_core.MODES.index(kind)
    assert (attrs["num_layers"], attrs["num_units"], attrs["directions"]) == (
        3, 4, 2 if bidirectional else 1)
    assert attrs["full_lengths"] == 1 and attrs["dropout"] == 0.0


# -- the binding itself: cudnn_core.rnn against cuDNN's equations -------------------------


def _canonical(kind, layers, units, inputs, dirs, proj, rng):
    n = core_emulation._param_count(kind, layers, units, proj, inputs, dirs)
    return jnp.asarray(rng.standard_normal(n) * 0.3, jnp.float32)


@pytest.mark.parametrize("kind,dirs,proj", [("lstm", 1, 0), ("lstm", 2, 3), ("gru", 2, 0),
                                            ("rnn_relu", 1, 0)])
@pytest.mark.parametrize("ragged", [False, True])
def test_the_custom_vjp_is_cudnns_gradient(kind, dirs, proj, ragged, emulated):
    """jax.grad of `cudnn_core.rnn` (training forward, backward data, then
    backward weights on the reserve backward data returned) against JAX's
    gradient of cuDNN's equations, for every input."""
    from cudnn_reference import cudnn_rnn

    rng = np.random.default_rng(0)
    layers, units, inputs, batch, steps = 2, 4, 3, 3, 5
    out = proj or units
    params = _canonical(kind, layers, units, inputs, dirs, proj, rng)
    x = jnp.asarray(rng.standard_normal((steps, batch, inputs)), jnp.float32)
    hx = jnp.asarray(rng.standard_normal((layers * dirs, batch, out)) * 0.3, jnp.float32)
    cx = jnp.asarray(rng.standard_normal((layers * dirs, batch, units)) * 0.3, jnp.float32)
    lengths = jnp.asarray([5, 2, 1] if ragged else [5] * batch, jnp.int32)
    config = cudnn_core.CoreConfig(kind, layers, units, inputs, directions=dirs, proj_size=proj,
                                   full_lengths=not ragged)
    probes = [jnp.asarray(rng.standard_normal(s), jnp.float32)
              for s in [(steps, batch, dirs * out), hx.shape, cx.shape]]

    def loss(run, *args):
        y, hy, cy = run(*args)
        total = jnp.sum(y * probes[0]) + jnp.sum(hy * probes[1])
        return total + (jnp.sum(cy * probes[2]) if cy is not None else 0.0)

    def core(x, hx, cx, params):
        return cudnn_core.rnn(x, hx, cx if kind == "lstm" else None, params, lengths,
                              config=config)

    def reference(x, hx, cx, params):
        return cudnn_rnn(jnp, x, hx, cx if kind == "lstm" else None, params, lengths, kind,
                         dirs == 2)

    got = jax.jit(core)(x, hx, cx, params)
    want = reference(x, hx, cx, params)
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: loss(core, *a), argnums=(0, 1, 2, 3)))(x, hx, cx, params)
    ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(x, hx, cx, params)
    for name, g, w in zip(["dx", "dhx", "dcx", "dparams"], grads, ref):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
    assert float(jnp.max(jnp.abs(grads[3]))) > 0
    assert _targets(emulated) == ["forward", "forward_training", "backward_data",
                                  "backward_weights"]
    assert all(a["full_lengths"] == (0 if ragged else 1) for _, a in emulated.calls)


def test_backward_weights_must_read_backward_datas_reserve(emulated, monkeypatch):
    """The gradient test above can fail: a binding that hands backward
    weights the forward's reserve (not the one backward data wrote) gets
    other weight gradients."""
    rng = np.random.default_rng(1)
    params = _canonical("gru", 1, 4, 3, 1, 0, rng)
    x = jnp.asarray(rng.standard_normal((5, 2, 3)), jnp.float32)
    hx = jnp.zeros((1, 2, 4), jnp.float32)
    config = cudnn_core.CoreConfig("gru", 1, 4, 3)
    lengths = jnp.full((2,), 5, jnp.int32)

    def grad():
        return jax.grad(lambda p: jnp.sum(cudnn_core.rnn(x, hx, None, p, lengths,
                                                         config=config)[0] ** 2))(params)

    right = grad()
    real = cudnn_core.ffi_call

    def stale(target, results, *operands, **kwargs):
        out = real(target, results, *operands, **kwargs)
        if target.endswith("backward_data"):
            # the forward's reserve, not backward data's (then the workspace)
            out = list(out[:3]) + [operands[8], out[4]]
        return out

    monkeypatch.setattr(cudnn_core, "ffi_call", stale)
    wrong = grad()
    assert float(jnp.max(jnp.abs(right - wrong))) > 1e-3


# -- plan records and fallbacks ------------------------------------------------------------


def _lstm3(masked=False, steps=6):
    return stack_model("lstm", 3, units=4, input_size=5, steps=steps, masked=masked,
                       last_return_sequences=True)


def test_a_plans_algorithm_runs_in_both_passes_and_is_recorded(emulated):
    from rnnfuse.plan import Plan

    model = _lstm3()
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_dynamic+tc"))
    x = np.random.default_rng(2).standard_normal((3, 6, 5)).astype("float32")
    _grads(fast, x)
    ran = _ran(fast)
    assert ran.algorithm == "persistent_dynamic+tc" and ran.note is None
    # 4 * algo (2: persistent dynamic) + math; float32 under JAX's default
    # precision may use TF32 tensor ops ("+tc" asks for them).
    codes = {a["algorithm"] for _, a in emulated.calls}
    assert codes == {4 * 2 + 1}, codes


def test_float32_runs_ieee_under_highest_precision(emulated):
    model = _lstm3()
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = np.random.default_rng(2).standard_normal((3, 6, 5)).astype("float32")
    with jax.default_matmul_precision("highest"):
        fast(x)
    (_, attrs), = emulated.calls
    assert attrs["allow_tf32"] == 0 and attrs["algorithm"] == 15  # small-h, FMA math
    emulated.calls.clear()
    with jax.default_matmul_precision("tensorfloat32"):
        fast(x)
    assert emulated.calls[0][1]["allow_tf32"] == 1


def test_a_masked_call_runs_the_standard_algorithm_and_says_why(emulated):
    from rnnfuse.plan import Plan

    model = _lstm3(masked=True)
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_static+tc"))
    tokens = random_inputs(model, 3, np.random.default_rng(3), padding="right")
    tokens[0, 2:] = 0
    # The forward pass only: the backward runs the same core config, and the
    # gradients of a masked core call (12 s of XLA compile) are
    # test_jax_fused.py::test_masked_calls_run_the_core_with_lengths's.
    assert max_abs_diff(fast(tokens), model(tokens)) < 1e-4
    ran = _ran(fast)
    assert ran.algorithm == "standard" and "padded lengths" in ran.note
    assert emulated.calls and all(a["algorithm"] < 4 and a["full_lengths"] == 0
                                  for _, a in emulated.calls)


def test_an_algorithm_cudnn_refuses_runs_as_standard_with_the_reason(emulated):
    from rnnfuse.backends.cuda.cudnn_core import E_NOT_SUPPORTED, CoreError
    from rnnfuse.plan import Plan

    emulated.refuse = lambda c: (CoreError("persistent: no kernel for this shape",
                                           E_NOT_SUPPORTED) if c.algorithm >= 4 else None)
    model = _lstm3()
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_static+tc"))
    x = np.random.default_rng(4).standard_normal((3, 6, 5)).astype("float32")
    # The backward must run standard too; that its gradient is the layers'
    # is test_the_custom_vjp_is_cudnns_gradient's (one compile less here).
    assert max_abs_diff(fast(x), model(x)) < 1e-4
    _grads(fast, x)
    ran = _ran(fast)
    assert ran.algorithm == "standard"
    assert "cuDNN refused persistent_static+tc" in ran.note and "no kernel" in ran.note
    assert all(a["algorithm"] < 4 for _, a in emulated.calls)


@pytest.mark.parametrize("why", ["refused", "disabled", "unregistered"])
def test_a_call_the_core_cannot_run_runs_the_layers_with_the_reason(why, emulated, monkeypatch):
    from rnnfuse import PathKind
    from rnnfuse.backends.cuda.cudnn_core import E_NOT_SUPPORTED, CoreError

    if why == "refused":
        emulated.refuse = lambda c: CoreError("bad configuration", E_NOT_SUPPORTED)
        expected = "the cuDNN core refused this call (bad configuration)"
    elif why == "disabled":
        monkeypatch.setenv("RNNFUSE_DISABLE_CORE", "1")
        expected = "RNNFUSE_DISABLE_CORE"
    else:
        monkeypatch.setattr(cudnn_core, "register",
                            lambda: "rnnfuse's XLA FFI library of the cuDNN core is not "
                                    "available: no xla/ffi/api/ffi.h")
        expected = "no xla/ffi/api/ffi.h"
    model = _lstm3()
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = np.random.default_rng(5).standard_normal((3, 6, 5)).astype("float32")
    np.testing.assert_allclose(np.asarray(fast(x)), np.asarray(model(x)), atol=1e-6)
    (layer,) = fused_layers(fast)
    assert layer.last_path.kind is PathKind.LAYERS
    assert expected in str(layer.last_path.reason)
    assert emulated.calls == []


def test_the_core_runs_float64_and_names_a_type_it_does_not_run():
    """float64 (the gradient check's reference, under x64) is a core type."""
    assert "float64" in cudnn_core.DTYPES
    assert "runs float32, float16, bfloat16, float64, not int32" in cudnn_core.core_reason("int32")


# -- inside Keras' jitted steps ----------------------------------------------------------


def test_fit_traces_the_step_once_with_no_host_callback(emulated, monkeypatch):
    """Keras' JAX trainer compiles one train step holding the core's calls:
    a fit of several steps traces them once, and the step's jaxpr has no
    host callback (everything runs on the device)."""
    model = stack_model("gru", 2, units=4, input_size=5, steps=6, head=True)
    _randomize(model, 6)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 6, 5)).astype("float32")
    y = rng.standard_normal((16,) + tuple(fast.output_shape[1:])).astype("float32")
    fast.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 8 steps
    assert _targets(emulated).count("forward_training") == 1, _targets(emulated)
    assert _targets(emulated).count("backward_weights") == 1
    # The traced step itself: no callback primitive anywhere in it.
    variables = fast.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return jnp.sum(fast(x, training=True) ** 2)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))([v.value for v in variables]))
    assert "callback" not in jaxpr
    assert _ran(fast).name == cudnn_core.KERNEL_NAME


def test_tuned_algorithms_are_the_cores_where_it_runs(emulated, monkeypatch):
    from rnnfuse.backends import get_backend
    from rnnfuse.tuning.plans import CANDIDATE_ALGORITHMS

    assert get_backend().capabilities.tuned_algorithms == CANDIDATE_ALGORITHMS
    monkeypatch.setenv("RNNFUSE_DISABLE_CORE", "1")
    assert get_backend().capabilities.tuned_algorithms == (None,)


def test_no_gpu_no_core_algorithms():
    from rnnfuse.backends import get_backend

    assert get_backend().capabilities.tuned_algorithms == (None,)


DATA_PARALLEL = r"""
import sys
sys.path[:0] = [{tests!r}, {jax_tests!r}]
import jax, keras, numpy as np
import core_emulation, rnnfuse
from builders import fused_layers, stack_model
from rnnfuse.backends import jax as jax_backend
from rnnfuse.backends.jax import cudnn_core

class Patch:
    def setattr(self, owner, name, value):
        setattr(owner, name, value)

emulation = core_emulation.install(Patch())
devices = keras.distribution.list_devices()
assert len(devices) == 2, devices
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
model = stack_model("lstm", 2, units=4, input_size=5, steps=6, head=True)
fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
fast.compile(optimizer="sgd", loss="mse")
rng = np.random.default_rng(0)
x = rng.standard_normal((8, 6, 5)).astype("float32")
y = rng.standard_normal((8,) + tuple(fast.output_shape[1:])).astype("float32")
history = fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
(layer,) = fused_layers(fast)
assert layer.last_path.kernel.name == cudnn_core.KERNEL_NAME, layer.last_path
assert [t for t, _ in emulation.calls].count("rnnfuse_cudnn_ffi_forward_training") == 1
np.testing.assert_allclose(np.asarray(fast.predict(x, batch_size=4, verbose=0)),
                           np.asarray(model.predict(x, batch_size=4, verbose=0)), atol=1e-5)
print("ok", len(devices), history.history["loss"])
"""


def test_data_parallel_over_two_devices_runs_the_core(tmp_path):
    """keras.distribution.DataParallel over the devices present (two host
    devices here, in a process of its own): the fused step compiles and
    trains, and predicts what the original model does."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    script = tmp_path / "dp.py"
    script.write_text(DATA_PARALLEL.format(tests=os.path.dirname(here), jax_tests=here))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ok 2")
