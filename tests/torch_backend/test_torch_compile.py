"""torch.compile of fused layers (Keras' torch trainer under jit_compile=True).

The fused call compiles without a graph break (`fullgraph=True`) on both of
its torch paths: rnnfuse's cuDNN core (its custom ops, emulated on the CPU
by core_emulation.py) and `torch._VF`; outputs and gradients equal the
eager call's; so does the wavefront kernel's inference op (its library
calls faked). A masked call breaks the graph where cuDNN needs the lengths
on the host, and stays exact. Models compiled with jit_compile=True train,
predict and evaluate as the unfused model compiled the same way (the slow
tests, tests/markers_slow.py). With tuning, a torch-compiled fit is planned
on eager timing (the decisions' baseline), not raced on its own steps.

Compiles here use the "aot_eager" backend: dynamo and AOTAutograd (fake
tensors, the custom ops' autograd), what rnnfuse's ops must pass, without
inductor's C++ builds (minutes on a small CPU); tests/gpu/test_gpu_torch_compile.py
runs inductor on a GPU.
"""

from __future__ import annotations

import functools
import types

import keras
import numpy as np
import pytest
import torch

import core_emulation
import rnnfuse
from builders import fused_layers, fused_with_plan, max_abs_diff, stack_model, wavefront_inputs, wavefront_stack
from fake_clock import FakeTimer
from rnnfuse import FusedRNN, PathKind
from rnnfuse.backends.torch import wavefront
from rnnfuse.plan import Plan
from rnnfuse.tuning import first_batch, tuner

L = keras.layers
ENV = {"device": "FakeGPU", "torch": "2", "backend": "torch", "rnnfuse": "0.1.0"}


@pytest.fixture
def aot_eager(monkeypatch):
    """Keras' trainer's torch.compile on the "aot_eager" backend, with a
    fresh dynamo cache."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    yield
    torch._dynamo.reset()


def _fused(kind, *, bidirectional=False):
    keras.utils.set_random_seed(3)
    layers = [L.LSTM(6, return_sequences=True), L.LSTM(6)] if kind == "lstm" else [
        L.GRU(6, return_sequences=True), L.GRU(6, return_sequences=True)]
    if bidirectional:
        layers = [L.Bidirectional(layer) for layer in layers]
    layer = FusedRNN(layers)
    layer(np.zeros((4, 7, 5), "float32"))
    return layer


def _loss_and_grads(layer, x, call):
    variables = [w.value for w in layer.trainable_weights]
    loss = keras.tree.flatten(call(x))[0].square().sum()
    return loss.detach(), torch.autograd.grad(loss, variables)


@pytest.mark.parametrize("core", [True, False], ids=["core", "torch_vf"])
@pytest.mark.parametrize("case", ["gru", "bigru", "lstm"])
def test_the_fused_call_compiles_whole_and_matches_the_eager_call(case, core, monkeypatch):
    calls = core_emulation.install(monkeypatch) if core else []
    layer = _fused(case[-4:] if case != "bigru" else "gru", bidirectional=case == "bigru")
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((4, 7, 5)), dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t, training=True), backend="aot_eager",
                             fullgraph=True)
    eager_loss, eager_grads = _loss_and_grads(layer, x, lambda t: layer(t, training=True))
    del calls[:]
    loss, grads = _loss_and_grads(layer, x, compiled)
    if case == "lstm" and not core:
        # PyTorch's CPU LSTM has no compiled gradient: the original layers ran.
        assert layer.last_path.reason.rule == "not_implemented", layer.last_path
    else:
        assert layer.last_path.kind is PathKind.FUSED, layer.last_path
        assert [c["pass_"] for c in calls] == (["forward", "backward"] if core else [])
    assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        inference = torch.compile(lambda t: layer(t, training=False), backend="aot_eager",
                                  fullgraph=True)(x)
    assert layer.last_path.kind is PathKind.FUSED, layer.last_path
    assert max_abs_diff(inference, layer(x, training=False)) <= 1e-6


def test_a_wavefront_inference_call_compiles_whole(monkeypatch, half):
    """The real custom op, its body's library calls faked (test_torch_wavefront_wiring's
    kernel computes the outputs): the op traces whole and its body runs."""
    from test_torch_wavefront_wiring import FakeKernel

    kernel = FakeKernel()

    def forward_into(xproj, params, h0, c0, lengths, y, hy, cy, workspace, *, kind,
                     input_size, **options):
        none = torch.empty(0, dtype=torch.int32)
        got = kernel.op(xproj, params, h0, c0, none if lengths is None else lengths, kind,
                        input_size)
        for out, value in zip((y, hy, cy), got):
            out.copy_(value)

    library = types.SimpleNamespace(
        FORWARD_VARIANT=0, load=lambda: types.SimpleNamespace(workspace_bytes=lambda *a: 0))
    monkeypatch.setattr(wavefront, "_library", lambda: library)
    monkeypatch.setattr(wavefront, "forward_into", forward_into)
    monkeypatch.setattr(wavefront, "unsupported_reason", kernel.unsupported_reason)
    layer = fused_with_plan(wavefront_stack("lstm"), Plan((2,), kernel="wavefront"))
    x = torch.as_tensor(wavefront_inputs())
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda t: layer(t, training=False), backend="aot_eager",
                            fullgraph=True)(x)
        ran = layer.last_path.kernel
        want = layer(x, training=False)
    assert ran.name == wavefront.KERNEL_NAME and ran.note is None, ran
    assert len(kernel.calls) == 2, "the compiled call and the eager one ran the op's body"
    assert max_abs_diff(got, want) <= 1e-3


def test_a_masked_call_compiles_exactly_with_a_break_for_the_hosts_lengths(monkeypatch):
    calls = core_emulation.install(monkeypatch)
    layer = _fused("gru")
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((4, 7, 5)), dtype=torch.float32)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 5, 3, 1])[:, None]
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, m: layer(t, mask=m), backend="aot_eager")
    got = compiled(x, mask)
    assert layer.last_path.kind is PathKind.FUSED and calls, layer.last_path
    assert max_abs_diff(got, layer(x, mask=mask)) <= 1e-6


def test_a_torch_compiled_fit_is_planned_on_eager_timing_not_raced(monkeypatch):
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    baselines = []

    def steps(group, plans, shape, dtype, training, jit_baseline=False, masked=False):
        baselines.append(jit_baseline)
        return {p.name: shape for p in plans}

    monkeypatch.setattr(tuner, "_steps", steps)
    model = stack_model("gru", 2, units=4, input_size=3, steps=5)
    x = np.zeros((8, 5, 3), "float32")
    decided = {}
    for jit in (False, True):
        fast = rnnfuse.optimize(model, cache=False)
        state = fast._rnnfuse_autotune
        state.online, state.environment, state.fit_share = True, dict(ENV), None
        state.measure = FakeTimer({"fused": 0.5})
        state.check_gradients = lambda *args: 1e-6
        fast.compile(optimizer="sgd", loss="mse", jit_compile=jit)
        with first_batch.keras_call(fast, x, 4, training=True, steps=10_000):
            decided[jit] = (dict(state.online_pending), first_batch.decisions(fast))
    eager_pending, _ = decided[False]
    compiled_pending, (record,) = decided[True]
    assert eager_pending and not compiled_pending, "an eager fit races; a compiled one does not"
    assert record["xla_baseline"] is False and record["chosen"] == "fused", record
    assert baselines and not any(baselines), "every candidate was timed as an eager step"


def _fit_predict_evaluate(make, fused, x, y, **fit):
    model = make()
    if fused:
        model = rnnfuse.optimize(model, tune=False)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is True
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, **fit)
    prediction = model.predict(x, batch_size=4, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=4, verbose=0)
    return model, history.history["loss"], prediction, evaluation


def _assert_same_training(make, x, y):
    model, losses, prediction, evaluation = _fit_predict_evaluate(make, False, x, y)
    fast, fast_losses, fast_prediction, fast_evaluation = _fit_predict_evaluate(make, True, x, y)
    assert fused_layers(fast) and all(
        f.last_path.kind is PathKind.FUSED for f in fused_layers(fast)), [
        f.last_path for f in fused_layers(fast)]
    np.testing.assert_allclose(fast_losses, losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(fast_prediction, prediction) <= 1e-5
    np.testing.assert_allclose(fast_evaluation, evaluation, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast.weights, model.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_jit_compiled_model_with_states_and_a_bidirectional_stack_trains_as_the_unfused(
        monkeypatch, aot_eager):
    core_emulation.install(monkeypatch)

    def make():
        keras.utils.set_random_seed(5)
        x = inp = keras.Input((3, 3))
        h0 = keras.Input((4,))
        x = L.GRU(4, return_sequences=True)(x, initial_state=[h0])
        x = L.GRU(4, return_sequences=True)(x)
        x = L.Bidirectional(L.GRU(3, return_sequences=True))(x)
        x = L.Bidirectional(L.GRU(3))(x)
        return keras.Model([inp, h0], L.Dense(2)(x))

    rng = np.random.default_rng(2)
    x = [rng.standard_normal((8, 3, 3)).astype("float32"),
         rng.standard_normal((8, 4)).astype("float32")]
    _assert_same_training(make, x, rng.standard_normal((8, 2)).astype("float32"))


def test_a_jit_compiled_masked_model_with_dropout_between_layers_matches_the_unfused(
        monkeypatch, aot_eager):
    """Inference as the unfused model's; training passes the Dropout's rate
    to the core's compiled calls (cuDNN's dropout draws its own masks)."""
    calls = core_emulation.install(monkeypatch)

    def make():
        keras.utils.set_random_seed(6)
        inp = keras.Input((4,), dtype="int32")
        x = L.Embedding(11, 3, mask_zero=True)(inp)
        x = L.LSTM(4, return_sequences=True)(x)
        x = L.Dropout(0.25)(x)
        x = L.LSTM(4)(x)
        return keras.Model(inp, L.Dense(2)(x))

    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 11, (8, 4)).astype("int32")
    for row, length in enumerate([4, 3, 2, 1, 4, 2, 1, 4]):
        tokens[row, length:] = 0
    y = rng.standard_normal((8, 2)).astype("float32")
    outputs = []
    for fused in (False, True):
        model = make()
        model = rnnfuse.optimize(model, tune=False) if fused else model
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        outputs.append((model.predict(tokens, batch_size=4, verbose=0),
                        model.evaluate(tokens, y, batch_size=4, verbose=0)))
    assert max_abs_diff(outputs[1][0], outputs[0][0]) <= 1e-5
    np.testing.assert_allclose(outputs[1][1], outputs[0][1], rtol=1e-5)
    (layer,) = fused_layers(model)
    assert layer.absorbed_dropout and layer.last_path.kind is PathKind.FUSED, layer.last_path
    before = [np.array(w) for w in layer.get_weights()]
    del calls[:]
    history = model.fit(tokens, y, batch_size=4, epochs=1, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert {c["dropout"] for c in calls if c["pass_"] == "forward" and c["training"]} == {0.25}
    assert any(not np.array_equal(a, b) for a, b in zip(before, layer.get_weights()))
