"""Torch-backend checks the CPU tests (tests/torch_backend) and the GPU
ones (tests/gpu/*torch*) share: what a spy on `torch_rnn` records of each
call (the `torch_calls` and `cudnn_calls` fixtures), PyTorch's own RNN
modules run the way cuDNN runs lengths, a fused layer's call on its plan
next to its original layers', the torch ops a call dispatches, and the
environment of the tuning tests' fake device (the `fake_gpu` fixtures).

    >>> import torch
    >>> x, hx = torch.zeros(3, 2, 4), torch.zeros(1, 2, 5)
    >>> vf_call("lstm", (x, hx, ["w"], True, 1, 0.0, False, False, True))["num_layers"]
    1
"""

from __future__ import annotations

FAKE_GPU_ENV = {"device": "FakeGPU", "torch": "2", "backend": "torch", "rnnfuse": "0.1.0"}


def vf_call(mode: str, args: tuple) -> dict:
    """The fields of one `torch._VF` RNN call: mode, packed, params,
    num_layers, dropout, train, bidirectional."""
    import torch

    # Padded: (x, hx, params, has_biases, layers, dropout, train, bidir,
    # batch_first); packed: (data, batch_sizes, hx, params, ...bidir).
    packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64
    rest = args[2:] if packed else args[1:]
    return dict(mode=mode, packed=packed, params=rest[1], num_layers=rest[3], dropout=rest[4],
                train=rest[5], bidirectional=rest[6])


def planned_then_original(layer, x, mask=None):
    """(outputs on the fused `layer`'s plan, the kernel that ran, outputs
    of its original layers): two inference calls without gradients, the
    second on the empty plan, which the layer keeps."""
    import torch

    from rnnfuse.plan import Plan

    with torch.no_grad():
        y = layer(x, mask=mask, training=False)
        ran = layer.last_path.kernel
        layer.set_plan(Plan(()))
        return y, ran, layer(x, mask=mask, training=False)


def module_run(mod, kind: str, x, h0, c0, lengths):
    """(y, hy, cy or None) of a torch.nn.LSTM or GRU `mod` over time-major
    `x` from (h0, c0), packed by `lengths` where given (cuDNN's semantics:
    zeros past each length, the states at it)."""
    import torch

    state = (h0, c0) if kind == "lstm" else h0
    if lengths is None:
        y, st = mod(x, state)
    else:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        yp, st = mod(packed, state)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(yp, total_length=x.shape[0])
    return (y, *st) if kind == "lstm" else (y, st, None)


def torch_ops(run) -> "collections.Counter":
    """The torch ops `run()` dispatches, by name (torch.profiler's CPU-side events)."""
    import collections

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return collections.Counter(e.name for e in prof.events())
