"""The torch binding of rnnfuse's wavefront kernel, on the CPU.

The kernel itself runs on a Hopper GPU only (tests/gpu/test_gpu_wavefront_torch.py);
here: the float64 reference it is checked against reproduces PyTorch's own
LSTM/GRU (with lengths), the flat buffer is the canonical layout, the
custom op has shapes for tracing, and every call the kernel cannot run says
why (the caller's cue to run cuDNN).
"""

from __future__ import annotations

import pytest
import torch

from builders import built_stack
from torch_checks import module_run
from rnnfuse.backends.base import StackCall
from rnnfuse.backends.torch import wavefront


def _module(kind, layers, units, inputs):
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    return cls(inputs, units, layers).double()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_the_reference_is_pytorchs_own_recurrence(kind, with_lengths):
    steps, batch, layers, units, inputs = 9, 5, 3, 6, 4
    mod = _module(kind, layers, units, inputs)
    x = torch.randn(steps, batch, inputs, dtype=torch.float64)
    h0 = torch.randn(layers, batch, units, dtype=torch.float64)
    c0 = torch.randn(layers, batch, units, dtype=torch.float64)
    lengths = torch.randint(1, steps + 1, (batch,)) if with_lengths else None
    y, hy, cy = wavefront.reference_forward(kind, mod._flat_weights, x, h0, c0, lengths)
    with torch.no_grad():
        want, want_h, want_c = module_run(mod, kind, x, h0, c0, lengths)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(hy, want_h, rtol=0, atol=1e-12)
    if kind == "lstm":
        torch.testing.assert_close(cy, want_c, rtol=0, atol=1e-12)


def test_flat_params_is_the_canonical_layout():
    mod = _module("gru", 2, 4, 3)
    w = mod._flat_weights  # per layer: w_ih, w_hh, b_ih, b_hh
    flat = wavefront.flat_params(mod)
    want = torch.cat([w[0].flatten(), w[1].flatten(), w[4].flatten(), w[5].flatten(),
                      w[2], w[3], w[6], w[7]])
    assert torch.equal(flat, want)
    with pytest.raises(ValueError, match="per layer"):
        wavefront.flat_params(w[:3])


@pytest.mark.parametrize(
    "args, message",
    [
        (("lstm", torch.float16, "cpu"), "CUDA devices only"),
        (("lstm", torch.float32, "cpu"), "float16 and bfloat16, not float32"),
        (("rnn_tanh", torch.float16, "cpu"), "LSTM and GRU"),
    ],
)
def test_calls_it_cannot_run_say_why(args, message):
    kind, dtype, device = args
    reason = wavefront.unsupported_reason(kind, 2, 64, 8, 10, 64, dtype, torch.device(device))
    assert message in reason


def test_the_custom_op_has_shapes_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xproj = torch.empty(7, 3, 4 * 16, dtype=torch.float16)
        h0 = torch.empty(2, 3, 16, dtype=torch.float16)
        y, hy, cy = torch.ops.rnnfuse.wavefront_forward(
            xproj, torch.empty(10, dtype=torch.float16), h0, h0,
            torch.empty(0, dtype=torch.int32), "lstm", 5)
    assert tuple(y.shape) == (7, 3, 16) and tuple(hy.shape) == tuple(cy.shape) == (2, 3, 16)


def test_run_stack_refuses_on_the_cpu_with_the_reason():
    stack = built_stack("lstm", 2, 8, 3)
    x = torch.zeros(2, 5, 3, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="CUDA devices only"):
        wavefront.run_stack(x, StackCall(stack))
    with pytest.raises(NotImplementedError, match="dropout"):
        wavefront.run_stack(x, StackCall(stack, dropout=0.1))
