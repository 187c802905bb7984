"""Bidirectional stacks on rnnfuse's wavefront kernel under JAX
(rnnfuse/backends/jax/wavefront_bidirectional.py), on the CPU: the FFI
calls emulated as in test_jax_wavefront.py (wavefront_emulation.py), the
device's plan a fake limit. Everything else is the real code: one-layer
`wavefront.forward` calls a direction, direction 1 reversed within each
row's length, the packing (merges below the top included), the states'
order, the switch and the fallbacks; compared with cuDNN's bidirectional
equations in float32 (tests/cudnn_reference.py) and with Keras' own
Bidirectional layers. The real kernel: tests/gpu/test_gpu_wavefront_bidirectional_jax.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import rnnfuse
from builders import (bidirectional_stack, fused_layers, max_abs_diff, wavefront_inputs,
                      wavefront_mask)
from cudnn_reference import cudnn_rnn
from rnnfuse.backends import get_backend
from rnnfuse.backends.jax import wavefront
from rnnfuse.backends.jax import wavefront_bidirectional as bidir
from rnnfuse.plan import Plan
from wavefront_emulation import install, targets

LIMIT = 48  # the fake on-chip plan: layers x units above this do not fit
FP16_TOL = 5e-3


@pytest.fixture
def emulated(monkeypatch):
    """The emulation, the switch as it ships (on)."""
    return install(monkeypatch, LIMIT)


@pytest.fixture
def enabled(monkeypatch):
    """The emulation with the switch on, whatever it ships as."""
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    return install(monkeypatch, LIMIT)


def _targets(emulation):
    return targets(emulation.calls)


# -- the composition against cuDNN's bidirectional equations ---------------------------------


@pytest.mark.parametrize("lengths", [None, [5, 4, 2, 1]])
def test_reversal_within_lengths_is_its_own_inverse_and_keeps_the_padding(lengths):
    x = jnp.arange(5 * 4 * 2, dtype=jnp.float32).reshape(5, 4, 2)
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    once = bidir.reverse_within_lengths(x, lens)
    np.testing.assert_array_equal(bidir.reverse_within_lengths(once, lens), x)
    for b, n in enumerate(lengths or [5] * 4):
        np.testing.assert_array_equal(once[:n, b], x[:n, b][::-1])
        np.testing.assert_array_equal(once[n:, b], x[n:, b])


def _pieces(kind, layers, units, inputs, rng):
    """Per pseudo layer [w_ih, w_hh, b_ih, b_hh] (flat, float32)."""
    gh = (4 if kind == "lstm" else 3) * units
    out = []
    for k in range(2 * layers):
        n = inputs if k < 2 else 2 * units
        out.append([jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
                    for s, scale in [(gh * n, 0.4), (gh * units, 0.4), (gh, 0.2), (gh, 0.2)]])
    return out


def _composed(kind, lengths):
    def run(x, pieces, h0, c0):
        return bidir.forward(x, [jnp.concatenate(p) for p in pieces], h0, c0, lengths, kind=kind)
    return run


def _cudnn(kind, lengths, steps):
    lens = jnp.full((4,), steps, jnp.int32) if lengths is None else lengths

    def run(x, pieces, h0, c0):
        flat = jnp.concatenate([a for p in pieces for a in p[:2]]
                               + [a for p in pieces for a in p[2:]])
        return cudnn_rnn(jnp, x, h0, c0, flat, lens, kind, True)
    return run


def _compare(kind, layers, ragged):
    """(composed, reference): outputs, states and gradients of every input."""
    rng = np.random.default_rng(0)
    units, inputs, batch, steps = 4, 3, 4, 6
    lengths = jnp.asarray([6, 5, 2, 1], jnp.int32) if ragged else None
    pieces = _pieces(kind, layers, units, inputs, rng)
    x = jnp.asarray(rng.standard_normal((steps, batch, inputs)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((2 * layers, batch, units)) * 0.3, jnp.float32)
    c0 = jnp.asarray(rng.standard_normal((2 * layers, batch, units)) * 0.3, jnp.float32)
    c0 = c0 if kind == "lstm" else None
    shapes = [(steps, batch, 2 * units), (2 * layers, batch, units), (2 * layers, batch, units)]
    weights = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]

    def loss(fn, *args):
        y, hy, cy = fn(*args)
        if ragged:  # past each length: zeros on the kernel, not in the reference's
            y = y * (jnp.arange(steps)[:, None] < lengths[None, :])[..., None]
        return sum(jnp.sum(t * w) for t, w in zip((y, hy, cy), weights) if t is not None), \
            (y, hy, cy)

    out = []
    for fn in (_composed(kind, lengths), _cudnn(kind, lengths, steps)):
        argnums = (0, 1, 2, 3) if kind == "lstm" else (0, 1, 2)
        grads, got = jax.grad(lambda *a, fn=fn: loss(fn, *a), argnums=argnums, has_aux=True)(
            x, pieces, h0, c0)
        out.append((got, grads))
    return out


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("layers,ragged", [(1, False), (1, True), (3, True)])
def test_the_composition_is_cudnns_bidirectional_stack(emulated, kind, layers, ragged):
    """Float32 through the emulation: outputs, final states (layer-major,
    forward first) and jax.grad of x, every weight and the initial states."""
    (got, grads), (want, ref) = _compare(kind, layers, ragged)
    for name, g, w in zip(["y", "hy", "cy"], got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    calls = _targets(emulated)
    assert calls.count("forward_saving") == 2 * layers and "forward" not in calls
    assert all(attrs.get("input_size", 0) in (0, 3, 8) for _, attrs in emulated.calls)


def test_the_comparison_fails_where_direction_1_is_not_reversed(emulated, monkeypatch):
    """The test above can fail: direction 1 run forward in time breaks it."""
    monkeypatch.setattr(bidir, "reverse_within_lengths", lambda t, lengths: t)
    (got, _), (want, _) = _compare("lstm", 1, True)
    assert float(jnp.max(jnp.abs(got[0] - want[0]))) > 1e-2


def test_an_odd_number_of_buffers_is_a_clear_error():
    z = jnp.zeros((3, 2, 4), jnp.float16)
    with pytest.raises(ValueError, match="received 3"):
        bidir.forward(z, [z.reshape(-1)] * 3, z, z, None, kind="lstm")


# -- the backend: Keras' Bidirectional layers, the switch, the tuner --------------------------


def _fused(model, layers):
    plan = Plan((layers,), kernel="wavefront")
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False, plan=lambda g: plan))
    return layer


def _outputs_and_grads(layer, x, weights, **kwargs):
    variables = layer.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            y = layer(x, training=True, **kwargs)
        return jnp.sum(y.astype(jnp.float32) * weights), y

    grads, y = jax.jit(jax.grad(loss, has_aux=True))([v.value for v in variables])
    return y, [np.asarray(g, np.float64) for g in grads]


@pytest.mark.parametrize("kind,merge_mode,layers,masked,initial", [
    ("lstm", "concat", 1, False, False), ("gru", "concat", 3, True, False),
    ("lstm", "sum", 3, True, True), ("gru", "ave", 2, False, True),
    ("lstm", "ave", 2, True, False), ("gru", "sum", 1, True, True)])
def test_a_layer_on_the_plan_matches_keras_bidirectional_layers(
        enabled, half, kind, merge_mode, layers, masked, initial):
    model = bidirectional_stack(kind, merge_mode, layers, initial_state=initial)
    layer = _fused(model, layers)
    x = jnp.asarray(wavefront_inputs())
    kwargs = {}
    if masked:
        kwargs["mask"] = jnp.asarray(wavefront_mask())
    if initial:
        rng = np.random.default_rng(5)
        kwargs["initial_state"] = [jnp.asarray(rng.standard_normal((4, 8)) * 0.5, jnp.float16)
                                   for _ in range(4 if kind == "lstm" else 2)]
    width = 16 if merge_mode == "concat" else 8
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((4, 7, width)), jnp.float32)
    y, grads = _outputs_and_grads(layer, x, weights, **kwargs)
    ran = layer.last_path.kernel
    assert layer.last_path.kind == "fused" and ran.name == wavefront.KERNEL_NAME, layer.last_path
    assert ran.note is None and ran.algorithm.startswith(bidir.ALGORITHM)
    assert _targets(enabled).count("forward_saving") == 2 * layers
    layer.set_plan(Plan(()))  # Keras' own layers
    want_y, want = _outputs_and_grads(layer, x, weights, **kwargs)
    assert max_abs_diff(y, want_y) <= FP16_TOL
    for g, w in zip(grads, want):
        assert np.max(np.abs(g - w)) <= 2 * FP16_TOL * max(1.0, np.max(np.abs(w)))
    assert all(np.max(np.abs(g)) > 0 for g in grads)


def test_an_inference_call_runs_the_inference_target_a_direction(enabled, half):
    layer = _fused(bidirectional_stack("gru"), 2)
    x = wavefront_inputs()
    y = layer(x, training=False)
    assert _targets(enabled) == ["forward"] * 4
    assert [a["input_size"] for _, a in enabled.calls] == [5, 5, 16, 16]
    assert layer.last_path.kernel.algorithm == bidir.ALGORITHM
    layer.set_plan(Plan(()))
    assert max_abs_diff(y, layer(x, training=False)) <= FP16_TOL


def test_while_the_switch_is_off_the_layers_run_with_the_reason(emulated, half, monkeypatch):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", False)
    model = bidirectional_stack()
    layer = _fused(model, 2)
    x = wavefront_inputs()
    y = layer(x, training=False)
    assert emulated.calls == [] and layer.last_path.kind == "layers"
    assert "wavefront_bidirectional.BIDIRECTIONAL" in str(layer.last_path.reason)
    assert max_abs_diff(y, model(x)) <= FP16_TOL


def test_the_tuner_is_offered_the_plan_only_with_the_switch_on(emulated, half, monkeypatch):
    backend = get_backend()
    (group,) = rnnfuse.analyze(bidirectional_stack()).groups
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", False)
    assert bidir.BIDIRECTIONAL_OFF == backend.kernel_reason("wavefront", group, (4, 7, 5))
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    assert backend.kernel_reason("wavefront", group, (4, 7, 5), training=True) is None
    assert sorted(emulated.asked) == [("lstm", 1, 8, 4, 7, 5), ("lstm", 1, 8, 4, 7, 16)]
    (wide,) = rnnfuse.analyze(bidirectional_stack(units=64)).groups
    assert backend.kernel_reason("wavefront", wide, (4, 7, 5)) == \
        "1 layers of 64 units do not fit on chip"
    keras.config.set_dtype_policy("float32")
    (group32,) = rnnfuse.analyze(bidirectional_stack()).groups
    assert "not float32" in backend.kernel_reason("wavefront", group32, (4, 7, 5))


def test_tune_times_the_plan_with_the_switch_on(enabled, half):
    """`optimize(model, tune=...)`'s timing: the plan's candidate is a real
    jitted training step on the composition, kept after its gradient check."""
    from rnnfuse.api import choose_plans

    model = bidirectional_stack()
    (result,) = choose_plans(model, rnnfuse.analyze(model).groups,
                             tune=rnnfuse.TuneShape(4, 7), cache=False)
    assert result.source == "measured"
    assert "fused on wavefront" in result.timings, result
    assert {"forward_saving", "backward_stack"} <= set(_targets(enabled))
