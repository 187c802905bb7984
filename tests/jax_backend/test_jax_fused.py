"""The JAX backend on the CPU, through the emulated cuDNN core.

Each fused model is compared with the original one (Keras' own JAX
layers), outputs and gradients; the `emulated_core` record shows whether
one multi-layer call ran.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import rnnfuse
from rnnfuse import PathKind
from rnnfuse.placement import placement
from rnnfuse.plan import PER_LAYER
from builders import fit_from_same_start, fused_layers, max_abs_diff, random_inputs, stack_model

L = keras.layers


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-0.5, 0.5, v.shape).astype(v.dtype))


def _grads(model, inputs):
    """Gradients of a fixed loss w.r.t. the model's variables (stateless)."""
    variables = model.trainable_variables

    def loss(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            out = model(inputs)
        return sum(
            jax.numpy.sum(t * jax.numpy.sin(jax.numpy.arange(t.shape[-1]) + 1.0) + t**2)
            for t in jax.tree.leaves(out)
        )

    return jax.grad(loss)([v.value for v in variables])


def _check(model, fast, inputs, tol=1e-5):
    assert max_abs_diff(fast(inputs), model(inputs)) < tol
    for a, b in zip(_grads(fast, inputs), _grads(model, inputs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=10 * tol, rtol=10 * tol)


@pytest.mark.parametrize("layers", [2, 3])
def test_lstm_stack_is_one_call_and_matches_keras(layers, emulated_core):
    model = stack_model("lstm", layers, units=6, input_size=5, steps=7)
    _randomize(model)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    x = random_inputs(model, 3, np.random.default_rng(1))
    _check(model, fast, x)
    assert emulated_core.stacks[0]["num_layers"] == layers
    assert emulated_core.stacks[0]["bidirectional"] is False


@pytest.mark.parametrize("last_return_sequences", [False, True])
def test_returned_states_with_initial_states(last_return_sequences, emulated_core):
    model = stack_model("lstm", 2, units=6, input_size=5, steps=7, initial_state=True,
                        last_return_state=True, last_return_sequences=last_return_sequences)
    _randomize(model, 3)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    _check(model, fast, random_inputs(model, 3, np.random.default_rng(4)))
    assert emulated_core.calls


def test_bidirectional_stack(emulated_core):
    inp = keras.Input((7, 5))
    x = L.Bidirectional(L.LSTM(6, return_sequences=True))(inp)
    x = L.Bidirectional(L.LSTM(6, return_sequences=True), merge_mode="sum")(x)
    model = keras.Model(inp, x)
    _randomize(model, 2)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    data = np.random.default_rng(3).standard_normal((3, 7, 5)).astype("float32")
    _check(model, fast, data)
    assert emulated_core.stacks[0] == dict(kind="lstm", num_layers=2, bidirectional=True,
                                           blob_size=emulated_core.stacks[0]["blob_size"],
                                           dtype="float32")


@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_bidirectional_sum_and_ave_below_the_top(merge_mode, emulated_core):
    """The levels above a sum/ave Bidirectional read [fwd, bwd] through
    their input kernel packed doubled (W_ih [4H, 2H])."""
    inp = keras.Input((7, 5))
    x = inp
    for mode in (merge_mode, merge_mode, "concat"):
        x = L.Bidirectional(L.LSTM(6, return_sequences=True), merge_mode=mode)(x)
    model = keras.Model(inp, x)
    _randomize(model, 5)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    data = np.random.default_rng(6).standard_normal((3, 7, 5)).astype("float32")
    _check(model, fast, data)
    h = 6
    per_level = [4 * h * (n + h) + 2 * 4 * h for n in (5, 2 * h, 2 * h)]
    assert emulated_core.stacks[0] == dict(kind="lstm", num_layers=3, bidirectional=True,
                                           blob_size=2 * sum(per_level), dtype="float32")


def test_initial_state(emulated_core):
    model = stack_model("lstm", 2, units=6, input_size=5, steps=7, initial_state=True,
                        last_return_sequences=True)
    _randomize(model, 4)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    inputs = random_inputs(model, 3, np.random.default_rng(5))
    _check(model, fast, inputs)
    assert len(emulated_core.calls) >= 1


def test_go_backwards_first_layer_is_left_to_keras_with_a_reason():
    """Keras' JAX cuDNN LSTM and its loop order a go_backwards output differently."""
    model = stack_model("lstm", 3, go_backwards_first=True)
    report = rnnfuse.analyze(model)
    assert report.groups == ()
    assert {r.rule for r in report.skipped.values()} == {"backend"}
    assert "reads backwards" in next(iter(report.skipped.values()))


def test_masked_calls_run_the_core_with_lengths(emulated_core):
    """A right-padded mask is the core's sequence lengths (read on the host:
    full_lengths is off); outputs and gradients match Keras' loop."""
    model = stack_model("lstm", 2, units=6, input_size=5, steps=9, masked=True,
                        last_return_sequences=True)
    _randomize(model, 6)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    tokens = random_inputs(model, 4, np.random.default_rng(7), padding="right")
    tokens[0, 3:] = 0
    _check(model, fast, tokens)
    assert emulated_core.calls and all(a["full_lengths"] == 0 for _, a in emulated_core.calls)
    assert fused_layers(fast)[0].last_path.kind is PathKind.FUSED


def test_a_mask_that_is_not_right_padded_runs_the_layers(emulated_core):
    model = stack_model("lstm", 2, units=6, input_size=5, steps=9, masked=True,
                        last_return_sequences=True)
    _randomize(model, 6)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    tokens = random_inputs(model, 4, np.random.default_rng(7), padding="right")
    tokens[0, :3] = 0  # left padding
    np.testing.assert_allclose(np.asarray(fast(tokens)), np.asarray(model(tokens)), atol=1e-6)
    assert fused_layers(fast)[0].last_path.kind is PathKind.LAYERS


def test_right_padded_lengths_match_keras_loop_in_run_stack(emulated_core):
    """run_stack's lengths path itself."""
    import jax.numpy as jnp

    from rnnfuse.backends import jax as jax_backend
    from rnnfuse.backends.base import StackCall, StackSpec

    model = stack_model("lstm", 2, units=6, input_size=5, steps=9, last_return_sequences=True)
    _randomize(model, 8)
    x = np.random.default_rng(9).standard_normal((3, 9, 5)).astype("float32")
    mask = np.arange(9)[None, :] < np.array([[9], [4], [1]])
    cells = tuple((layer.cell,) for layer in model.layers[1:3])
    call = StackCall(StackSpec("lstm", 6, cells), mask=jnp.asarray(mask))
    y, _, _, ran = jax_backend.run_stack(x, call)
    assert ran.name == "rnnfuse cuDNN core (XLA FFI)" and ran.algorithm == "standard"
    expected = model.layers[2](model.layers[1](x, mask=mask), mask=mask)
    keep = mask[:, :, None]
    np.testing.assert_allclose(np.where(keep, y, 0), np.where(keep, expected, 0), atol=1e-5)
    assert not np.any(np.asarray(y)[~mask])


def test_fit_under_jit_trains_the_original_variables(emulated_core):
    model = stack_model("lstm", 2, units=6, input_size=5, steps=7, head=True)
    _randomize(model, 10)
    rng = np.random.default_rng(11)
    x = random_inputs(model, 8, rng)
    y = rng.standard_normal((8, 3)).astype("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    start, original, fused = fit_from_same_start(model, fast, x, y, batch_size=4)
    assert emulated_core.calls, "fit did not run the fused call"
    # Keras' JAX trainer compiled the step with the fused layer in it.
    assert all(layer.supports_jit for layer in fused_layers(fast))
    assert fast.jit_compile is True
    for a, b in zip(original, fused):
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert any(not np.allclose(a, s) for a, s in zip(original, start))


def test_without_tune_a_large_float32_lstm_keeps_keras_layers_and_says_why(emulated_core):
    """jaxlib's cuDNN runs Keras' LSTM layers; JAX's static table keeps
    them where the stack is not small (`table.JAX_RULES`)."""
    model = stack_model("lstm", 3, units=512)
    fast = rnnfuse.optimize(model)
    assert fused_layers(fast) == []
    report = rnnfuse.analyze(model)
    assert len(report.groups) == 1  # it could fuse; the plan keeps the layers
    why = str(placement(PER_LAYER))
    assert "untimed group keeps Keras' layers" in why and "tune=batch" in why


@pytest.mark.parametrize("kind", ["gru", "rnn_tanh", "rnn_relu"])
def test_gru_and_simple_rnn_runs_are_groups(kind):
    """Every cell kind is a group (the core runs them); Keras runs them as a
    lax.scan, so JAX's static plan fuses them."""
    model = stack_model(kind, 3)
    assert len(rnnfuse.analyze(model).groups) == 1
    (layer,) = fused_layers(rnnfuse.optimize(model))
    assert layer.plan == rnnfuse.FUSED.for_length(3)


def test_dropout_between_layers_is_absorbed():
    inp = keras.Input((7, 5))
    x = L.LSTM(6, return_sequences=True)(inp)
    x = L.Dropout(0.2, name="between")(x)
    x = L.LSTM(6, return_sequences=True)(x)
    x = L.LSTM(6)(x)
    report = rnnfuse.analyze(keras.Model(inp, x))
    # cuDNN applies one rate between every pair of levels: the pair without
    # a Dropout starts another group.
    assert [len(g.layers) for g in report.groups] == [2, 1]
    assert report.groups[0].absorbed_dropout == ("between",)  # named: auto names depend on test order
    assert "cuDNN applies one dropout rate" in next(iter(report.breaks.values()))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_precision_stacks_run_the_core_in_the_compute_dtype(policy, emulated_core):
    model = stack_model("gru", 2, dtype=policy)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 3, np.random.default_rng(12))
    assert max_abs_diff(fast(x), model(x)) < (2e-3 if policy == "mixed_float16" else 2e-2)
    assert fused_layers(fast)[0].last_path.kind is PathKind.FUSED
    (stack,) = emulated_core.stacks
    assert stack["kind"] == "gru" and stack["num_layers"] == 2
    dtype = policy.removeprefix("mixed_")
    assert emulated_core.sizes and all(s[1] == dtype for s in emulated_core.sizes)


def test_tuner_times_per_layer_and_fused_under_jax(emulated_core):
    from rnnfuse.api import choose_plans
    from rnnfuse.tuning import tuner

    model = stack_model("lstm", 2, units=6, input_size=5, steps=7)
    (result,) = choose_plans(model, rnnfuse.analyze(model).groups,
                             tune=rnnfuse.TuneShape(3, 7), cache=False)
    assert result.source == "measured"
    # cuDNN's algorithms too: the (emulated) core runs them in both passes.
    assert set(result.timings) == {"per-layer", "fused", "fused @persistent_static+tc",
                                   "fused @persistent_dynamic+tc"}
    # The tuner's rule: fused only where it beats the original layers by
    # KEEP_ORIGINAL_MARGIN (on this CPU the two often time within it).
    t = result.timings
    chosen = result.plan.name
    assert chosen in t, t
    assert chosen == "per-layer" or t[chosen] <= (1 - tuner.KEEP_ORIGINAL_MARGIN) * t["per-layer"], t
    assert emulated_core.calls, "the fused candidate was not timed"


def test_absorbed_dropout_runs_cudnns_with_the_layers_seed(emulated_core):
    """A training call takes the Dropout layer's rate and seed to the
    core's training forward (cuDNN's dropout, drawn there); an inference
    call runs the inference forward without it."""
    from rnnfuse import FusedRNN

    a = keras.layers.LSTM(4, return_sequences=True, name="a")
    b = keras.layers.LSTM(4, name="b")
    drop = keras.layers.Dropout(0.3, seed=1)
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(b(drop(a(x), training=False)))
    fused = FusedRNN([a, b], dropout_layers=[drop])
    fused(x, training=True)
    assert fused.last_path.kind is PathKind.FUSED
    (target, attrs), = emulated_core.calls
    assert target == "rnnfuse_cudnn_ffi_forward_training"
    assert abs(attrs["dropout"] - 0.3) < 1e-7
    seed = int(drop.seed_generator._initial_seed)
    assert attrs["seed"] == seed % 2**31 + ((seed // 2**31) % 2**31 << 31)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(fused(x, training=False)), expected,
                               atol=1e-5)
    assert emulated_core.calls[-1][0] == "rnnfuse_cudnn_ffi_forward"
    assert emulated_core.calls[-1][1]["dropout"] == 0.0


def test_projected_lstm_runs_keras_loop_and_says_why():
    """The JAX backend has no ProjectedLSTM fast path: the layer runs Keras'
    generic loop (the same numbers as keras.layers.RNN over its cell), and
    use_cudnn=True refuses."""
    from rnnfuse.layers import ProjectedLSTM

    x = np.random.default_rng(0).normal(size=(2, 5, 3)).astype("float32")
    layer = ProjectedLSTM(6, 2, return_sequences=True)
    out = layer(x)
    assert layer.last_path == "keras_loop: no fast path for the jax backend"
    reference = keras.layers.RNN(layer.cell, return_sequences=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference(x)), atol=1e-6)
    with pytest.raises(ValueError, match="no fast path for the jax backend"):
        ProjectedLSTM(6, 2, use_cudnn=True)(x)
