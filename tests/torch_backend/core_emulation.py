"""An emulation of rnnfuse's cuDNN core for the CPU tests of its torch binding.

`tests/cudnn_reference.py` (cuDNN's equations over the canonical flat
buffer, written once against a NumPy-like namespace) run on torch in
float64 through `TORCH_XP`, so it is differentiable: `forward` stands in
for `rnnfuse.backends.torch.cudnn_core.core_forward` and `backward` (the
same forward's vector-Jacobian product) for `core_backward`. The binding's
packing, shapes, autograd wiring and fallbacks then run in CI; the GPU
tests (tests/gpu/test_gpu_core_torch.py) prove the library's arithmetic.

`install(monkeypatch)` swaps both in, makes "cudnn" calls on CPU tensors
go to the core, and returns a record of every call (its configuration,
training flag, dropout and seed).
"""

from __future__ import annotations

import concurrent.futures
import types

import torch

from cudnn_reference import cudnn_rnn

MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")

TORCH_XP = types.SimpleNamespace(
    reshape=lambda a, shape: torch.reshape(a, tuple(shape)),
    matmul=torch.matmul,
    transpose=lambda a: a.t(),
    exp=torch.exp,
    tanh=torch.tanh,
    maximum=lambda a, b: torch.clamp(a, min=b),
    arange=lambda n, dtype=None: torch.arange(n, dtype=dtype),
    where=torch.where,
    broadcast_to=lambda a, shape: a.expand(*shape),
    take_along_axis=lambda a, index, axis: torch.take_along_dim(a, index, dim=axis),
    zeros_like=torch.zeros_like,
    stack=torch.stack,
    concatenate=lambda parts, axis=0: torch.cat(parts, dim=axis),
)


def _lengths(lengths, x):
    if lengths is None:
        return torch.full((x.shape[1],), x.shape[0], dtype=torch.int64)
    return lengths.to(torch.int64)


def _reference(ints, x, hx, cx, params, lengths):
    mode = MODES[ints[0]]
    out, h, c = cudnn_rnn(TORCH_XP, x, hx, cx if mode == "lstm" else None, params,
                          _lengths(lengths, x), mode, ints[5] == 2)
    return out, h, c


def forward(ints, dropout, seed, training, x, hx, cx, params, lengths, dev_lengths):
    """`core_forward`'s results, from the float64 reference (no dropout)."""
    with torch.no_grad():
        as64 = [t.double() for t in (x, hx, cx, params)]
        y, h, c = _reference(ints, *as64, lengths)
    cy = c.to(x.dtype) if ints[0] == 0 else x.new_empty((0,))
    reserve = torch.zeros(reserve_bytes(ints, dropout, seed, training, x), dtype=torch.uint8)
    return y.to(x.dtype), h.to(x.dtype), cy, reserve


def reserve_bytes(ints, dropout, seed, training, x):
    """`cudnn_core.reserve_bytes`: the size `forward` gives its reserve."""
    return 8 if training else 0


def backward(ints, dropout, seed, x, hx, cx, params, lengths, dev_lengths, y, dy, dhy, dcy,
             reserve):
    """`core_backward`'s (dx, dhx, dcx, dparams): the reference's
    vector-Jacobian product at the forward's inputs."""
    lstm = ints[0] == 0

    def vjp():
        leaves = [t.detach().double().requires_grad_(True) for t in (x, hx, cx, params)]
        with torch.enable_grad():
            out, h, c = _reference(ints, *leaves, lengths)
            outputs, grads = [out, h], [dy.double(), dhy.double()]
            if lstm:
                outputs.append(c)
                grads.append(dcy.double())
            wrt = [leaves[0], leaves[1], leaves[3]] + ([leaves[2]] if lstm else [])
            return torch.autograd.grad(outputs, wrt, grads, allow_unused=True)

    # A custom op's body runs below autograd's dispatch keys (thread-local
    # state), so the reference's own gradient is taken on another thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        got = pool.submit(vjp).result()
    dx, dhx, dparams = (g.to(x.dtype) for g in got[:3])
    dcx = got[3].to(x.dtype) if lstm else x.new_empty((0,))
    return dx, dhx, dcx, dparams


def install(monkeypatch):
    """Runs "cudnn" calls on CPU tensors on the emulated core; returns the
    list of call records ({"kind", "layers", "directions", "proj",
    "algorithm", "tf32", "dropout", "seed", "training"}, and "backward"
    entries)."""
    from rnnfuse.backends import torch as torch_backend
    from rnnfuse.backends.torch import cudnn_core

    calls = []

    def spy_forward(ints, dropout, seed, training, *args):
        calls.append(dict(pass_="forward", kind=MODES[ints[0]], layers=ints[1], units=ints[2],
                          proj=ints[3], input_size=ints[4], directions=ints[5],
                          algorithm=ints[6], tf32=bool(ints[7]), dropout=dropout, seed=seed,
                          training=training))
        return forward(ints, dropout, seed, training, *args)

    def spy_backward(ints, *args):
        calls.append(dict(pass_="backward", kind=MODES[ints[0]]))
        return backward(ints, *args)

    monkeypatch.setattr(cudnn_core, "core_forward", spy_forward)
    monkeypatch.setattr(cudnn_core, "core_backward", spy_backward)
    monkeypatch.setattr(cudnn_core, "core_reason", lambda x: None)
    monkeypatch.setattr(cudnn_core, "reserve_bytes", reserve_bytes)
    monkeypatch.setattr(torch_backend, "core_applies", lambda x: True)
    return calls
