"""The training path of rnnfuse's wavefront kernel (torch), on the CPU.

The two kernels (the forward saving gates and c, the backward recurrence)
run on a Hopper GPU only (tests/gpu/test_gpu_wavefront_torch.py); here their
torch step-by-step versions (`reference_forward_saving`,
`recurrence_reference`, same inputs, outputs and layouts) stand in, in
float64, so everything around them is checked exactly: the saved tensors'
layout, the layer-by-layer backward's GEMMs (dx, dW_ih, dW_hh, both
biases), the lengths (no gradient at t >= length, the final states'
gradient entering at length - 1), the initial states, the autograd wiring
to the flat buffer and from `run_trainable` to the Keras variables, and
the refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch

from builders import answering, built_stack, spy_each
from rnnfuse.backends.base import StackCall
from rnnfuse.backends.torch import wavefront

TORCH_KERNELS = dict(saving=wavefront.reference_forward_saving,
                     recurrence=wavefront.recurrence_reference)


def _inputs(layers, units, batch, steps, inputs, with_lengths, seed=0, kind="lstm"):
    gen = torch.Generator().manual_seed(seed)
    mod = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(inputs, units, layers).double()
    weights = [w.detach().clone().requires_grad_() for w in mod._flat_weights]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    x, h0, c0 = rand(steps, batch, inputs), rand(layers, batch, units, scale=0.5), \
        rand(layers, batch, units, scale=0.5)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
        lengths[0] = steps
    return weights, x, h0, c0, lengths


@pytest.mark.parametrize("shape", [(1, 8, 3, 7, 5), (2, 16, 4, 9, 5), (3, 8, 5, 6, 3)])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_gradients_are_autograds_of_the_float64_reference(shape, with_lengths, kind):
    """Every gradient (x, h0, c0 for an LSTM, every weight and bias) of the
    per-layer backward; a GRU's through its four virtual gates."""
    weights, x, h0, c0, lengths = _inputs(*shape, with_lengths, kind=kind)
    want_out = wavefront.reference_forward(kind, weights, x, h0, c0 if kind == "lstm" else None,
                                           lengths)
    want_out = [t for t in want_out if t is not None]
    upstream = [torch.randn_like(t) for t in want_out]
    leaves = [x, h0, c0, *weights] if kind == "lstm" else [x, h0, *weights]
    want = torch.autograd.grad(want_out, leaves, upstream)
    kernels = TORCH_KERNELS if kind == "lstm" else dict(
        TORCH_KERNELS, saving=functools.partial(wavefront.reference_forward_saving, kind="gru"))
    out = wavefront.trainable_forward(x, wavefront.flat_params(weights), h0,
                                      c0 if kind == "lstm" else None, lengths, kind=kind,
                                      **kernels)
    assert (out[2] is None) == (kind == "gru")
    out = [t for t in out if t is not None]
    for a, b in zip(out, want_out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    got = torch.autograd.grad(out, leaves, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


STACK_KERNELS = dict(saving=wavefront.reference_forward_saving,
                     recurrence=wavefront.stack_recurrence_reference, backward="stack")


@pytest.mark.parametrize("shape", [(1, 8, 3, 7, 5), (2, 16, 4, 9, 5), (3, 8, 5, 6, 3),
                                   (4, 8, 2, 4, 6)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_the_stack_backwards_gradients_are_autograds_of_the_float64_reference(shape,
                                                                             with_lengths):
    """backward="stack": one (here: torch) recurrence for every layer, then
    the GEMMs of `backward_stack_wavefront`."""
    weights, x, h0, c0, lengths = _inputs(*shape, with_lengths)
    want_out = wavefront.reference_forward("lstm", weights, x, h0, c0, lengths)
    upstream = [torch.randn_like(t) for t in want_out]
    leaves = [x, h0, c0, *weights]
    want = torch.autograd.grad(want_out, leaves, upstream)
    out = wavefront.trainable_forward(x, wavefront.flat_params(weights), h0, c0, lengths,
                                      **STACK_KERNELS)
    got = torch.autograd.grad(out, leaves, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_stack_recurrence_reference_is_the_layer_by_layer_recurrence():
    """`stack_recurrence_reference` (the stack kernel's contract) gives the
    dgates, dh0, dc0 of `backward_stack`'s layer-by-layer recurrence (in
    float64, where keeping dy^l in the accumulation dtype changes nothing)."""
    weights, x, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    params = wavefront.flat_params(weights).detach()
    x, h0, c0 = x.detach(), h0.detach(), c0.detach()
    y, _, _, saved = wavefront.reference_forward_saving(x, params, h0, c0, lengths)
    gen = torch.Generator().manual_seed(3)
    dy, dhy, dcy = (torch.randn(*t.shape, generator=gen, dtype=torch.float64)
                    for t in (y, h0, c0))
    lens = lengths.to(torch.int32)
    layer_calls = []

    def recording(*args, **kw):
        out = wavefront.recurrence_reference(*args, **kw)
        layer_calls.insert(0, out)  # called from the top layer down
        return out

    wavefront.backward_stack(params, x, h0, c0, lens, y, saved, dy, dhy, dcy,
                             recurrence=recording)
    dgates, dh0, dc0 = wavefront.stack_recurrence_reference(params, 5, saved[1], saved[2], c0,
                                                            dy, dhy, dcy, lens)
    assert dgates.shape == (3, 6, 4, 32) and dh0.shape == dc0.shape == (3, 4, 8)
    for l, (dg, dh, dc) in enumerate(layer_calls):
        torch.testing.assert_close(dgates[l], dg, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(dh0[l], dh, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(dc0[l], dc, rtol=1e-12, atol=1e-14)
    # Zero past each length, in every layer.
    for b, n in enumerate(lens.tolist()):
        assert torch.all(dgates[:, n:, b] == 0)


def test_the_stack_backward_in_float16_matches_the_layer_by_layer_one():
    """In the element type the stack path keeps dy^l in float32 (the layer
    path rounds it to float16 between layers): the two agree to float16's
    precision, and dgates are stored in float16 by both."""
    weights, x, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    half = lambda t: t.detach().to(torch.float16)  # noqa: E731
    params, x, h0, c0 = (half(t) for t in (wavefront.flat_params(weights), x, h0, c0))
    y, _, _, saved = wavefront.reference_forward_saving(x, params, h0, c0, lengths)
    gen = torch.Generator().manual_seed(4)
    dy, dhy, dcy = (torch.randn(*t.shape, generator=gen).to(torch.float16) for t in (y, h0, c0))
    lens = lengths.to(torch.int32)
    got = wavefront.backward_stack_wavefront(params, x, h0, c0, lens, y, saved, dy, dhy, dcy,
                                             recurrence=wavefront.stack_recurrence_reference)
    want = wavefront.backward_stack(params, x, h0, c0, lens, y, saved, dy, dhy, dcy,
                                    recurrence=wavefront.recurrence_reference)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_an_unknown_backward_is_refused():
    with pytest.raises(ValueError, match=r"backward must be one of .*received 'both'"):
        wavefront.trainable_forward(torch.zeros(2, 1, 3), torch.zeros(1), torch.zeros(1, 1, 8),
                                    torch.zeros(1, 1, 8), backward="both")
    with pytest.raises(ValueError, match="received None"):
        wavefront.backward_choice(torch.zeros(2, 1, 3), torch.zeros(1, 1, 8), None)


def test_auto_is_the_layer_backward_off_a_cuda_device():
    """On the CPU "auto" never asks the library (no driver): v1, with why."""
    choice = wavefront.backward_choice(torch.zeros(5, 2, 3), torch.zeros(2, 2, 8))
    assert (choice.backward, choice.requested) == ("layer", "auto")
    assert "CUDA devices only" in choice.reason and "per-layer" in choice.note
    forced = wavefront.backward_choice(torch.zeros(5, 2, 3), torch.zeros(2, 2, 8), "stack")
    assert (forced.backward, forced.reason) == ("stack", None)


@pytest.fixture
def ran_backward(monkeypatch):
    """Which of the two backward passes ran: a spy around each (they still run)."""
    return spy_each(monkeypatch, wavefront, ("backward_stack", "backward_stack_wavefront"))


@pytest.mark.parametrize("refusal", [None, "L x ceil(H/16) CTAs do not fit the SMs"])
def test_auto_runs_the_stack_backward_where_its_plan_accepts_the_stack(monkeypatch,
                                                                       ran_backward, refusal):
    """Where a device could run it (faked: the CPU here), "auto" asks
    `library.backward_stack_reason` for this stack and runs the reverse
    wavefront where it accepts, else the per-layer backward with the
    refusal as the reason; either way the gradients are autograd's of the
    float64 reference (the torch stand-in of the recurrence that runs)."""
    library = wavefront._library()
    asked = []
    monkeypatch.setattr(wavefront, "_stack_unavailable", lambda device: None)
    monkeypatch.setattr(library, "backward_stack_reason", answering(refusal, asked))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    weights, x, h0, c0, lengths = _inputs(3, 8, 4, 6, 5, True)
    choice = wavefront.backward_choice(x, h0)
    assert asked == [("lstm", 3, 8, 4, 6, 0)]
    assert choice.backward == ("stack" if refusal is None else "layer")
    assert choice.reason == refusal
    recurrence = (wavefront.stack_recurrence_reference if refusal is None
                  else wavefront.recurrence_reference)
    want_out = wavefront.reference_forward("lstm", weights, x, h0, c0, lengths)
    upstream = [torch.randn_like(t) for t in want_out]
    leaves = [x, h0, c0, *weights]
    want = torch.autograd.grad(want_out, leaves, upstream)
    out = wavefront.trainable_forward(x, wavefront.flat_params(weights), h0, c0, lengths,
                                      saving=wavefront.reference_forward_saving,
                                      recurrence=recurrence)
    got = torch.autograd.grad(out, leaves, upstream)
    assert ran_backward == ["backward_stack_wavefront" if refusal is None else "backward_stack"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_layer_forces_the_per_layer_backward_without_asking(monkeypatch, ran_backward):
    library = wavefront._library()
    monkeypatch.setattr(wavefront, "_stack_unavailable", lambda device: None)
    monkeypatch.setattr(library, "backward_stack_reason",
                        lambda *a: pytest.fail("'layer' must not ask the stack's plan"))
    weights, x, h0, c0, _ = _inputs(2, 8, 3, 5, 4, False)
    y, _, _ = wavefront.trainable_forward(x, wavefront.flat_params(weights), h0, c0,
                                          backward="layer", **TORCH_KERNELS)
    y.sum().backward()
    assert ran_backward == ["backward_stack"]


def test_no_gradient_past_a_length_and_the_final_states_enter_at_its_end():
    weights, x, h0, c0, _ = _inputs(2, 8, 3, 6, 4, False)
    lengths = torch.tensor([6, 2, 4])
    y, hy, cy = wavefront.trainable_forward(x, wavefront.flat_params(weights), h0, c0, lengths,
                                            **TORCH_KERNELS)
    (dx,) = torch.autograd.grad(hy[-1].sum() + y[5].sum(), [x])
    assert torch.all(dx[2:, 1] == 0) and torch.any(dx[:2, 1] != 0)
    assert torch.all(dx[4:, 2] == 0) and torch.any(dx[3, 2] != 0)


def test_the_saved_tensors_have_the_kernels_layout():
    weights, x, h0, c0, lengths = _inputs(3, 8, 2, 5, 4, True)
    y, hy, cy, (hseq, gates, cseq) = wavefront.reference_forward_saving(
        x.detach(), wavefront.flat_params(weights).detach(), h0.detach(), c0.detach(), lengths)
    assert hseq.shape == (2, 5, 2, 8) and gates.shape == (3, 5, 2, 32)
    assert cseq.shape == (3, 5, 2, 8)
    ref_y, _, ref_c = wavefront.reference_forward("lstm", weights, x, h0, c0, lengths)
    torch.testing.assert_close(y, ref_y.detach(), rtol=0, atol=1e-12)
    # c at each row's last step is its final c; the gates are activations.
    last = lengths - 1
    torch.testing.assert_close(cseq[-1, last, torch.arange(2)], ref_c[-1].detach())
    assert gates.min() >= -1 and gates.max() <= 1


def test_the_recurrence_writes_zero_gate_gradients_past_each_length():
    steps, batch, units = 5, 3, 8
    gen = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    gates = torch.rand(steps, batch, 4 * units, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3])
    dgates, dh0, dc0 = wavefront.recurrence_reference(
        rand(4 * units, units), gates, rand(steps, batch, units), rand(batch, units),
        rand(steps, batch, units), rand(batch, units), rand(batch, units), lengths)
    assert dgates.shape == (steps, batch, 4 * units)
    assert torch.all(dgates[1:, 1] == 0) and torch.all(dgates[3:, 2] == 0)
    assert torch.all(dgates[0] != 0) and dh0.shape == dc0.shape == (batch, units)


def test_training_calls_it_cannot_run_say_why():
    cpu = torch.device("cpu")
    assert "LSTM and GRU" in wavefront._library().backward_reason("simple_rnn", 64, 8, 10)
    assert "LSTM stacks only" in wavefront._library().backward_stack_reason("gru", 2, 64, 8, 10)
    reason = wavefront.training_reason("gru", 2, 64, 8, 10, 64, torch.float16, cpu)
    assert "CUDA devices only" in reason, "a GRU is refused for the device, not its kind"
    reason = wavefront.training_reason("lstm", 2, 64, 8, 10, 64, torch.float16, cpu)
    assert "CUDA devices only" in reason
    with pytest.raises(ValueError, match="c0"):
        wavefront.trainable_forward(torch.zeros(2, 1, 3), torch.zeros(1), torch.zeros(1, 1, 8),
                                    None)
    with pytest.raises(ValueError, match="LSTM stacks only"):
        wavefront.trainable_forward(torch.zeros(2, 1, 3), torch.zeros(1), torch.zeros(1, 1, 8),
                                    None, kind="gru", backward="stack")


def _stack(layers, units, inputs):
    return built_stack("lstm", layers, units, inputs, dtype="float64")


def test_run_trainable_refuses_the_cpu():
    stack = _stack(1, 8, 4)
    with pytest.raises(NotImplementedError, match="CUDA devices only"):
        wavefront.run_trainable(torch.zeros(2, 3, 4, dtype=torch.float16), StackCall(stack))


def test_run_trainable_gives_the_keras_variables_cudnns_gradient(monkeypatch):
    """With the torch kernels in place of the GPU's: the variables' gradients
    equal those of the torch backend's own (cuDNN-path) run_stack."""
    from rnnfuse.backends import torch as torch_backend

    monkeypatch.setattr(wavefront, "forward_training", wavefront.reference_forward_saving)
    monkeypatch.setattr(wavefront, "backward_layer", wavefront.recurrence_reference)
    monkeypatch.setattr(wavefront, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(wavefront, "_backward_reason", lambda *a, **k: None)
    stack = _stack(2, 8, 4)
    variables = [w for level in stack.cells for cell in level for w in cell.weights]
    x = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 5])[:, None]

    def grads(run):
        out = run(x, StackCall(stack, mask=mask))
        loss = out.outputs.square().sum() + out.final_h.sum() + out.final_c.square().sum()
        return torch.autograd.grad(loss, [x] + [v.value for v in variables])

    got = grads(wavefront.run_trainable)
    want = grads(torch_backend.run_stack)  # kernel "cudnn", StackCall's default
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
