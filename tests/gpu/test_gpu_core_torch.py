"""rnnfuse's cuDNN core under Keras' torch backend on a real GPU.

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch (the core is
built on first use: g++, the toolkit's headers, cuDNN's headers):

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_core_torch.py

Every test counts the core's launches (a spy on `cudnn_core.core_forward`
and `core_backward`, the binding's only calls into the library) and reads
the fused layer's `last_path`, so a silent fallback to `torch._VF` or to
the original layers fails. Outputs, final states and every gradient are
compared with the original Keras layers (which run PyTorch's cuDNN per
layer): float32 (TF32 off) relative error <= 5e-5 (outputs), 1e-4
(gradients) for LSTM/GRU (the core's calls, with padded IO and lengths,
take other cuDNN kernels than PyTorch's; cuDNN's own error against float64
on such stacks is 1.9e-5 (LSTM) to 3.1e-5 (GRU), docs/benchmarks.md, and
the two paths were measured 1.5e-5 to 3.3e-5 apart; a packing mistake
gives O(1)); SimpleRNN within 1e-3 / 1e-2 of Keras' exact
float32 loop (cuDNN's tanh, see test_gpu_torch.py); mixed_float16 <= 1e-2;
mixed_bfloat16 <= 5e-2. LSTMP is checked against torch.nn.LSTM(proj_size)
(PyTorch's cuDNN LSTMP), outputs, states and gradients.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import KINDS, fused_layers, initial_state_case, lstm_dropout_lstm, masked_stack_case, randomize, rnn_layer  # noqa: E402
from rnnfuse.backends.torch import cudnn_core  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402

L = keras.layers


@pytest.fixture
def launches(monkeypatch):
    """Counts the core's forward and backward launches (training flags too)."""
    counts = {"forward": 0, "backward": 0, "training": []}
    forward, backward = cudnn_core.core_forward, cudnn_core.core_backward

    def spy_forward(ints, dropout, seed, training, *args):
        counts["forward"] += 1
        counts["training"].append(training)
        return forward(ints, dropout, seed, training, *args)

    def spy_backward(*args):
        counts["backward"] += 1
        return backward(*args)

    monkeypatch.setattr(cudnn_core, "core_forward", spy_forward)
    monkeypatch.setattr(cudnn_core, "core_backward", spy_backward)
    return counts


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6))


def _outputs_and_grads(model, inputs, variables, training=False):
    out = model(inputs, training=training)
    flat = [t.float() for t in keras.tree.flatten(out)]
    loss = sum((t * torch.sin(torch.arange(t.shape[-1], device=t.device) + 1.0) + t**2).sum()
               for t in flat)
    return flat, torch.autograd.grad(loss, [v.value for v in variables])


def _compare(model, fast, inputs, *, out_tol, grad_tol):
    o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
    o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    worst_out = max(_rel(b, a) for a, b in zip(o0, o1))
    worst_grad = max(_rel(b, a) for a, b in zip(g0, g1))
    print(f"worst relative error: outputs {worst_out:.2e}, gradients {worst_grad:.2e}")
    assert len(o0) == len(o1) and worst_out <= out_tol and worst_grad <= grad_tol, (
        worst_out, worst_grad)
    return worst_out, worst_grad


# A narrow state's call without a plan algorithm: PyTorch's choice.
SMALL_H = "persistent_static_small_h"


def _on_core(fast, algorithm="standard"):
    (layer,) = fused_layers(fast)
    ran = layer.last_path.kernel
    assert ran is not None and ran.name == cudnn_core.KERNEL_NAME, layer.last_path
    assert ran.algorithm.startswith(algorithm), ran
    return ran


def _stack3(kind, bidirectional, dtype=None, steps=50, features=16, units=32):
    inp = keras.Input((steps, features))
    x = inp
    for _ in range(3):
        layer = rnn_layer(kind, units, return_sequences=True, dtype=dtype)
        x = (L.Bidirectional(layer, dtype=dtype) if bidirectional else layer)(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_core_matches_keras(kind, bidirectional, launches):
    model = _stack3(kind, bidirectional)
    randomize(model, scale=0.5 if kind in ("lstm", "gru") else 0.1)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = np.random.default_rng(1).standard_normal((8, 50, 16)).astype("float32")
    if kind in ("lstm", "gru"):
        _compare(model, fast, inputs, out_tol=5e-5, grad_tol=1e-4)
    else:
        _compare(model, fast, inputs, out_tol=1e-3, grad_tol=1e-2)
    _on_core(fast, SMALL_H)
    assert launches["forward"] == 1 and launches["backward"] == 1, launches
    assert launches["training"] == [True]
    with torch.no_grad():
        fast(inputs)
    assert launches["forward"] == 2 and launches["training"][-1] is False  # inference forward


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_right_padded_masks_run_as_lengths(kind, launches):
    model, fast, tokens = masked_stack_case(kind, last_return_state=True)
    _compare(model, fast, tokens, out_tol=5e-5, grad_tol=1e-4)
    _on_core(fast)
    assert launches["forward"] == 1 and launches["backward"] == 1


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_initial_state_go_backwards_and_return_state(kind, launches):
    model, fast, inputs = initial_state_case(kind)
    _compare(model, fast, inputs, out_tol=5e-5, grad_tol=1e-4)
    _on_core(fast, SMALL_H)
    assert launches["forward"] == 1 and launches["backward"] == 1


@pytest.mark.parametrize("policy, tol", [("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("algorithm", [SMALL_H, "persistent_static+tc",
                                       "persistent_dynamic+tc"])
def test_half_precision_and_every_algorithm(policy, tol, kind, algorithm, launches):
    """Both passes on each algorithm; bidirectional, as the speech encoders
    are. cuDNN may refuse a persistent algorithm for a shape: then the
    call must say so in its note and still be right."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = _stack3(kind, True, steps=40, units=64)
        randomize(model, 6, scale=0.2)
        plan = Plan((3,), None if algorithm == SMALL_H else algorithm)
        fast = rnnfuse.optimize(model, plan=plan)
        inputs = np.random.default_rng(7).standard_normal((16, 40, 16)).astype("float32")
        _compare(model, fast, inputs, out_tol=tol, grad_tol=tol)
        half = [t.float() for t in keras.tree.flatten(fast(inputs))]
        keras_half = [t.float() for t in keras.tree.flatten(model(inputs))]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Both against the same weights in float32: how far each half-precision
    # path is from it (printed; an exact match with Keras would be suspect).
    twin = _stack3(kind, True, steps=40, units=64)
    twin.set_weights(model.get_weights())
    (exact,) = keras.tree.flatten(twin(inputs))
    print(f"{policy} {kind} {algorithm}: from float32, fused {_rel(half[0], exact):.2e}, "
          f"Keras {_rel(keras_half[0], exact):.2e}; fused vs Keras "
          f"{_rel(half[0], keras_half[0]):.2e}")
    assert _rel(half[0], exact) <= 2 * _rel(keras_half[0], exact) + tol / 10
    ran = _on_core(fast, "")
    print(f"{policy} {kind} {algorithm}: ran {ran}")
    assert ran.algorithm == algorithm or "refused" in (ran.note or ""), ran
    assert launches["forward"] >= 1 and launches["backward"] >= 1


def test_between_layer_dropout_is_cudnns_seeded_and_trains(launches):
    """An absorbed Dropout runs as cuDNN's: a training call differs from
    inference (which equals Keras'), two training calls draw new masks, and
    the backward runs on the forward's reserve (finite gradients)."""
    model = lstm_dropout_lstm(32, 0.5, 30, 16, seed=3)
    randomize(model, 8)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    inputs = np.random.default_rng(9).standard_normal((8, 30, 16)).astype("float32")
    ref = model(inputs, training=False)
    assert _rel(fast(inputs, training=False), ref) <= 1e-5
    a, ga = _outputs_and_grads(fast, inputs, model.trainable_variables, training=True)
    b, _ = _outputs_and_grads(fast, inputs, model.trainable_variables, training=True)
    assert _rel(a[0], ref) > 1e-3 and _rel(a[0], b[0]) > 1e-3
    assert all(torch.isfinite(g).all() for g in ga)
    _on_core(fast, "")
    assert launches["backward"] == 2 and launches["training"][-2:] == [True, True]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstmp_matches_pytorchs_cudnn_lstmp(dtype, tol, bidirectional, launches):
    """The core's projection path against torch.nn.LSTM(proj_size), which
    PyTorch runs on cuDNN's LSTMP: outputs, states and every gradient."""
    torch.manual_seed(0)
    dirs = 2 if bidirectional else 1
    lstm = torch.nn.LSTM(24, 64, num_layers=2, proj_size=16, bidirectional=bidirectional).cuda()
    lstm = lstm.to(dtype)
    x = torch.randn(30, 8, 24, device="cuda", dtype=dtype, requires_grad=True)
    h0 = torch.randn(2 * dirs, 8, 16, device="cuda", dtype=dtype, requires_grad=True)
    c0 = torch.randn(2 * dirs, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    weights = list(lstm._flat_weights)
    y_ref, (h_ref, c_ref) = lstm(x, (h0, c0))
    params = cudnn_core.canonical_params(weights, 2 * dirs)
    code = cudnn_core.algorithm_code(None, dtype, allow_tf32=False)
    y, h, c = cudnn_core.run(x, "lstm", 2, 64, params, h0, c0, directions=dirs, proj_size=16,
                             algorithm=code, training=True)
    for got, want in ((y, y_ref), (h, h_ref), (c, c_ref)):
        assert got.shape == want.shape and _rel(got, want) <= tol
    probe = [torch.randn_like(t) for t in (y, h, c)]
    tensors = [x, h0, c0, *weights]
    g_ref = torch.autograd.grad([y_ref, h_ref, c_ref], tensors, probe)
    g = torch.autograd.grad([y, h, c], tensors, probe)
    worst = max(_rel(a, b) for a, b in zip(g, g_ref))
    print(f"LSTMP {dtype} bidirectional={bidirectional}: gradients {worst:.2e}")
    assert worst <= 10 * tol
    assert launches["forward"] == 1 and launches["backward"] == 1


def test_float64_on_cuda_falls_back_with_the_reason(launches):
    model = _stack3("lstm", False, dtype="float64")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast(np.zeros((2, 50, 16)))
    (layer,) = fused_layers(fast)
    ran = layer.last_path.kernel
    assert ran.name == "torch._VF.lstm" and "not float64" in ran.note, ran
    assert launches["forward"] == 0


def test_tuned_algorithms_are_tensorflows_candidates():
    from rnnfuse.backends import get_backend

    assert get_backend().capabilities.tuned_algorithms == (
        None, "persistent_static+tc", "persistent_dynamic+tc")


@pytest.mark.parametrize("policy, tol", [("float32", 1e-5), ("mixed_float16", 1e-2)])
def test_projected_lstm_stack_runs_the_cores_projection(policy, tol, launches):
    """An optimized ProjectedLSTM stack against Keras' generic loop."""
    from rnnfuse.layers import ProjectedLSTM
    from rnnfuse.layers.projected_lstm import fast_path

    keras.mixed_precision.set_global_policy(policy)
    try:
        inp = keras.Input((40, 16))
        x = inp
        for _ in range(3):
            x = L.Bidirectional(ProjectedLSTM(64, 16, return_sequences=True))(x)
        model = keras.Model(inp, x)
        randomize(model, 10, 0.3)
        inputs = np.random.default_rng(11).standard_normal((8, 40, 16)).astype("float32")
        with fast_path("off"):
            o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
        fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
        o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    worst = (_rel(o1[0], o0[0]), max(_rel(b, a) for a, b in zip(g0, g1)))
    print(f"ProjectedLSTM {policy}: worst (out, grad) {worst}")
    assert worst[0] <= tol and worst[1] <= 10 * tol
    _on_core(fast)
    assert launches["forward"] == 1 and launches["backward"] == 1
