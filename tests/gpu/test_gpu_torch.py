"""FusedRNN under Keras' torch backend on a real GPU (cuDNN through PyTorch).

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch, with
rnnfuse's cuDNN core turned off (RNNFUSE_DISABLE_CORE). Every test
proves that one multi-layer `torch._VF` call ran (a spy on the backend's
single call site, `rnnfuse.backends.torch.torch_rnn`) and that PyTorch ran
it on cuDNN (its autograd graph holds `CudnnRnnBackward0`), so a silent
fallback to the original layers or to PyTorch's native kernels fails.

Run on the GPU machine (PyTorch is there; carry keras' wheels only):

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_torch.py

Tolerances: float32 relative error <= 1e-5 (outputs), 1e-4 (gradients),
TF32 off (tests/gpu/conftest.py); mixed_float16 <= 1e-2, mixed_bfloat16
<= 5e-2.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import KINDS, assert_fastest_or_kept_original, fused_layers, initial_state_case, masked_stack_case, projected_stack, random_inputs, randomize, rnn_layer, sequence_input, stack_model  # noqa: E402
from gpu_compare import worst_within  # noqa: E402
from rnnfuse.backends import torch as torch_backend  # noqa: E402
from lstmp_reference import lstmp  # noqa: E402
from torch_checks import vf_call  # noqa: E402

L = keras.layers


@pytest.fixture(autouse=True)
def _vf_path(monkeypatch):
    """These tests are `torch._VF`'s (PyTorch's own cuDNN calls): rnnfuse's
    cuDNN core, which "cudnn" plans run on CUDA, has
    tests/gpu/test_gpu_core_torch.py."""
    monkeypatch.setenv("RNNFUSE_DISABLE_CORE", "1")


def _autograd_nodes(tensor, depth=6) -> set[str]:
    """Names of the autograd nodes within `depth` steps of `tensor`."""
    names, front = set(), [tensor.grad_fn]
    for _ in range(depth):
        nxt = []
        for fn in front:
            if fn is None:
                continue
            names.add(type(fn).__name__)
            nxt += [f for f, _ in fn.next_functions]
        front = nxt
    return names


@pytest.fixture
def cudnn_calls(monkeypatch):
    """Records each fused call: layers, direction, dtype, device, cuDNN used."""
    calls = []
    real = torch_backend.torch_rnn

    def spy(mode, *args):
        result = real(mode, *args)
        calls.append(dict(
            vf_call(mode, args),
            dtype=args[0].dtype,
            device=args[0].device.type,
            cudnn=("CudnnRnnBackward0" in _autograd_nodes(result[0])
                   if torch.is_grad_enabled() else None),
        ))
        return result

    monkeypatch.setattr(torch_backend, "torch_rnn", spy)
    return calls


def _rel(a, b) -> float:
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6))


def _compare(model, fast, inputs, *, out_tol, grad_tol):
    results = []
    for m in (model, fast):
        out = m(inputs)
        flat = [t.float() for t in keras.tree.flatten(out)]
        loss = sum((t * torch.sin(torch.arange(t.shape[-1], device=t.device) + 1.0) + t**2).sum() for t in flat)
        grads = torch.autograd.grad(loss, [v.value for v in model.trainable_variables])
        results.append((flat, grads))
    return worst_within(results, _rel, out_tol=out_tol, grad_tol=grad_tol)


def _one_cudnn_call(calls, num_layers, bidirectional=False):
    assert len(calls) == 1, calls
    call = calls[0]
    assert call["device"] == "cuda"
    assert call["num_layers"] == num_layers
    assert call["bidirectional"] is bidirectional
    assert call["cudnn"], "PyTorch did not run the fused call on cuDNN"
    return call


def _stack3(kind, bidirectional, dtype="float32"):
    inp = keras.Input((50, 16), dtype=dtype)
    x = inp
    for _ in range(3):
        layer = rnn_layer(kind, 32, return_sequences=True, dtype=dtype)
        x = (L.Bidirectional(layer, dtype=dtype) if bidirectional else layer)(x)
    return keras.Model(inp, x)


def _outputs_and_grads(model, inputs, variables):
    out = model(inputs)
    flat = [t.double() for t in keras.tree.flatten(out)]
    loss = sum((t * torch.sin(torch.arange(t.shape[-1], device=t.device) + 1.0) + t**2).sum() for t in flat)
    return flat, torch.autograd.grad(loss, [v.value for v in variables])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_matches_keras_on_gpu(kind, bidirectional, cudnn_calls):
    """LSTM/GRU: within 1e-5 of Keras (which runs cuDNN per layer too).

    SimpleRNN: Keras' torch backend steps through time in Python with
    PyTorch's exact tanh, while cuDNN (as PyTorch 2.11 drives it, TF32
    off) evaluates tanh to about 7e-6 relative per activation (one step,
    one layer: 7.3e-6, against 1.6e-7 for PyTorch's native CUDA kernel;
    relu is exact: bench/diag_torch_tanh.py). A tanh recurrence with these
    weights (uniform +-0.5, 32 units: gain above 1) grows that to 2.3e-4
    over 3 layers x 50 steps. Keras' torch LSTM and GRU call the same cuDNN,
    hence the 1e-5 agreement above. So for SimpleRNN the fused result is
    compared with a float64 run of the same model: relu as close as Keras'
    own float32 loop (within 2x), tanh within 5e-4 (cuDNN's activation),
    both within 1e-3 of Keras (a packing mistake gives O(1)); the numbers
    are printed. Weights that damp the recurrence: 1e-5 (next test).
    """
    model = _stack3(kind, bidirectional)
    randomize(model)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    inputs = np.random.default_rng(1).standard_normal((8, 50, 16)).astype("float32")
    if kind in ("lstm", "gru"):
        _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)
        _one_cudnn_call(cudnn_calls, 3, bidirectional)
        return
    twin = _stack3(kind, bidirectional, "float64")
    twin.set_weights(model.get_weights())
    (exact,), exact_grads = _outputs_and_grads(twin, inputs.astype("float64"), twin.trainable_variables)
    (keras_out,), keras_grads = _outputs_and_grads(model, inputs, model.trainable_variables)
    (fused_out,), fused_grads = _outputs_and_grads(fast, inputs, model.trainable_variables)
    _one_cudnn_call(cudnn_calls, 3, bidirectional)
    err = dict(
        keras_out=_rel(keras_out, exact),
        fused_out=_rel(fused_out, exact),
        keras_grad=max(_rel(g, e) for g, e in zip(keras_grads, exact_grads)),
        fused_grad=max(_rel(g, e) for g, e in zip(fused_grads, exact_grads)),
        fused_vs_keras_out=_rel(fused_out, keras_out),
        fused_vs_keras_grad=max(_rel(g, e) for g, e in zip(fused_grads, keras_grads)),
    )
    print(f"{kind} bidirectional={bidirectional} relative errors: {err}")
    if kind == "rnn_relu":
        assert err["fused_out"] <= 2 * err["keras_out"] + 1e-6, err
        assert err["fused_grad"] <= 2 * err["keras_grad"] + 1e-5, err
    else:
        assert err["fused_out"] <= 5e-4 and err["fused_grad"] <= 5e-4, err
    assert err["fused_vs_keras_out"] <= 1e-3 and err["fused_vs_keras_grad"] <= 1e-2, err


@pytest.mark.parametrize("kind", ["rnn_tanh", "rnn_relu"])
def test_simple_rnn_with_contracting_weights_matches_keras_tightly(kind, cudnn_calls):
    """Where the recurrence damps rounding (weights +-0.1), 1e-5 as for LSTM."""
    model = _stack3(kind, False)
    rng = np.random.default_rng(12)
    for v in model.weights:
        v.assign(rng.uniform(-0.1, 0.1, v.shape).astype(v.dtype))
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = np.random.default_rng(13).standard_normal((8, 50, 16)).astype("float32")
    worst = _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)
    print(f"{kind} contracting weights: worst (out, grad) {worst}")
    _one_cudnn_call(cudnn_calls, 3)


@pytest.fixture
def user_default_tf32():
    """PyTorch's own defaults (not the suite's TF32-off): matmuls exact,
    cuDNN allowed TF32. Put back as the suite sets them afterwards."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("which", ["relu_stack", "tanh_contracting", "rnn_lstm_cell", "masked_lstm"])
def test_loop_kinds_follow_keras_precision_with_default_tf32(which, user_default_tf32, cudnn_calls):
    """With cuDNN's TF32 allowed (PyTorch's default) a fused
    stack that Keras runs in its exact-float32 loop still matches it: the
    fused call runs cuDNN without TF32 (was up to 8e-4 off on a relu stack)
    and leaves the user's flag as it was."""
    if which == "relu_stack":
        model = _stack3("rnn_relu", False)
    elif which == "tanh_contracting":
        model = _stack3("rnn_tanh", False)
    elif which == "rnn_lstm_cell":
        inp = keras.Input((50, 16))
        x = L.RNN(L.LSTMCell(32), return_sequences=True)(inp)
        model = keras.Model(inp, L.RNN(L.LSTMCell(32), return_sequences=True)(x))
    else:
        model = stack_model("lstm", 2, units=32, input_size=16, steps=50, masked=True, last_return_sequences=True)
    rng = np.random.default_rng(31)
    scale = 0.1 if which != "relu_stack" else 0.3
    for v in model.weights:
        v.assign(rng.uniform(-scale, scale, v.shape).astype(v.dtype))
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    if which == "masked_lstm":
        inputs = random_inputs(model, 8, np.random.default_rng(32))
        inputs[:, 40:] = 0  # right-padded
    else:
        inputs = np.random.default_rng(32).standard_normal((8, 50, 16)).astype("float32")
    worst = _compare(model, fast, inputs, out_tol=2e-5, grad_tol=2e-4)
    print(f"{which} with cuDNN TF32 allowed: worst (out, grad) {worst}")
    assert cudnn_calls and all(c["cudnn"] for c in cudnn_calls)
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch_backend._EXACT_FLOAT32.holds == 0


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_right_padded_mask_runs_packed_cudnn(kind, cudnn_calls):
    model, fast, tokens = masked_stack_case(kind, last_return_state=True)
    _compare(model, fast, tokens, out_tol=1e-5, grad_tol=1e-4)
    call = _one_cudnn_call(cudnn_calls, 3)
    assert call["packed"]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_initial_state_go_backwards_and_return_state(kind, cudnn_calls):
    model, fast, inputs = initial_state_case(kind)
    _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)
    _one_cudnn_call(cudnn_calls, 3)


@pytest.mark.parametrize("policy, tol", [("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_mixed_precision_on_gpu(policy, tol, kind, cudnn_calls):
    keras.config.set_dtype_policy(policy)
    try:
        model = stack_model(kind, 3, units=64, input_size=32, steps=50, last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = random_inputs(model, 8, np.random.default_rng(6))
    worst = _compare(model, fast, inputs, out_tol=tol, grad_tol=10 * tol)
    assert len(cudnn_calls) == 1
    call = cudnn_calls[0]
    assert call["dtype"] == getattr(torch, policy.split("_")[1])
    assert call["device"] == "cuda" and call["num_layers"] == 3
    # Record whether PyTorch used cuDNN for this dtype (bfloat16 may run
    # PyTorch's native CUDA kernels instead); float16 must be cuDNN.
    print(f"{policy} {kind}: cudnn={call['cudnn']} worst(out, grad)={worst}")
    if policy == "mixed_float16":
        assert call["cudnn"]


def test_float16_auto_mode_runs_one_call_per_level_where_cudnn_is_persistent(cudnn_calls):
    """PyTorch runs cuDNN's persistent kernel for
    float16 single-layer LSTM calls with hidden % 128 == 0 and batch % 8 ==
    0, so "auto" makes one call per level; "one" forces the multi-layer call."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = stack_model("lstm", 3, units=128, input_size=128, steps=50, last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = random_inputs(model, 16, np.random.default_rng(10))
    _compare(model, fast, inputs, out_tol=1e-2, grad_tol=1e-1)
    print("auto calls:", [(c["num_layers"], c["cudnn"]) for c in cudnn_calls])
    assert [c["num_layers"] for c in cudnn_calls] == [1, 1, 1]
    assert all(c["cudnn"] and c["dtype"] == torch.float16 for c in cudnn_calls)
    cudnn_calls.clear()
    with torch_backend.call_mode("one"):
        _compare(model, fast, inputs, out_tol=1e-2, grad_tol=1e-1)
    assert [c["num_layers"] for c in cudnn_calls] == [3] and cudnn_calls[0]["cudnn"]


def test_training_on_gpu_matches_the_original(cudnn_calls):
    model = stack_model("lstm", 3, units=32, input_size=16, steps=30, head=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    rng = np.random.default_rng(7)
    x = random_inputs(model, 16, rng)
    y = rng.standard_normal((16, 3)).astype("float32")
    start = [v.value.detach().clone() for v in model.trainable_variables]
    trained = []
    for m in (model, fast):
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
        trained.append([v.value.detach().clone() for v in model.trainable_variables])
    # Keras traces the model once on the "meta" device to learn its output
    # spec; every real call must be on the GPU.
    assert any(c["device"] == "cuda" for c in cudnn_calls)
    assert {c["device"] for c in cudnn_calls} <= {"cuda", "meta"}
    for a, b in zip(*trained):
        assert _rel(b, a) <= 1e-4


# -- ProjectedLSTM: cuDNN LSTMP -----------------------------------------------------


def _numpy_lstmp(x, cells, bidirectional):
    """Float64 NumPy LSTMP stack (zero initial states): the exact reference."""
    def run(seq, cell):
        k, r, b, p = (
            keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(w)).astype(np.float64)
            for w in (cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel)
        )
        h = np.zeros((seq.shape[0], p.shape[1]))
        c = np.zeros((seq.shape[0], p.shape[0]))
        return lstmp(seq, (k, r, b, p), h, c)[0]

    y = x.astype(np.float64)
    for level in cells:
        fwd = run(y, level[0])
        if bidirectional:
            bwd = run(y[:, ::-1], level[1])[:, ::-1]
            y = np.concatenate([fwd, bwd], axis=-1)
        else:
            y = fwd
    return y


def _merged3(kind, merge_mode, masked, layer=None):
    """Three Bidirectional levels over 50 steps (tokens through a masking
    Embedding, or 16 features); the lower two merge by `merge_mode`."""
    inp, x = sequence_input(masked, 50, 16)
    layer = layer or (lambda **kw: rnn_layer(kind, 32, **kw))
    for i in range(3):
        x = L.Bidirectional(layer(return_sequences=True), merge_mode=merge_mode if i < 2 else "concat")(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "right_padded"])
def test_bidirectional_sum_and_ave_below_the_top_on_gpu(kind, merge_mode, masked, cudnn_calls):
    """One cuDNN call of 3 bidirectional levels, the upper two
    reading [fwd, bwd] through input kernels packed as [W; W] or [W/2; W/2].

    SimpleRNN kinds get contracting weights (+-0.1), where cuDNN's tanh
    rounding is damped and 1e-5 holds (see
    test_simple_rnn_with_contracting_weights_matches_keras_tightly)."""
    model = _merged3(kind, merge_mode, masked)
    rng = np.random.default_rng(41)
    scale = 0.5 if kind in ("lstm", "gru") else 0.1
    for v in model.weights:
        v.assign(rng.uniform(-scale, scale, v.shape).astype(v.dtype))
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    if masked:
        inputs = random_inputs(model, 8, np.random.default_rng(42), padding="right")
        inputs[0, 5:] = 0
    else:
        inputs = np.random.default_rng(42).standard_normal((8, 50, 16)).astype("float32")
    worst = _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)
    print(f"{kind} {merge_mode} masked={masked}: worst (out, grad) {worst}")
    call = _one_cudnn_call(cudnn_calls, 3, True)
    assert call["packed"] is masked
    gates = {"lstm": 4, "gru": 3}.get(kind, 1)
    assert tuple(call["params"][4 * 2].shape) == (gates * 32, 64)  # level 1 w_ih: [G*H, 2H]


@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_projected_bidirectional_sum_and_ave_on_gpu(merge_mode, cudnn_calls):
    from rnnfuse.layers import ProjectedLSTM
    from rnnfuse.layers.projected_lstm import fast_path

    model = _merged3("lstm", merge_mode, True, layer=lambda **kw: ProjectedLSTM(64, 16, **kw))
    randomize(model, 43)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    inputs = random_inputs(model, 8, np.random.default_rng(44), padding="right")
    with fast_path("off"):  # the original layers run Keras' loop
        _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)
    call = _one_cudnn_call(cudnn_calls, 3, True)
    assert tuple(call["params"][5 * 2].shape) == (4 * 64, 2 * 16)  # level 1 w_ih: [4H, 2P]


@pytest.mark.parametrize("bidirectional", [False, True])
def test_projected_lstm_stack_runs_cudnn_projections(bidirectional, cudnn_calls):
    model = projected_stack(3, 64, 16, 40, 16, bidirectional=bidirectional)
    randomize(model, 8)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    inputs = np.random.default_rng(9).standard_normal((8, 40, 16)).astype("float32")
    got = fast(inputs)
    call = _one_cudnn_call(cudnn_calls, 3, bidirectional)
    assert len(call["params"]) == 5 * 3 * (2 if bidirectional else 1)
    expected = _numpy_lstmp(inputs, fused.stack.cells, bidirectional)
    rel = _rel(torch.as_tensor(expected), got)
    assert rel <= 1e-5, rel
    # And against the layers' own (Keras loop) result, gradients included.
    from rnnfuse.layers.projected_lstm import fast_path

    cudnn_calls.clear()
    with fast_path("off"):  # the original layers run Keras' loop, not their own call
        _compare(model, fast, inputs, out_tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_single_projected_lstm_layer_runs_cudnn(bidirectional, cudnn_calls):
    """One ProjectedLSTM layer (no rnnfuse.optimize) runs cuDNN's LSTMP itself.

    A right-padded mask (packed call) and, unidirectionally, go_backwards;
    compared with Keras' generic loop (`fast_path("off")`), gradients included.
    """
    from rnnfuse.layers import ProjectedLSTM
    from rnnfuse.layers.projected_lstm import fast_path

    inp = keras.Input((40,), dtype="int32")
    x = L.Embedding(50, 16, mask_zero=True)(inp)
    layer = ProjectedLSTM(
        64, 16, return_sequences=True, return_state=True, go_backwards=not bidirectional
    )
    outer = L.Bidirectional(layer) if bidirectional else layer
    model = keras.Model(inp, outer(x))
    randomize(model, 10)
    tokens = np.random.default_rng(11).integers(1, 50, (8, 40)).astype("int32")
    tokens[1, 25:] = 0
    tokens[5, 3:] = 0

    def run():
        out = model(tokens)
        flat = [t.float() for t in keras.tree.flatten(out)]
        loss = sum(
            (t * torch.sin(torch.arange(t.shape[-1], device=t.device) + 1.0) + t**2).sum()
            for t in flat
        )
        return flat, torch.autograd.grad(loss, [v.value for v in model.trainable_variables])

    with fast_path("off"):
        expected, expected_grads = run()
    assert not cudnn_calls
    got, got_grads = run()
    parts = (outer.forward_layer, outer.backward_layer) if bidirectional else (layer,)
    assert [p.last_path for p in parts] == ["torch_fused"] * len(parts)
    assert len(cudnn_calls) == len(parts), cudnn_calls
    for call in cudnn_calls:
        assert call["device"] == "cuda" and call["packed"]
        assert call["num_layers"] == 1 and call["bidirectional"] is False
        assert call["cudnn"], "PyTorch did not run the layer's call on cuDNN"
        assert tuple(call["params"][4].shape) == (16, 64)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in expected]
    worst_out = max(_rel(g, e) for g, e in zip(got, expected))
    worst_grad = max(_rel(g, e) for g, e in zip(got_grads, expected_grads))
    assert worst_out <= 1e-5, worst_out
    assert worst_grad <= 1e-4, worst_grad


# -- tuning: plans measured on the GPU ------------------------------------------


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_tuner_times_every_candidate_on_the_gpu_and_builds_the_fastest(policy, cudnn_calls):
    """optimize(tune=...) under torch: per-layer, whole, one call per layer
    (and in float16 the wavefront kernel) timed on the GPU; the fastest is
    built and stays exact."""
    from rnnfuse.api import choose_plans

    keras.config.set_dtype_policy(policy)
    try:
        model = stack_model("lstm", 3, units=128, input_size=128, steps=50, last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")
    (result,) = choose_plans(
        model, rnnfuse.analyze(model).groups, tune=rnnfuse.TuneShape(16, 50), cache=False
    )
    print(policy, "tuner ms:", {n: round(t * 1e3, 3) for n, t in result.timings.items()},
          "->", result.plan.name)
    assert result.source == "measured"
    # In float16 the wavefront kernel (forward and backward) is a training
    # candidate too, where its plan takes the shape; float32 it refuses.
    wavefront = {"fused on wavefront"} & (set(result.timings) | set(result.rejected))
    assert wavefront or policy == "float32", result.rejected
    assert set(result.timings) - wavefront == {"per-layer", "fused", "split 1+1+1"}
    assert_fastest_or_kept_original(result)
    assert cudnn_calls and all(c["device"] == "cuda" for c in cudnn_calls)
    fast = rnnfuse.optimize(model, plan=result.plan)
    inputs = random_inputs(model, 16, np.random.default_rng(14))
    tol = 1e-5 if policy == "float32" else 1e-2
    _compare(model, fast, inputs, out_tol=tol, grad_tol=10 * tol)
