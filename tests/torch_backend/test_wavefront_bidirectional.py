"""Bidirectional layers on rnnfuse's wavefront kernel (torch binding), on the
CPU: the host's index arithmetic and the wiring, with the launch faked.

The custom op `torch.ops.rnnfuse.wavefront_directions`' Python entry
(`wavefront_bidirectional._directions_op`) becomes `FakeDirections.op`,
which does what the kernel does with independent layers (wavefront.cuh,
"Independent layers"): direction d reads its own xproj slice [d] as given
(no W_ih: the host projected it), its W_hh and biases at the offsets of
the kernel's independent layout (`independent_offsets`, which
tests/test_wavefront_build.py checks against the C++ PlanOffsets), its
own h0, c0 slice, and runs forward in time over each row's length, in
float64 (`wavefront.reference_forward`). Everything else is the real
code: the one matmul for both directions' projections, the reversal of
direction 1 within each length before and after the launch, the layer's
canonical buffer, the concatenation, the states' order, the fallbacks
and the Keras wiring; compared with PyTorch's own bidirectional
nn.LSTM/nn.GRU in float64 (packed sequences for lengths) and with the
original Keras layers. The training form (each direction a one-layer
`wavefront.trainable_forward`) runs the unidirectional tests' torch
stand-ins of the training kernels and is compared with autograd through
PyTorch's bidirectional RNN.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import rnnfuse
from builders import (bidirectional_stack, fused_with_plan, max_abs_diff, wavefront_inputs,
                      wavefront_mask)
from rnnfuse.backends.cuda import library
from rnnfuse.backends.torch import streams, wavefront, wavefront_bidirectional as bidir
from rnnfuse.plan import FUSED, Plan
from torch_checks import module_run, planned_then_original

WAVEFRONT = Plan((2,), kernel="wavefront")
FP16_TOL = 5e-3


def independent_offsets(kind, directions, units, input_size):
    """The kernel's weight offsets for independent layers (PlanOffsets with
    `independent`): every direction's [W_ih (G*H x input_size), W_hh
    (G*H x H)], then every direction's [b_in, b_rec]."""
    gh = (4 if kind == "lstm" else 3) * units
    out, w = [], 0
    for _ in range(directions):
        out.append({"w_ih": w, "w_hh": w + gh * input_size})
        w += gh * input_size + gh * units
    for d in range(directions):
        out[d].update(b_in=w + 2 * gh * d, b_rec=w + 2 * gh * d + gh)
    return out


class FakeDirections:
    """The launch, faked (see the module doc); records each call."""

    def __init__(self):
        self.calls = []

    def op(self, xproj, params, h0, c0, lengths, kind, input_size):
        directions, steps, batch, gh = xproj.shape
        units = gh // (4 if kind == "lstm" else 3)
        self.calls.append(dict(kind=kind, steps=steps, batch=batch, input_size=input_size,
                               lengths=lengths.numel(), grad=torch.is_grad_enabled()))
        assert params.numel() == directions * (gh * (input_size + units) + 2 * gh)
        ys, hys, cys = [], [], []
        for d, off in enumerate(independent_offsets(kind, directions, units, input_size)):
            w_hh = params[off["w_hh"]:off["w_hh"] + gh * units].view(gh, units)
            b_in = params[off["b_in"]:off["b_in"] + gh]
            b_rec = params[off["b_rec"]:off["b_rec"] + gh]
            eye = torch.eye(gh, dtype=xproj.dtype)  # xproj arrives projected
            c = c0[d:d + 1] if kind == "lstm" else None
            with torch.no_grad():
                y, hy, cy = wavefront.reference_forward(
                    kind, [eye, w_hh, b_in, b_rec], xproj[d], h0[d:d + 1], c,
                    lengths if lengths.numel() else None)
            ys.append(y)
            hys.append(hy[0])
            cys.append(cy[0] if kind == "lstm" else None)
        cy = torch.stack(cys).to(xproj.dtype) if kind == "lstm" else h0.new_empty((0,))
        return torch.stack(ys).to(xproj.dtype), torch.stack(hys).to(xproj.dtype), cy


@pytest.fixture
def fake_op(monkeypatch):
    fake = FakeDirections()
    monkeypatch.setattr(bidir, "_directions_op", fake.op)
    return fake


# -- the host's arithmetic against PyTorch's bidirectional RNNs ------------------------


@pytest.mark.parametrize("lengths", [None, [7, 5, 1, 6]])
def test_reversal_within_lengths_is_its_own_inverse_and_keeps_the_padding(lengths):
    x = torch.randn(7, 4, 3, dtype=torch.float64)
    lens = None if lengths is None else torch.tensor(lengths)
    once = bidir.reverse_within_lengths(x, lens)
    assert torch.equal(bidir.reverse_within_lengths(once, lens), x)
    for b, n in enumerate(lengths or [7] * 4):
        assert torch.equal(once[:n, b], x[:n, b].flip(0))
        assert torch.equal(once[n:, b], x[n:, b])


def _torch_rnn(kind, layers, units, inputs, seed):
    torch.manual_seed(seed)
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    return cls(inputs, units, layers, bidirectional=True).double()


def _cudnn_semantics(mod, kind, x, h0, c0, lengths):
    with torch.no_grad():
        return module_run(mod, kind, x, h0, c0, lengths)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("lengths", [None, [9, 4, 1, 7, 9]])
@pytest.mark.parametrize("layers", [1, 3])
def test_a_stack_matches_pytorchs_bidirectional_rnn(fake_op, kind, lengths, layers):
    units, inputs, steps, batch = 6, 5, 9, 5
    mod = _torch_rnn(kind, layers, units, inputs, seed=layers)
    x = torch.randn(steps, batch, inputs, dtype=torch.float64)
    h0 = torch.randn(2 * layers, batch, units, dtype=torch.float64)
    c0 = torch.randn(2 * layers, batch, units, dtype=torch.float64) if kind == "lstm" else None
    lens = None if lengths is None else torch.tensor(lengths)
    y, hy, cy = bidir.forward(x, mod._flat_weights, h0, c0, lens, kind=kind)
    want_y, want_hy, want_cy = _cudnn_semantics(mod, kind, x, h0, c0, lens)
    assert len(fake_op.calls) == layers, "one launch a layer"
    assert [c["input_size"] for c in fake_op.calls] == [inputs] + [2 * units] * (layers - 1)
    assert y.shape == (steps, batch, 2 * units) and hy.shape == (2 * layers, batch, units)
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(hy, want_hy, rtol=0, atol=1e-12)
    if kind == "lstm":
        torch.testing.assert_close(cy, want_cy, rtol=0, atol=1e-12)
    else:
        assert cy is None


def test_the_layers_buffer_is_the_kernels_independent_layout():
    """The buffer `forward` hands each launch is `flat_params` of the
    layer's eight tensors: each direction's matrices where the kernel's
    independent offsets say, W_ih of input_size columns for both."""
    mod = _torch_rnn("lstm", 2, 8, 5, seed=0)
    w = list(mod._flat_weights)
    for l, inputs in ((0, 5), (1, 16)):
        flat = wavefront.flat_params(w[8 * l:8 * l + 8])
        for d, off in enumerate(independent_offsets("lstm", 2, 8, inputs)):
            w_ih, w_hh, b_ih, b_hh = w[8 * l + 4 * d:8 * l + 4 * d + 4]
            assert torch.equal(flat[off["w_ih"]:off["w_ih"] + w_ih.numel()], w_ih.reshape(-1))
            assert torch.equal(flat[off["w_hh"]:off["w_hh"] + w_hh.numel()], w_hh.reshape(-1))
            assert torch.equal(flat[off["b_in"]:off["b_in"] + 32], b_ih)
            assert torch.equal(flat[off["b_rec"]:off["b_rec"] + 32], b_hh)


class FakeSide:
    """`streams.SideStream` on the CPU: logs its calls and whether work runs
    on the side (the training stand-ins log their launches here)."""

    def __init__(self):
        self.log, self.active = [], False

    def fork(self, *inputs):
        self.log.append(("fork", inputs))

    @contextlib.contextmanager
    def running(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False
        self.log.append(("back",))

    def join(self, *outputs):
        self.log.append(("join", outputs))


@pytest.fixture
def fake_side(monkeypatch):
    side = FakeSide()
    monkeypatch.setattr(streams, "side_stream", lambda device: side)
    return side


@pytest.fixture
def fake_training(monkeypatch, fake_side):
    """The one-layer training kernels as their torch versions (the
    unidirectional tests' stand-ins), counted, each logged on `fake_side`
    with the stream it launches on."""
    calls = {"saving": 0, "recurrence": 0}

    def saving(*args, **kwargs):
        calls["saving"] += 1
        fake_side.log.append(("saving", "side" if fake_side.active else "current"))
        return wavefront.reference_forward_saving(*args, **kwargs)

    def recurrence(*args, **kwargs):
        calls["recurrence"] += 1
        return wavefront.recurrence_reference(*args, **kwargs)

    monkeypatch.setattr(wavefront, "forward_training", saving)
    monkeypatch.setattr(wavefront, "backward_layer", recurrence)
    return calls


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("lengths", [None, [6, 3, 1, 6]])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("concurrent", [False, True])
def test_the_training_form_has_pytorchs_bidirectional_gradients(fake_training, fake_side, kind,
                                                                 lengths, layers, concurrent):
    """Each direction a one-layer trainable_forward (direction 1 over the
    reversed input), one after the other or with the (fake) side stream:
    outputs, final states and every gradient (x, h0, c0, each weight) equal
    autograd through PyTorch's bidirectional RNN."""
    units, inputs, steps, batch = 5, 4, 6, 4
    mod = _torch_rnn(kind, layers, units, inputs, seed=10 + layers)
    rng = torch.Generator().manual_seed(layers)
    x = torch.randn(steps, batch, inputs, dtype=torch.float64, generator=rng)
    h0 = torch.randn(2 * layers, batch, units, dtype=torch.float64, generator=rng)
    c0 = torch.randn(2 * layers, batch, units, dtype=torch.float64, generator=rng)
    lens = None if lengths is None else torch.tensor(lengths)
    gy = torch.randn(steps, batch, 2 * units, dtype=torch.float64, generator=rng)
    gh = torch.randn(2 * layers, batch, units, dtype=torch.float64, generator=rng)
    alive = (torch.arange(steps)[:, None] < (lens if lens is not None else steps))[..., None]

    def grads(run):
        leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
        weights = [w.detach().clone().requires_grad_() for w in mod._flat_weights]
        y, hy, cy = run(leaves, weights)
        loss = (y * gy * alive).sum() + (hy * gh).sum() + (0 if cy is None else (cy * gh).sum())
        wanted = leaves if kind == "lstm" else leaves[:2]
        return [y, hy] + list(torch.autograd.grad(loss, wanted + weights))

    def ours(leaves, weights):
        return bidir.trainable_forward(leaves[0], weights, leaves[1],
                                       leaves[2] if kind == "lstm" else None, lens, kind=kind,
                                       concurrent=concurrent)

    def pytorchs(leaves, weights):
        ref = _torch_rnn(kind, layers, units, inputs, seed=0)
        ref._flat_weights = weights  # autograd through these very tensors
        y, hy, cy = module_run(ref, kind, leaves[0], leaves[1], leaves[2], lens)
        return y, hy, cy

    got, want = grads(ours), grads(pytorchs)
    assert fake_training["saving"] == 2 * layers and fake_training["recurrence"] == 2 * layers
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    assert [e[0] for e in fake_side.log].count("fork") == (layers if concurrent else 0)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("lengths", [None, [6, 3, 1, 6]])
def test_the_concurrent_form_runs_direction_1_on_the_side_stream(fake_training, fake_side,
                                                                 kind, lengths):
    """Per layer: the side waits for the layer's input, h0, c0, lengths and
    direction 1's weights; direction 1's saving forward runs on the side
    (where autograd then runs its backward), direction 0's on the current
    stream after it is queued; then the current stream waits for direction
    1's outputs, which are the returned ones. The results equal the
    sequential form's bit for bit."""
    layers, units, inputs, steps, batch = 2, 5, 4, 6, 4
    mod = _torch_rnn(kind, layers, units, inputs, seed=3)
    rng = torch.Generator().manual_seed(5)
    x = torch.randn(steps, batch, inputs, dtype=torch.float64, generator=rng)
    h0 = torch.randn(2 * layers, batch, units, dtype=torch.float64, generator=rng)
    c0 = torch.randn(2 * layers, batch, units, dtype=torch.float64, generator=rng) \
        if kind == "lstm" else None
    lens = None if lengths is None else torch.tensor(lengths)
    leaves = [t.requires_grad_() for t in (x, h0, c0) if t is not None]
    weights = [w.detach().clone().requires_grad_() for w in mod._flat_weights]

    def run(concurrent):
        fake_side.log.clear()
        out = bidir.trainable_forward(x, weights, h0, c0, lens, kind=kind,
                                      concurrent=concurrent)
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)).sum()
                   for t in out if t is not None)
        return out, torch.autograd.grad(loss, leaves + weights), list(fake_side.log)

    (y, hy, cy), grads, log = run(True)
    (y_s, hy_s, cy_s), grads_s, log_s = run(False)
    assert log_s == [("saving", "current")] * 2 * layers
    assert [e[0] if e[0] != "saving" else e for e in log] == [
        "fork", ("saving", "side"), "back", ("saving", "current"), "join"] * layers
    forks, joins = [e[1] for e in log if e[0] == "fork"], [e[1] for e in log if e[0] == "join"]
    assert forks[0][0] is x and forks[0][1] is h0 and forks[0][2] is c0
    assert forks[0][3] is lens
    for l in range(layers):
        assert all(a is b for a, b in zip(forks[l][4:], weights[8 * l + 4:8 * l + 8]))
        assert len(forks[l]) == 8
        joined_y, joined_hy, joined_cy = joins[l]
        assert torch.equal(joined_hy[0], hy[2 * l + 1])
        if kind == "lstm":
            assert torch.equal(joined_cy[0], cy[2 * l + 1])
    assert torch.equal(joins[-1][0], y[..., units:])
    assert all(torch.equal(a, b) for a, b in zip((y, hy), (y_s, hy_s)))
    assert cy is None if kind == "gru" else torch.equal(cy, cy_s)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_s))


def test_the_side_stream_is_cuda_only_and_orders_both_ways(monkeypatch):
    """`streams.side_stream` gives no side off CUDA or in a trace (the
    directions then run one after the other); `SideStream.fork` makes the side wait for the
    current stream and keeps its inputs from reuse until the side's work is
    done, `join` the other way round."""
    assert streams.side_stream(torch.device("cpu")) is None
    monkeypatch.setattr(streams, "SideStream", lambda device: "side")
    assert streams.side_stream(torch.device("cuda", 0)) == "side"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert streams.side_stream(torch.device("cuda", 0)) is None, "a trace runs one stream"
    monkeypatch.undo()
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "waits for", other.name))

    class Tensor:
        def __init__(self, name):
            self.name = name

        def record_stream(self, stream):
            log.append((self.name, "used on", stream.name))

    side = streams.SideStream.__new__(streams.SideStream)
    side.current, side.side = Stream("current"), Stream("side")
    side.fork(Tensor("x"), None, Tensor("w"))
    side.join(Tensor("y"), None)
    assert log == [("side", "waits for", "current"), ("x", "used on", "side"),
                   ("w", "used on", "side"), ("current", "waits for", "side"),
                   ("y", "used on", "current")]


def test_weights_that_are_not_a_layers_eight_tensors_are_a_clear_error():
    mod = _torch_rnn("lstm", 1, 4, 3, seed=0)
    with pytest.raises(ValueError, match="received 4 tensors"):
        bidir.forward(torch.zeros(2, 1, 3), mod._flat_weights[:4], None, None, None, kind="lstm")


# -- the Keras wiring ---------------------------------------------------------------


@pytest.fixture
def enabled(monkeypatch, fake_op):
    """The switch on and the device check faked (the dtype and structure
    checks stay): the path the GPU takes."""
    asked = []

    def reason(kind, num_layers, units, batch, steps, input_size, dtype, device, **structure):
        why = library.stack_reason(kind, str(dtype).replace("torch.", ""), **structure)
        asked.append((kind, num_layers, units, batch, steps, input_size))
        return why

    monkeypatch.setattr(bidir, "unsupported_reason", reason)
    monkeypatch.setattr(bidir, "training_reason", reason)
    fake_op.asked = asked
    return fake_op


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("merge_mode", ["concat", "sum", "ave"])
def test_an_inference_call_runs_one_launch_a_layer(enabled, half, kind, merge_mode):
    model = bidirectional_stack(kind, merge_mode)
    layer = fused_with_plan(model, WAVEFRONT)
    x = wavefront_inputs()
    with torch.no_grad():
        y = layer(x, training=False)
        ran = layer.last_path.kernel
        layer.set_plan(FUSED)
        cudnn = layer(x, training=False)
        original = model(x, training=False)
    assert ran.name == bidir.KERNEL_NAME and ran.note is None, layer.last_path
    assert [c["input_size"] for c in enabled.calls] == [5, 16]
    assert max_abs_diff(y, cudnn) <= 2e-3 and max_abs_diff(y, original) <= FP16_TOL


def test_a_masked_call_reverses_each_row_within_its_length(enabled, half):
    model = bidirectional_stack()
    layer = fused_with_plan(model, WAVEFRONT)
    x = wavefront_inputs()
    mask = wavefront_mask()
    y, ran, original = planned_then_original(layer, x, mask)
    assert ran.name == bidir.KERNEL_NAME and ran.note is None, layer.last_path
    assert [c["lengths"] for c in enabled.calls] == [4, 4]
    assert max_abs_diff(y, original) <= FP16_TOL


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_training_call_runs_a_launch_a_direction_with_the_kernels_gradient(
        enabled, fake_training, half, kind):
    model = bidirectional_stack(kind, "sum")
    layer = fused_with_plan(model, WAVEFRONT)
    x = wavefront_inputs()
    weights = torch.tensor(np.random.default_rng(3).standard_normal((4, 7, 8)),
                           dtype=torch.float32)

    def gradients():
        y = layer(x, training=True).float()
        return [g.double().numpy() for g in torch.autograd.grad(
            (y * weights).sum(), [v.value for v in layer.trainable_variables])]

    got = gradients()
    ran = layer.last_path.kernel
    assert ran.name == wavefront.TRAINING_KERNEL_NAME and ran.note is None, layer.last_path
    assert ran.algorithm == bidir.TRAINING_ALGORITHM
    assert enabled.calls == [], "the training form runs the one-layer kernels"
    assert fake_training == {"saving": 4, "recurrence": 4}
    layer.set_plan(Plan(()))
    want = gradients()
    for g, w in zip(got, want):
        assert np.max(np.abs(g - w)) <= FP16_TOL * max(1.0, np.max(np.abs(w)))
    assert all(np.max(np.abs(g)) > 0 for g in got)


def test_while_the_switch_is_off_cudnn_runs_with_the_reason(fake_op, half, monkeypatch):
    monkeypatch.setattr(library, "BIDIRECTIONAL", False)
    layer = fused_with_plan(bidirectional_stack(), WAVEFRONT)
    with torch.no_grad():
        layer(wavefront_inputs(), training=False)
    assert fake_op.calls == []
    assert "library.BIDIRECTIONAL" in layer.last_path.kernel.note


def test_the_tuner_times_a_bidirectional_stack_for_inference_and_training(
        enabled, fake_training, half):
    from rnnfuse.tuning.tuner import tune_plans

    class Timer:
        def __init__(self, medians):
            self.medians, self.names = medians, []

        def __call__(self, steps):
            self.names.append(sorted(steps))
            return {n: {"median": self.medians.get(n, 1.0)} for n in steps}

    groups = rnnfuse.analyze(bidirectional_stack()).groups
    timer = Timer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (result,) = tune_plans(groups, lambda g: (4, 7, 5), training=False, measure=timer,
                           progress=False)
    assert result.plan == WAVEFRONT and enabled.asked[0] == ("lstm", 2, 8, 4, 7, 5)
    trainer = Timer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.1})
    (trained,) = tune_plans(groups, lambda g: (4, 7, 5), training=True, measure=trainer,
                            progress=False)
    assert "fused on wavefront" in trainer.names[0]
    assert trained.plan == WAVEFRONT, trained.rejected  # after its gradient check
    assert fake_training["recurrence"] >= 4
