"""The torch binding of rnnfuse's cuDNN core, on the CPU, against an emulation.

The core's two tensor-level entries (`cudnn_core.core_forward`,
`core_backward`) are replaced by tests/torch_backend/core_emulation.py
(cuDNN's equations over the canonical flat buffer, tests/cudnn_reference.py,
in float64 torch), and "cudnn" calls on CPU tensors are sent to the core.
What runs for real: the packing (PyTorch's weight list -> the canonical
layout), the custom ops and their autograd formula (the saved tensors, the
gradients' order), masks as lengths, reversal, states, the algorithm code,
dropout and seed, and every fallback with its reason. The library's
arithmetic is the GPU tests' (tests/gpu/test_gpu_core_torch.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

import rnnfuse
from builders import KINDS, fused_layers, initial_state_case, lstm_dropout_lstm, masked_stack_case, projected_stack, random_inputs, randomize, rnn_layer, stack_model
from core_emulation import install
from cudnn_reference import numpy_cudnn_rnn
from rnnfuse.backends import torch as torch_backend
from rnnfuse.backends.base import StackSpec
from rnnfuse.backends.cuda.cudnn_core import E_CUDNN, E_NOT_SUPPORTED, CoreError
from rnnfuse.backends.torch import cudnn_core
from rnnfuse.plan import Algorithm, Plan

L = keras.layers


@pytest.fixture
def core(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # as on the GPU suite
    return install(monkeypatch)


def _stack(kind, bidirectional, levels=3, steps=9, features=5, units=6, **kwargs):
    inp = keras.Input((steps, features))
    x = inp
    for _ in range(levels):
        layer = rnn_layer(kind, units, return_sequences=True, **kwargs)
        x = (L.Bidirectional(layer) if bidirectional else layer)(x)
    return keras.Model(inp, x)


def _outputs_and_grads(model, inputs, variables, training=False):
    out = model(inputs, training=training)
    flat = [t.double() for t in keras.tree.flatten(out)]
    loss = sum((t * torch.sin(torch.arange(t.shape[-1]) + 1.0) + t**2).sum() for t in flat)
    return flat, torch.autograd.grad(loss, [v.value for v in variables])


def _compare(model, fast, inputs, tol=2e-5):
    o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
    o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    assert [t.shape for t in o0] == [t.shape for t in o1]
    assert max(float((a - b).detach().abs().max()) for a, b in zip(o0, o1)) <= tol
    assert max(float((a - b).abs().max()) for a, b in zip(g0, g1)) <= 10 * tol


def _ran(fast):
    (layer,) = fused_layers(fast)
    return layer.last_path.kernel


# -- packing ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_canonical_params_are_the_layout_the_reference_reads(kind, bidirectional):
    """Keras' own layers against the NumPy reference reading the canonical
    buffer that the binding builds from PyTorch's weight list."""
    model = _stack(kind, bidirectional, levels=2)
    randomize(model, 1)
    x = np.random.default_rng(2).standard_normal((4, 9, 5)).astype("float32")
    cells = tuple(
        tuple(getattr(l, d).cell for d in ("forward_layer", "backward_layer"))
        if bidirectional else (l.cell,)
        for l in model.layers[1:])
    stack = StackSpec(kind, 6, cells)
    weights = torch_backend.pack_params(stack, torch.float64, "cpu")
    flat = cudnn_core.canonical_params(weights, stack.num_pseudo_layers)
    dirs = stack.num_directions
    h0 = np.zeros((2 * dirs, 4, 6))
    out, _, _ = numpy_cudnn_rnn(x.transpose(1, 0, 2), h0, h0 if kind == "lstm" else None,
                                flat.detach().numpy(), [9] * 4, kind, bidirectional)
    expected = keras.ops.convert_to_numpy(model(x))
    assert np.abs(out.transpose(1, 0, 2) - expected).max() <= 1e-5


def test_canonical_params_with_a_projection():
    """w_hr goes after each pseudo-layer's w_ih and w_hh, before any bias."""
    lstm = torch.nn.LSTM(3, 5, num_layers=2, proj_size=2, bidirectional=True).double()
    flat = cudnn_core.canonical_params(lstm._flat_weights, 4)
    w = lstm._flat_weights
    per = 5
    mats = [t.reshape(-1) for p in range(4) for t in (w[p * per], w[p * per + 1], w[p * per + 4])]
    biases = [t.reshape(-1) for p in range(4) for t in (w[p * per + 2], w[p * per + 3])]
    assert torch.equal(flat, torch.cat(mats + biases))
    x = torch.randn(7, 2, 3, dtype=torch.float64)
    h0, c0 = torch.randn(4, 2, 2, dtype=torch.float64), torch.randn(4, 2, 5, dtype=torch.float64)
    y_ref, (h_ref, c_ref) = lstm(x, (h0, c0))
    y, h, c = numpy_cudnn_rnn(x.numpy(), h0.numpy(), c0.numpy(), flat.detach().numpy(), [7, 7],
                              "lstm", True)
    for got, want in ((y, y_ref), (h, h_ref), (c, c_ref)):
        assert np.abs(got - want.detach().numpy()).max() <= 1e-12


def test_canonical_params_refuse_a_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="4 or 5 tensors per pseudo-layer"):
        cudnn_core.canonical_params([torch.zeros(1)] * 6, 2)


def _pack_case(kind, bidirectional, merge, use_bias, proj):
    """Three levels of `kind` (projected LSTMs where `proj`), built and
    randomized, as a StackSpec."""
    from rnnfuse.layers import ProjectedLSTM
    from rnnfuse.recurrent import describe, input_merges

    layers = []
    for _ in range(3):
        layer = (ProjectedLSTM(6, proj, return_sequences=True, use_bias=use_bias) if proj
                 else rnn_layer(kind, 4, return_sequences=True, use_bias=use_bias))
        layers.append(L.Bidirectional(layer, merge_mode=merge) if bidirectional else layer)
    y = keras.ops.convert_to_tensor(np.zeros((2, 5, 7), "float32"))
    for layer in layers:
        y = layer(y)
    rng = np.random.default_rng(3)
    for layer in layers:
        for w in layer.weights:
            w.assign(rng.uniform(-0.5, 0.5, w.shape).astype("float32"))
    views = [describe(layer) for layer in layers]
    spec = StackSpec(views[0].kind, views[0].units, tuple(lv for v in views for lv in v.levels),
                     proj_size=views[0].proj_size, input_merges=input_merges(views))
    return spec, [v.value for layer in layers for v in layer.trainable_weights]


@pytest.mark.parametrize("kind, bidirectional, merge, use_bias, proj", [
    ("lstm", False, "concat", True, 0), ("gru", False, "concat", True, 0),
    ("rnn_tanh", False, "concat", False, 0), ("gru", True, "concat", False, 0),
    ("lstm", True, "sum", True, 0), ("gru", True, "ave", True, 0), ("lstm", True, "concat", True, 3),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_canonical_is_canonical_params_of_pack_params(kind, bidirectional, merge, use_bias,
                                                          proj, dtype):
    """The core's buffer built in a few copies holds the same values, for
    every slice of levels a call may take, and gives every variable the
    same gradient (a doubled input kernel's halves summed in `dtype`)."""
    spec, variables = _pack_case(kind, bidirectional, merge, use_bias, proj)
    dirs = spec.num_directions
    for first, levels in [(0, 3), (0, 1), (1, 2), (2, 1)]:
        weights = torch_backend.pack_params(spec, dtype, "cpu")
        per = len(weights) // spec.num_pseudo_layers
        want = cudnn_core.canonical_params(
            weights[first * dirs * per:(first + levels) * dirs * per], levels * dirs)
        got = torch_backend.pack_canonical(spec, dtype, "cpu", first, levels)
        assert got.dtype == want.dtype and torch.equal(got, want)
        probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(first)).to(dtype)
        grads = [torch.autograd.grad((flat * probe).sum(), variables, allow_unused=True)
                 for flat in (want, got)]
        for a, b in zip(*grads):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_pack_canonical_gathers_once_and_reads_new_weights(kind, monkeypatch):
    """A stack without a doubled input kernel packs in one gather whose
    index is built once per stack and slice; a later call reads the
    variables' new values (weights change every step), value for value."""
    spec, _ = _pack_case(kind, False, "concat", True, 0)
    built = []
    real = torch_backend._canonical_pieces
    monkeypatch.setattr(torch_backend, "_canonical_pieces",
                        lambda *args: (built.append(args[0]), real(*args))[1])
    first = torch_backend.pack_canonical(spec, torch.float32, "cpu", 1, 2)
    assert len(built) == 2  # the index: one pass over the two levels' cells
    for cell in spec.cells[1][0], spec.cells[2][0]:
        cell.kernel.assign(cell.kernel.numpy() + 1.0)
    again = torch_backend.pack_canonical(spec, torch.float32, "cpu", 1, 2)
    assert len(built) == 2  # reused
    weights = torch_backend.pack_params(spec, torch.float32, "cpu")
    per = len(weights) // spec.num_pseudo_layers
    want = cudnn_core.canonical_params(weights[per:3 * per], 2)
    assert torch.equal(again, want) and not torch.equal(first, want)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_core_call_packs_its_weights_in_its_own_autograd_node(kind, core):
    """Where the weights are in the call's dtype, the core's autograd node
    packs them itself: one node, and the outputs and gradients of a call
    on `pack_canonical`'s buffer, value for value."""
    spec, variables = _pack_case(kind, False, "concat", True, 0)
    packing = torch_backend._core_params(spec, torch.float32, torch.device("cpu"), 0, 3)
    assert isinstance(packing, torch_backend._Packing)
    x = torch.randn(5, 2, 7, generator=torch.Generator().manual_seed(0))
    h = torch.zeros(3, 2, 4)
    c = h if kind == "lstm" else None
    runs = []
    for params in (packing, torch_backend.pack_canonical(spec, torch.float32, "cpu")):
        y, hy, _ = cudnn_core.run(x, kind, 3, 4, params, h, c, training=True)
        runs.append((y, torch.autograd.grad((y * y).sum() + hy.sum(), variables), y.grad_fn))
    (y, grads, node), (y_ref, grads_ref, _) = runs
    assert {type(f).__name__ for f, _ in node.next_functions if f} == {"AccumulateGrad"}
    assert torch.equal(y, y_ref) and all(map(torch.equal, grads, grads_ref))


# -- the fused call on the (emulated) core ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_stacks_run_on_the_core_with_their_gradients(kind, bidirectional, core):
    model = _stack(kind, bidirectional)
    randomize(model, 3, 0.5 if kind in ("lstm", "gru") else 0.2)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = np.random.default_rng(4).standard_normal((4, 9, 5)).astype("float32")
    _compare(model, fast, inputs)
    ran = _ran(fast)
    # A 6-unit state runs cuDNN's small-h algorithm, as PyTorch's calls do.
    assert (ran.name, ran.algorithm) == (cudnn_core.KERNEL_NAME, "persistent_static_small_h")
    assert "small-h" in ran.note
    forward = [c for c in core if c["pass_"] == "forward"]
    assert [c["pass_"] for c in core] == ["forward", "backward"]
    assert forward[0] | {"pass_": None} == dict(
        pass_=None, kind=kind, layers=3, units=6, proj=0, input_size=5,
        directions=2 if bidirectional else 1, algorithm=15, tf32=False, dropout=0.0, seed=0,
        training=True)
    with torch.no_grad():
        fast(inputs)
    assert core[-1]["training"] is False  # inference: no reserve space


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_masks_become_lengths_and_states_follow_them(kind, core):
    model, fast, tokens = masked_stack_case(kind, units=6, input_size=5, steps=8, batch=4,
                                            seeds=(5, 6), first_row=3, last_return_state=True)
    _compare(model, fast, tokens)
    assert _ran(fast).name == cudnn_core.KERNEL_NAME
    assert core[0]["training"] is True


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_initial_states_go_backwards_and_return_state(kind, core):
    model, fast, inputs = initial_state_case(kind, units=6, input_size=5, steps=8, batch=4,
                                             seeds=(7, 8))
    o0, _ = _outputs_and_grads(model, inputs, model.trainable_variables)
    o1, _ = _outputs_and_grads(fast, inputs, model.trainable_variables)
    assert max(float((a - b).abs().max()) for a, b in zip(o0, o1)) <= 2e-5
    # The initial states' gradients reach the inputs through the core's dhx, dcx.
    tensors = [torch.as_tensor(t, dtype=torch.float32).requires_grad_(True) for t in inputs]
    grads = []
    for m in (model, fast):
        out = keras.tree.flatten(m(tensors))
        grads.append(torch.autograd.grad(sum((t.double() ** 2).sum() for t in out), tensors))
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) <= 2e-4


def test_algorithm_codes():
    assert cudnn_core.algorithm_code(None, torch.float32, allow_tf32=True) == 0
    assert cudnn_core.algorithm_code(None, torch.float32, allow_tf32=False) == 3  # fma
    assert cudnn_core.algorithm_code(None, torch.bfloat16, allow_tf32=False) == 1
    persistent = Algorithm.parse("persistent_dynamic+tc")
    assert cudnn_core.algorithm_code(persistent, torch.float16, True) == 9
    assert cudnn_core.algorithm_code(persistent, torch.float32, False) == 11


def test_the_plans_algorithm_reaches_both_passes(core):
    model = _stack("lstm", False)
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_static+tc"))
    _outputs_and_grads(fast, np.ones((2, 9, 5), "float32"), model.trainable_variables)
    assert core[0]["algorithm"] == 4 * 1 + 3  # float32, TF32 off: persistent static with FMA
    assert _ran(fast).algorithm == "persistent_static+tc"


def test_a_masked_call_runs_the_standard_algorithm(core):
    model = stack_model("lstm", 2, units=6, input_size=5, steps=8, masked=True)
    fast = rnnfuse.optimize(model, plan=Plan((2,), "persistent_static+tc"))
    tokens = random_inputs(model, 4, np.random.default_rng(9), padding="right")
    tokens[1, 4:] = 0
    fast(tokens)
    ran = _ran(fast)
    assert core[-1]["algorithm"] == 3 and ran.algorithm == "standard"
    assert "masked call runs the standard algorithm" in ran.note


def test_an_algorithm_cudnn_refuses_runs_standard_with_the_reason(core, monkeypatch):
    forward = cudnn_core.core_forward

    def refuse_persistent(ints, *args):
        if ints[6] >= 4:
            raise CoreError("cuDNN call cudnnRNNForward failed: CUDNN_STATUS_NOT_SUPPORTED",
                            E_NOT_SUPPORTED)
        return forward(ints, *args)

    monkeypatch.setattr(cudnn_core, "core_forward", refuse_persistent)
    model = _stack("gru", False)
    fast = rnnfuse.optimize(model, plan=Plan((3,), "persistent_dynamic+tc"))
    inputs = np.random.default_rng(10).standard_normal((2, 9, 5)).astype("float32")
    _compare(model, fast, inputs)
    ran = _ran(fast)
    assert ran.name == cudnn_core.KERNEL_NAME and ran.algorithm == "standard"
    assert "cuDNN refused persistent_dynamic+tc" in ran.note and "NOT_SUPPORTED" in ran.note


@pytest.mark.parametrize("failure, expected", [
    ("reason", "the cuDNN core is not available: no libcudnn.so.9"),
    ("refusal", "the cuDNN core refused this call (cuDNN call cudnnRNNForward failed"),
])
def test_where_the_core_cannot_run_torch_vf_runs_with_the_reason(failure, expected, core,
                                                                 monkeypatch, torch_calls):
    if failure == "reason":
        monkeypatch.setattr(cudnn_core, "core_reason",
                            lambda x: "the cuDNN core is not available: no libcudnn.so.9")
    else:
        def refuse(*args):
            raise CoreError("cuDNN call cudnnRNNForward failed: CUDNN_STATUS_BAD_PARAM", E_CUDNN)

        monkeypatch.setattr(cudnn_core, "core_forward", refuse)
    model = _stack("lstm", True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    inputs = np.random.default_rng(11).standard_normal((2, 9, 5)).astype("float32")
    _compare(model, fast, inputs)
    ran = _ran(fast)
    assert ran.name == "torch._VF.lstm" and expected in ran.note, ran
    assert "torch._VF runs it" in ran.note
    assert len(torch_calls) == 1 and not core


def test_on_the_cpu_torch_vf_runs_without_a_note(torch_calls):
    model = _stack("gru", False)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast(np.zeros((2, 9, 5), "float32"))
    ran = _ran(fast)
    assert (ran.name, ran.note) == ("torch._VF.gru", None) and len(torch_calls) == 1


def test_float64_is_refused_by_the_core_with_its_dtype():
    assert "not float64" in cudnn_core.core_reason(torch.zeros(1, dtype=torch.float64))


def test_between_layer_dropout_is_the_cores_with_the_layers_seed(core):
    model = lstm_dropout_lstm(6, 0.25, 9, 5, seed=5)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert len(fused_layers(fast)) == 1
    fast(np.ones((2, 9, 5), "float32"), training=True)
    call = core[-1]
    assert call["dropout"] == pytest.approx(0.25) and call["training"] is True
    assert call["seed"] != 0  # the Dropout layer's seed reaches cuDNN's states
    fast(np.ones((2, 9, 5), "float32"), training=False)
    assert core[-1]["dropout"] == 0.0


def test_exact_float32_loops_turn_tf32_off_on_the_core(core, monkeypatch):
    """A SimpleRNN stack (Keras' exact float32 loop) runs without TF32 even
    where cuDNN's TF32 is allowed; an LSTM stack follows the flag."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch_backend, "needs_exact_float32",
                        lambda stack, x, mask: stack.keras_loop)
    for kind, tf32 in (("rnn_tanh", False), ("lstm", True)):
        fast = rnnfuse.optimize(_stack(kind, False), plan=rnnfuse.FUSED)
        fast(np.ones((2, 9, 5), "float32"))
        assert core[-1]["tf32"] is tf32, kind
        assert core[-1]["algorithm"] == (12 if tf32 else 15)  # small-h, default or FMA


def test_pytorchs_persistent_single_level_calls_run_persistent_on_the_core(core, monkeypatch):
    """Without a plan algorithm, the calls PyTorch would run one level at a
    time on its persistent kernel run that way on the core."""
    monkeypatch.setattr(torch_backend, "levels_per_call", lambda stack, x, packed: 1)
    monkeypatch.setattr(torch_backend, "prefers_small_h", lambda *args: False)  # a wide state
    model = _stack("lstm", False)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    _compare(model, fast, np.random.default_rng(12).standard_normal((2, 9, 5)).astype("float32"))
    forwards = [c for c in core if c["pass_"] == "forward"]
    assert [c["layers"] for c in forwards] == [1, 1, 1]
    assert [c["input_size"] for c in forwards] == [5, 6, 6]
    assert all(c["algorithm"] == 7 for c in forwards)  # persistent static, FMA (float32)
    ran = _ran(fast)
    assert ran.algorithm == "persistent_static+tc" and "3 calls of 1 level(s)" in ran.note


def test_an_inference_forward_has_no_gradient():
    x = torch.zeros(3, 2, 4, requires_grad=True)
    fn = cudnn_core._backward
    ctx = type("Ctx", (), {})()
    ctx.saved_tensors = (x, x, x, x, x, x)
    ctx.lengths = ctx.dev_lengths = None
    ctx.args = ([0, 1, 4, 0, 4, 1, 0, 0], 0.0, 0, False)
    with pytest.raises(RuntimeError, match="ran this call's forward for inference"):
        fn(ctx, None, None, None, None)


def test_tuned_algorithms_are_tensorflows_where_the_core_loads(monkeypatch):
    from rnnfuse.backends import get_backend
    from rnnfuse.backends.cuda import cudnn_core as library

    assert get_backend().capabilities.tuned_algorithms == (None,)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(library, "load_failure", lambda: None)
    assert get_backend().capabilities.tuned_algorithms == (
        None, "persistent_static+tc", "persistent_dynamic+tc")
    monkeypatch.setattr(library, "load_failure", lambda: "no cuDNN")
    assert get_backend().capabilities.tuned_algorithms == (None,)


def test_inspect_names_the_kernel_a_fused_call_reaches(monkeypatch):
    from rnnfuse.backends.torch.backend import TorchBackend

    backend = TorchBackend()
    assert backend.fused_call_kernel(rnnfuse.FUSED) is None  # the CPU: PyTorch's kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudnn_core, "core_reason", lambda x: None)
    assert backend.fused_call_kernel(rnnfuse.FUSED) == "rnnfuse's cuDNN core"
    monkeypatch.setattr(cudnn_core, "core_reason",
                        lambda x: "the cuDNN core is not available: no g++")
    assert backend.fused_call_kernel(rnnfuse.FUSED) == (
        "torch._VF (the cuDNN core is not available: no g++)")
    from rnnfuse.placement import placement

    assert placement(rnnfuse.FUSED).how == (
        "one fused call on torch._VF (the cuDNN core is not available: no g++)")


@pytest.mark.parametrize("bidirectional", [False, True])
def test_projected_lstm_stacks_and_layers_run_the_cores_projection(bidirectional, core):
    """An optimized ProjectedLSTM stack is one core call with proj_size; a
    lone ProjectedLSTM layer's fast path reaches the core too. Both match
    Keras' generic loop (`fast_path("off")`)."""
    from rnnfuse.layers.projected_lstm import fast_path

    model = projected_stack(2, 7, 3, 6, 5, bidirectional=bidirectional)
    randomize(model, 13, 0.6)
    inputs = np.random.default_rng(14).standard_normal((3, 6, 5)).astype("float32")
    with fast_path("off"):
        o0, g0 = _outputs_and_grads(model, inputs, model.trainable_variables)
    assert not core
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    o1, g1 = _outputs_and_grads(fast, inputs, model.trainable_variables)
    assert max(float((a - b).detach().abs().max()) for a, b in zip(o0, o1)) <= 2e-5
    assert max(float((a - b).abs().max()) for a, b in zip(g0, g1)) <= 2e-4
    assert core[0]["proj"] == 3 and core[0]["layers"] == 2 and core[1]["pass_"] == "backward"
    assert _ran(fast).name == cudnn_core.KERNEL_NAME
    o2, g2 = _outputs_and_grads(model, inputs, model.trainable_variables)  # layers' own path
    assert max(float((a - b).detach().abs().max()) for a, b in zip(o0, o2)) <= 2e-5
    assert max(float((a - b).abs().max()) for a, b in zip(g0, g2)) <= 2e-4
    dirs = 2 if bidirectional else 1  # each layer, each direction: one call of its own
    assert [c["layers"] for c in core[2:] if c["pass_"] == "forward"] == [1] * (2 * dirs)


def test_the_tuner_times_the_cores_algorithms_and_leaves_out_a_refused_one(core, monkeypatch):
    """With the core, the torch tuner's candidates are TensorFlow's (each
    algorithm whole and split) plus one call per layer; a candidate whose
    algorithm cuDNN refuses (the call then runs standard) is not timed
    under its name."""
    from rnnfuse.passes import build_layer_graph, plan_fusion
    from rnnfuse.tuning.tuner import tune_plans

    monkeypatch.setattr(torch_backend, "tuned_algorithms",
                        lambda: torch_backend.CORE_TUNED_ALGORITHMS)
    forward = cudnn_core.core_forward

    def refuse_dynamic(ints, *args):
        if ints[6] // 4 == 2:
            raise CoreError("cudnnBuildRNNDynamic failed: CUDNN_STATUS_NOT_SUPPORTED",
                            E_NOT_SUPPORTED)
        return forward(ints, *args)

    monkeypatch.setattr(cudnn_core, "core_forward", refuse_dynamic)
    model = stack_model("lstm", 4, units=8, input_size=4, steps=6)
    timed = []

    def timer(steps):
        timed.append(sorted(steps))
        return {name: {"median": 1.0} for name in steps}

    groups = plan_fusion(build_layer_graph(model), model_name=model.name).groups
    tune_plans(groups, lambda g: (4, 6, g.input_size), measure=timer, progress=False)
    names = set().union(*timed)
    for algorithm in (None, "persistent_static+tc"):
        for pieces in ((4,), (2, 2), (1, 1, 1, 1)):
            assert Plan(pieces, algorithm).name in names, (pieces, algorithm, names)
    assert not any("persistent_dynamic" in n for n in names), names
    assert "per-layer" in names


def test_the_environment_turns_the_core_off_or_names_its_library(monkeypatch, tmp_path):
    from rnnfuse.backends.cuda import cudnn_core as library

    monkeypatch.setenv("RNNFUSE_DISABLE_CORE", "1")
    assert "turned off (RNNFUSE_DISABLE_CORE)" in cudnn_core.core_reason(torch.zeros(1))
    monkeypatch.setenv("RNNFUSE_DISABLE_CORE", "0")
    missing = tmp_path / "librnnfuse_cudnn_core.so"
    monkeypatch.setenv("RNNFUSE_CUDNN_CORE_LIB", str(missing))
    reason = cudnn_core.core_reason(torch.zeros(1))
    assert reason.startswith("the cuDNN core is not available:") and str(missing) in reason


def test_unmasked_calls_share_one_lengths_tensor_of_full_lengths(monkeypatch):
    """An unmasked call allocates and fills no lengths of its own: calls of
    one shape get the same tensor, holding every sequence's full length."""
    seen = []

    def record(ints, dropout, seed, training, x, hx, cx, params, lengths, dev_lengths):
        seen.append(dev_lengths)
        return x.new_zeros((x.shape[0], x.shape[1], ints[2])), hx.clone(), cx.clone(), \
            torch.empty(0, dtype=torch.uint8)

    monkeypatch.setattr(cudnn_core, "core_forward", record)
    params = torch.zeros(4 * 3 * (2 + 3) + 8 * 3)
    for batch in (2, 2, 5):
        x, h = torch.zeros(7, batch, 2), torch.zeros(1, batch, 3)
        cudnn_core.run(x, "lstm", 1, 3, params, h, h)
    assert seen[0] is seen[1] and seen[2] is not seen[0]
    assert seen[0].tolist() == [7, 7] and seen[2].tolist() == [7] * 5
    assert seen[0].dtype == torch.int32


def test_an_eager_call_skips_the_custom_ops_dispatch_and_a_fake_one_takes_it(core):
    """Plain tensors run the core's functions through an autograd.Function
    (same gradients as the custom op's formula); fake tensors (a trace)
    take the registered custom op and its fake kernel, never the core."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    x = torch.randn(5, 2, 3, requires_grad=True)
    h = torch.zeros(1, 2, 4)
    params = torch.randn(4 * 4 * (3 + 4) + 8 * 4, requires_grad=True)
    y, _, _ = cudnn_core.run(x, "lstm", 1, 4, params, h, h, training=True)
    assert type(y.grad_fn).__name__ == "_EagerCallBackward"
    eager = torch.autograd.grad(y.sum(), [x, params])
    with torch.no_grad():
        inputs = (x.contiguous(), h, h, params, None, torch.full((2,), 5, dtype=torch.int32),
                  cudnn_core.CoreCall("lstm", 1, 4, 3).ints, 0.0, 0, True)
    y_op = cudnn_core._rnn_op(*inputs[:4], *inputs[4:])
    assert torch.equal(y_op[0], y.detach())
    x2, p2 = x.detach().requires_grad_(True), params.detach().requires_grad_(True)
    y2 = cudnn_core._rnn_op(x2, h, h, p2, *inputs[4:])[0]
    for a, b in zip(eager, torch.autograd.grad(y2.sum(), [x2, p2])):
        assert torch.equal(a, b)
    core.clear()
    plain = [x.detach(), params.detach(), h]
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:  # the reserve's size is dynamic
        fx, fp, fh = (mode.from_tensor(t) for t in plain)
        y_fake, _, _ = cudnn_core.run(fx, "lstm", 1, 4, fp, fh, fh)
    assert tuple(y_fake.shape) == (5, 2, 4) and core == []


def test_zero_initial_states_are_made_once_and_stay_zero(core):
    """A fused call without initial states reads zeros made once per shape
    (the core only reads them): training steps leave them zero, and a call
    gives what a call with explicit zero states gives."""
    model = _stack("lstm", False)
    randomize(model, 3, 0.5)
    layer = fused_layers(rnnfuse.optimize(model, plan=rnnfuse.FUSED))[0]
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((4, 9, 5)).astype("float32"))
    torch_backend._ZERO_STATES.clear()
    for _ in range(2):
        layer(x, training=True).sum().backward()
    assert len(torch_backend._ZERO_STATES) == 1  # h and c: both [3, 4, 6]
    assert all(not bool(t.any()) for t in torch_backend._ZERO_STATES.values())
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x, initial_state=[torch.zeros(4, 6)] * 2))
