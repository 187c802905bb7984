"""torch binding of rnnfuse's wavefront kernel (rnnfuse/backends/cuda/).

`torch.ops.rnnfuse.wavefront_forward` is a `torch.library.custom_op` over
the C-ABI library, loaded with ctypes rather than built with
`torch.utils.cpp_extension`, so one build serves any torch (a CPU build
here, another version on the GPU).

`run_autograd`, what the backend calls for the "wavefront" kernel, is
`run_stack` (inference) where autograd does not record the call and
`run_trainable` (the kernel's forward and backward) where it does; where
the kernels refuse the call the backend runs cuDNN.

`forward(x, params, h0, c0, lengths, kind=...)` runs a whole stack: layer
0's input projection as one torch matmul, then the kernel. x [T, B, I] is
time-major; params is the canonical flat buffer (per layer W_ih [G*H, n]
and W_hh [G*H, H] row-major, then per layer b_ih and b_hh [G*H], PyTorch's
gate order, see `flat_params`); h0, c0 [L, B, H]; lengths int32 [B] or
None. It returns (y [T, B, H], hy, cy [L, B, H] or None), or raises
`library.WavefrontError` outside the kernel's limits (`unsupported_reason`).

Training: `trainable_forward` is `forward` with the kernel's gradient:
`forward_training` saves every layer's gates and c, and the backward is
`backward_stack_wavefront` (every layer's recurrence in ONE reverse
wavefront launch, LSTM only) where its plan accepts the stack, else
`backward_stack` (per layer: `backward_layer`, then GEMMs).
`reference_forward_saving` and `recurrence_reference` are the kernels in
torch, for the CPU tests.

Example (on a Hopper GPU):

    >>> lstm = torch.nn.LSTM(512, 512, 4).cuda().half()  # doctest: +SKIP
    >>> y, hy, cy = forward(x, flat_params(lstm), h0, c0, None,
    ...                     kind="lstm")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from rnnfuse.backends.torch.streams import launch_stream

__all__ = ["KERNEL_NAME", "TRAINING_KERNEL_NAME", "backward_choice", "backward_layer",
           "backward_stack",
           "backward_stack_kernel", "backward_stack_wavefront", "flat_params", "forward",
           "forward_into", "forward_training", "library_reason", "recurrence_reference",
           "reference_forward", "reference_forward_saving", "run_autograd", "run_stack",
           "run_trainable", "stack_recurrence_reference", "trainable_forward",
           "training_reason", "unsupported_reason", "wants_gradient"]

_GATES = {"lstm": 4, "gru": 3}
KERNEL_NAME = "torch.ops.rnnfuse.wavefront_forward"
TRAINING_KERNEL_NAME = "rnnfuse wavefront forward+backward"


def _library():
    from rnnfuse.backends.cuda import library

    return library


def flat_params(weights: Sequence[torch.Tensor] | torch.nn.Module) -> torch.Tensor:
    """The canonical flat buffer from PyTorch's per-layer weight list
    [w_ih, w_hh, b_ih, b_hh] * L (or an nn.LSTM/nn.GRU's `_flat_weights`)."""
    if isinstance(weights, torch.nn.Module):
        weights = weights._flat_weights
    weights = list(weights)
    if len(weights) % 4:
        raise ValueError(f"flat_params: expected [w_ih, w_hh, b_ih, b_hh] per layer; "
                         f"received {len(weights)} tensors")
    mats = [w.reshape(-1) for i, w in enumerate(weights) if i % 4 < 2]
    biases = [w.reshape(-1) for i, w in enumerate(weights) if i % 4 >= 2]
    return torch.cat(mats + biases)


def unsupported_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                       input_size: int, dtype: torch.dtype, device: torch.device, *,
                       directions: int = 1, proj_size: int = 0, summed_inputs: bool = False,
                       dropout: float = 0.0) -> str | None:
    """Why the kernel cannot run this stack here (then cuDNN runs), or None."""
    library = _library()
    reason = library.stack_reason(kind, str(dtype).replace("torch.", ""), directions=directions,
                                  proj_size=proj_size, summed_inputs=summed_inputs,
                                  dropout=dropout)
    if reason is not None:
        return reason
    if device.type != "cuda":
        return "the wavefront kernel runs on CUDA devices only"
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    return library_reason("device_reason", kind, num_layers, units, batch, steps, input_size,
                          ordinal)


@torch.compiler.assume_constant_result  # a trace's constant (the library's calls)
def library_reason(name: str, *args) -> str | None:
    """The library's check `name` (`device_reason`, ...) of `args`."""
    return getattr(_library(), name)(*args)


def forward_into(xproj, params, h0, c0, lengths, y, hy, cy, workspace, *, kind: str,
                 input_size: int, mode: int = 0, trace: torch.Tensor | None = None,
                 gates_out: torch.Tensor | None = None,
                 c_out: torch.Tensor | None = None, variant: int = 0) -> None:
    """The kernel on preallocated outputs (tests poison them first).

    xproj [T, B, G*H] = x W_ih0^T; workspace: `workspace_bytes(L, H, B, T)`
    uint8 bytes. `mode`, `trace`: the library's debug options; `gates_out`,
    `c_out`: where the forward saves gates and c for the backward;
    `variant`: 0 to 5 (library.forward, wavefront.cuh "Variants")."""
    for t in (gates_out, c_out):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError("forward_into: gates_out and c_out must be contiguous float32")
    library = _library()
    steps, batch, gh = xproj.shape
    units = gh // _GATES[kind]
    num_layers = h0.shape[0]
    tensors = [xproj, params, h0, y, hy] + ([c0, cy] if kind == "lstm" else [])
    for t in tensors:
        if not t.is_contiguous() or t.dtype != xproj.dtype or t.device != xproj.device:
            raise ValueError("forward_into: every tensor must be contiguous, of xproj's dtype "
                             f"and device ({xproj.dtype}, {xproj.device})")
    lib = library.load()
    lib.forward(
        launch_stream(xproj.device),
        str(xproj.dtype).replace("torch.", ""), kind, num_layers, units, batch, steps,
        input_size,
        xproj=xproj.data_ptr(), params=params.data_ptr(), h0=h0.data_ptr(),
        c0=c0.data_ptr() if kind == "lstm" else 0,
        lengths=lengths.data_ptr() if lengths is not None else 0,
        y=y.data_ptr(), hy=hy.data_ptr(), cy=cy.data_ptr() if kind == "lstm" else 0,
        workspace=workspace.data_ptr(), mode=mode,
        trace=trace.data_ptr() if trace is not None else 0,
        trace_steps=trace.shape[1] if trace is not None else 0,
        gates_out=gates_out.data_ptr() if gates_out is not None else 0,
        c_out=c_out.data_ptr() if c_out is not None else 0, variant=variant)


@torch.library.custom_op("rnnfuse::wavefront_forward", mutates_args=())
def _wavefront_op(xproj: torch.Tensor, params: torch.Tensor, h0: torch.Tensor,
                  c0: torch.Tensor, lengths: torch.Tensor, kind: str,
                  input_size: int, variant: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    steps, batch, gh = xproj.shape
    units, num_layers = gh // _GATES[kind], h0.shape[0]
    y = xproj.new_empty((steps, batch, units))
    hy = torch.empty_like(h0)
    cy = torch.empty_like(h0) if kind == "lstm" else h0.new_empty((0,))
    nbytes = _library().load().workspace_bytes(num_layers, units, batch, steps)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=xproj.device)
    forward_into(xproj, params, h0, c0, lengths if lengths.numel() else None, y, hy, cy,
                 workspace, kind=kind, input_size=input_size, variant=variant)
    return y, hy, cy


@_wavefront_op.register_fake
def _(xproj, params, h0, c0, lengths, kind, input_size, variant=0):
    steps, batch, gh = xproj.shape
    units = gh // _GATES[kind]
    cy = torch.empty_like(h0) if kind == "lstm" else h0.new_empty((0,))
    return xproj.new_empty((steps, batch, units)), torch.empty_like(h0), cy


def _input_projection(x: torch.Tensor, params: torch.Tensor, gh: int) -> torch.Tensor:
    """Layer 0's x W_ih^T [T, B, gh] (no bias) as one matmul in x's dtype."""
    steps, batch, input_size = x.shape
    w_ih0 = params[: gh * input_size].view(gh, input_size)
    return (x.reshape(steps * batch, input_size) @ w_ih0.t()).view(steps, batch, gh)


def forward(x: torch.Tensor, params: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None,
            lengths: torch.Tensor | None, *, kind: str, variant: int | None = None):
    """The whole stack's forward pass (see the module docstring); `variant`
    None is the library's `FORWARD_VARIANT`."""
    if variant is None:
        variant = _library().FORWARD_VARIANT
    input_size, units = x.shape[2], h0.shape[2]
    xproj = _input_projection(x, params, _GATES[kind] * units)
    if lengths is None:
        lengths = torch.empty(0, dtype=torch.int32, device=x.device)
    c0 = c0 if c0 is not None else h0.new_empty((0,))
    extra = (variant,) if variant else ()
    y, hy, cy = _wavefront_op(xproj.contiguous(), params.contiguous(), h0.contiguous(),
                              c0.contiguous(), lengths.to(torch.int32).contiguous(), kind,
                              input_size, *extra)
    return y, hy, (cy if kind == "lstm" else None)


# -- training: the forward saving gates and c, the backward kernel -----------------------


def forward_training(x: torch.Tensor, params: torch.Tensor, h0: torch.Tensor,
                     c0: torch.Tensor | None, lengths: torch.Tensor | None, *,
                     kind: str = "lstm"):
    """A stack's forward on the kernel, saving what `backward_stack` reads:
    (y, hy, cy, (hseq [L-1, T, B, H] in x's dtype, gates [L, T, B, 4H] and
    cseq [L, T, B, H] float32)). gates: an LSTM's i, f, g, o, a GRU's r, z,
    n, W_hn h_{t-1} + b_hn; cseq: an LSTM's c, a GRU's h_{t-1}.

    Raises:
        library.WavefrontError: the kernel cannot run this stack."""
    library = _library()
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    xproj = _input_projection(x, params, _GATES[kind] * units)
    y = x.new_empty((steps, batch, units))
    hy = torch.empty_like(h0)
    cy = torch.empty_like(h0) if kind == "lstm" else None
    lib = library.load()
    nbytes = lib.workspace_bytes(num_layers, units, batch, steps)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    gates = torch.empty((num_layers, steps, batch, 4 * units), dtype=torch.float32,
                        device=x.device)
    cseq = torch.empty((num_layers, steps, batch, units), dtype=torch.float32, device=x.device)
    forward_into(xproj.contiguous(), params.contiguous(), h0.contiguous(),
                 c0.contiguous() if kind == "lstm" else None, lengths, y, hy, cy, workspace,
                 kind=kind, input_size=input_size, gates_out=gates, c_out=cseq,
                 variant=library.FORWARD_VARIANT)
    # The workspace is the flags, then the sequences of the layers below the top.
    seq_bytes = (num_layers - 1) * steps * batch * units * x.element_size()
    hseq = workspace[nbytes - seq_bytes:].view(x.dtype).view(num_layers - 1, steps, batch, units)
    return y, hy, cy, (hseq, gates, cseq)


def backward_layer(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, kind: str = "lstm"):
    """The backward recurrence of one LSTM or GRU layer on the kernel.

    w_hh [G*H, H], c0, dhy, dcy [B, H], dy [T, B, H] in the element type;
    gates, cseq float32 (this layer's saved); lengths int32 [B] or None (a
    GRU's c0 and dcy are not read). Returns (dgates [T, B, 4H], 0 at t >=
    length; dh0, dc0 [B, H] float32; a GRU's dc0 None)."""
    library = _library()
    steps, batch, units = dy.shape
    lstm = kind == "lstm"
    dgates = dy.new_empty((steps, batch, 4 * units))
    dh0 = torch.empty((batch, units), dtype=torch.float32, device=dy.device)
    dc0 = torch.empty_like(dh0) if lstm else None
    lib = library.load()
    workspace = torch.empty(lib.backward_workspace_bytes(), dtype=torch.uint8, device=dy.device)
    tensors = (w_hh, gates, cseq, dy, dhy) + ((c0, dcy) if lstm else ())
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("backward_layer: every tensor must be contiguous")
    lib.backward(launch_stream(dy.device),
                 str(dy.dtype).replace("torch.", ""), units, batch, steps,
                 w_hh=w_hh.data_ptr(), gates=gates.data_ptr(), cseq=cseq.data_ptr(),
                 c0=c0.data_ptr() if lstm else 0, dy=dy.data_ptr(), dhy=dhy.data_ptr(),
                 dcy=dcy.data_ptr() if lstm else 0,
                 lengths=lengths.data_ptr() if lengths is not None else 0,
                 dgates=dgates.data_ptr(), dh0=dh0.data_ptr(),
                 dc0=dc0.data_ptr() if lstm else 0,
                 workspace=workspace.data_ptr(), kind=kind)
    return dgates, dh0, dc0


def recurrence_reference(w_hh, gates, cseq, c0, dy, dhy, dcy, lengths, *, dtype=None,
                         kind: str = "lstm"):
    """`backward_layer` in torch, step by step (dgates rounded to the element
    type as the kernel stores them); `dtype`: the element type where dy is
    not in it."""
    if kind == "gru":
        return _gru_recurrence_reference(w_hh, gates, cseq, dy, dhy, lengths, dtype=dtype)
    dtype, acc, lengths, dgates, carry = _reference_start(dy, lengths, dtype)
    w = w_hh.to(acc)
    rec = torch.zeros_like(carry)
    for t in reversed(range(dy.shape[0])):
        alive = (t < lengths)[:, None]
        last = (t == lengths - 1)[:, None]
        dh = rec + dy[t].to(acc) + torch.where(last, dhy.to(acc), torch.zeros_like(rec))
        dc = torch.where(last, dcy.to(acc), carry)
        i, f, g, o = gates[t].to(acc).chunk(4, dim=1)
        c_prev = cseq[t - 1].to(acc) if t > 0 else c0.to(acc)
        tc = torch.tanh(cseq[t].to(acc))
        dc = dc + dh * o * (1 - tc * tc)
        da = torch.cat([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                        dh * tc * o * (1 - o)], dim=1)
        da = torch.where(alive, da, torch.zeros_like(da)).to(dtype)
        carry = torch.where(alive, dc * f, torch.zeros_like(carry))
        dgates[t] = da
        rec = da.to(acc) @ w
    return dgates, rec, carry


def _reference_start(dy, lengths, dtype):
    """A reference backward's start over dy [T, B, H]: (dtype, accumulation
    dtype, lengths, zero dgates [T, B, 4H], zero carry [B, H])."""
    steps, batch, units = dy.shape
    dtype = dy.dtype if dtype is None else dtype
    acc = _accumulation(dtype)
    full = torch.full((batch,), steps, device=dy.device)
    lengths = full if lengths is None else lengths.to(dy.device)
    dgates = dy.new_zeros((steps, batch, 4 * units), dtype=dtype)
    carry = torch.zeros((batch, units), dtype=acc, device=dy.device)
    return dtype, acc, lengths, dgates, carry


def _gru_recurrence_reference(w_hh, gates, hprev, dy, dhy, lengths, *, dtype=None):
    """`recurrence_reference` of a GRU layer over its saved r, z, n,
    W_hn h_{t-1} + b_hn and h_{t-1}: (dgates, dh0, None)."""
    dtype, acc, lengths, dgates, carry = _reference_start(dy, lengths, dtype)
    w_r, w_z, w_n = w_hh.to(acc).chunk(3, dim=0)
    w = torch.cat([w_r, w_z, torch.zeros_like(w_n), w_n])  # rows of (dr, dz, dn_x, dn_h)
    rec = torch.zeros_like(carry)
    for t in reversed(range(dy.shape[0])):
        alive = (t < lengths)[:, None]
        last = (t == lengths - 1)[:, None]
        dh = rec + dy[t].to(acc) + carry + torch.where(last, dhy.to(acc), torch.zeros_like(rec))
        r, z, n, hn = gates[t].to(acc).chunk(4, dim=1)
        dnx = dh * (1 - z) * (1 - n * n)
        da = torch.cat([dnx * hn * r * (1 - r), dh * (hprev[t].to(acc) - n) * z * (1 - z), dnx,
                        dnx * r], dim=1)
        da = torch.where(alive, da, torch.zeros_like(da)).to(dtype)
        carry = torch.where(alive, dh * z, torch.zeros_like(carry))
        dgates[t] = da
        rec = da.to(acc) @ w
    return dgates, rec + carry, None


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_forward_saving(x: torch.Tensor, params: torch.Tensor, h0: torch.Tensor,
                             c0: torch.Tensor | None, lengths: torch.Tensor | None, *,
                             kind: str = "lstm"):
    """`forward_training` in torch, step by step: h rounded to x's dtype
    between steps and layers, 0 at t >= length, as the kernel writes them."""
    if kind == "gru":
        return _gru_reference_forward_saving(x, params, h0, lengths)
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    acc = _accumulation(x.dtype)
    views = _layer_views(params, num_layers, units, input_size)
    nb = sum(4 * units * (w_ih.shape[1] + units) for w_ih, _ in views)
    lens = torch.full((batch,), steps, device=x.device) if lengths is None else lengths.to(x.device)
    alive = (torch.arange(steps, device=x.device)[:, None] < lens[None, :])[..., None]
    gates = x.new_empty((num_layers, steps, batch, 4 * units), dtype=acc)
    cseq = x.new_empty((num_layers, steps, batch, units), dtype=acc)
    seqs, hy, cy = [], torch.empty_like(h0), torch.empty_like(c0)
    inp = x
    for l, (w_ih, w_hh) in enumerate(views):
        b = (params[nb + 8 * units * l: nb + 8 * units * l + 4 * units].to(acc)
             + params[nb + 8 * units * l + 4 * units: nb + 8 * units * (l + 1)].to(acc))
        xp = inp.to(acc) @ w_ih.to(acc).t() + b
        h, c = h0[l], c0[l].to(acc)
        out = x.new_empty((steps, batch, units))
        for t in range(steps):
            pre = xp[t] + h.to(acc) @ w_hh.to(acc).t()
            a_i, a_f, a_g, a_o = pre.chunk(4, dim=1)
            i, f, g, o = torch.sigmoid(a_i), torch.sigmoid(a_f), torch.tanh(a_g), torch.sigmoid(a_o)
            c = f * c + i * g
            h_new = (o * torch.tanh(c)).to(x.dtype)
            gates[l, t] = torch.cat([i, f, g, o], dim=1)
            cseq[l, t] = c
            out[t] = torch.where(alive[t], h_new, torch.zeros_like(h_new))
            last = (t == lens - 1)[:, None]
            hy[l] = torch.where(last, h_new, hy[l])
            cy[l] = torch.where(last, c.to(x.dtype), cy[l])
            h = out[t]
        seqs.append(out)
        inp = out
    return seqs[-1], hy, cy, (_lower_sequences(seqs, x), gates, cseq)


def _gru_reference_forward_saving(x, params, h0, lengths):
    """`reference_forward_saving` of a GRU stack: (y, hy, None, (hseq,
    gates, hprev))."""
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    acc = _accumulation(x.dtype)
    views = _layer_views(params, num_layers, units, input_size, gates=3)
    nb = sum(3 * units * (w_ih.shape[1] + units) for w_ih, _ in views)
    lens = torch.full((batch,), steps, device=x.device) if lengths is None else lengths.to(x.device)
    alive = (torch.arange(steps, device=x.device)[:, None] < lens[None, :])[..., None]
    gates = x.new_empty((num_layers, steps, batch, 4 * units), dtype=acc)
    hprev = x.new_empty((num_layers, steps, batch, units), dtype=acc)
    seqs, hy = [], torch.empty_like(h0)
    inp = x
    for l, (w_ih, w_hh) in enumerate(views):
        b = params[nb + 6 * units * l: nb + 6 * units * (l + 1)].to(acc)
        b_ih, b_hh = b[:3 * units], b[3 * units:]
        xp = inp.to(acc) @ w_ih.to(acc).t() + b_ih
        h = h0[l]
        out = x.new_empty((steps, batch, units))
        for t in range(steps):
            hh = h.to(acc) @ w_hh.to(acc).t() + b_hh
            xr, xz, xn = xp[t].chunk(3, dim=1)
            hr, hz, hn = hh.chunk(3, dim=1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h_new = ((1 - z) * n + z * h.to(acc)).to(x.dtype)
            gates[l, t] = torch.cat([r, z, n, hn], dim=1)
            hprev[l, t] = h.to(acc)
            out[t] = torch.where(alive[t], h_new, torch.zeros_like(h_new))
            last = (t == lens - 1)[:, None]
            hy[l] = torch.where(last, h_new, hy[l])
            h = out[t]
        seqs.append(out)
        inp = out
    return seqs[-1], hy, None, (_lower_sequences(seqs, x), gates, hprev)


def _lower_sequences(seqs: list, x: torch.Tensor) -> torch.Tensor:
    """hseq [L-1, T, B, H]: the output sequences of the layers below the top."""
    if len(seqs) > 1:
        return torch.stack(seqs[:-1])
    steps, batch, units = seqs[0].shape
    return x.new_empty((0, steps, batch, units))


def _layer_views(params: torch.Tensor, num_layers: int, units: int, input_size: int,
                 gates: int = 4):
    """Per layer (w_ih [G*H, n], w_hh [G*H, H]) views of the canonical buffer
    (G = `gates`: 4 for an LSTM, 3 for a GRU)."""
    gh, off, views = gates * units, 0, []
    for l in range(num_layers):
        n = input_size if l == 0 else units
        w_ih = params[off: off + gh * n].view(gh, n)
        w_hh = params[off + gh * n: off + gh * (n + units)].view(gh, units)
        views.append((w_ih, w_hh))
        off += gh * (n + units)
    return views


def backward_stack(params, x, h0, c0, lengths, y, saved, dy, dhy, dcy, *,
                   recurrence=backward_layer, kind: str = "lstm"):
    """The gradients of an LSTM stack's forward (`forward_training`), layer by
    layer from the top: the recurrence on the kernel (`recurrence`), the
    rest as GEMMs (see `_weight_gradients`; dx^l = dgates^l W_ih^l). A GRU
    (`kind`): `_gru_backward_stack`.

    Returns (dx [T, B, I], dparams in the canonical flat layout, dh0, dc0
    [L, B, H]) in x's dtype; dy, dhy, dcy may be None (zero)."""
    if kind == "gru":
        return _gru_backward_stack(params, x, h0, lengths, y, saved, dy, dhy,
                                   recurrence=recurrence)
    hseq, gates, cseq = saved
    steps, batch, input_size = x.shape
    num_layers = h0.shape[0]
    views = _layer_views(params, num_layers, h0.shape[2], input_size)
    dy, dhy, dcy, lens = _upstream(x.dtype, y, h0, c0, dy, dhy, dcy, lengths)
    mats, biases = [None] * num_layers, [None] * num_layers
    dh0, dc0 = torch.empty_like(h0), torch.empty_like(c0)
    grad = dy  # of layer l's output sequence
    for l in reversed(range(num_layers)):
        w_ih, w_hh = views[l]
        dgates, dh0_l, dc0_l = recurrence(w_hh.contiguous(), gates[l], cseq[l],
                                          c0[l].contiguous(), grad, dhy[l], dcy[l], lens)
        dh0[l], dc0[l] = dh0_l.to(x.dtype), dc0_l.to(x.dtype)
        mats[l], biases[l] = _weight_gradients(dgates, l, x, h0, y, hseq)
        inputs = w_ih.shape[1]
        grad = (dgates.view(steps * batch, -1) @ w_ih).view(steps, batch, inputs)
    return grad, torch.cat(mats + biases), dh0, dc0


def _gru_backward_stack(params, x, h0, lengths, y, saved, dy, dhy, *, recurrence):
    """`backward_stack` of a GRU stack. Each layer's dgates [T, B, 4H] =
    (dr, dz, dn_x, dn_h): the input side's gradient is (dr, dz, dn_x), the
    recurrent side's (dr, dz, dn_h). Returns (dx, dparams, dh0, None)."""
    hseq, gates, hprev = saved
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    views = _layer_views(params, num_layers, units, input_size, gates=3)
    dy, dhy, _, lens = _upstream(x.dtype, y, h0, h0, dy, dhy, None, lengths)
    mats, biases = [None] * num_layers, [None] * num_layers
    dh0 = torch.empty_like(h0)
    grad = dy  # of layer l's output sequence
    for l in reversed(range(num_layers)):
        w_ih, w_hh = views[l]
        dgates, dh0_l, _ = recurrence(w_hh.contiguous(), gates[l], hprev[l], None, grad,
                                      dhy[l], None, lens, kind="gru")
        dh0[l] = dh0_l.to(x.dtype)
        inp = x if l == 0 else hseq[l - 1]
        out = y if l == num_layers - 1 else hseq[l]
        dg = dgates.reshape(steps * batch, 4 * units)
        d_in, d_rec = dg[:, :3 * units], torch.cat([dg[:, :2 * units], dg[:, 3 * units:]], 1)
        h_prev = torch.cat([h0[l:l + 1], out[:-1]]).view(steps * batch, units)
        d_w_ih = d_in.t() @ inp.reshape(steps * batch, inp.shape[-1])
        d_w_hh = d_rec.t() @ h_prev
        acc = _accumulation(x.dtype)
        mats[l] = torch.cat([d_w_ih.reshape(-1), d_w_hh.reshape(-1)])
        biases[l] = torch.cat([d_in.sum(0, dtype=acc).to(x.dtype),
                               d_rec.sum(0, dtype=acc).to(x.dtype)])
        grad = (d_in @ w_ih).view(steps, batch, w_ih.shape[1])
    return grad, torch.cat(mats + biases), dh0, None


def _upstream(dtype, y, h0, c0, dy, dhy, dcy, lengths):
    """The backward's incoming gradients (dy, dhy, dcy: zeros where None,
    else contiguous in `dtype`) and lengths (int32 or None)."""
    dy = torch.zeros_like(y) if dy is None else dy.to(dtype).contiguous()
    dhy = torch.zeros_like(h0) if dhy is None else dhy.to(dtype).contiguous()
    dcy = torch.zeros_like(c0) if dcy is None else dcy.to(dtype).contiguous()
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else None
    return dy, dhy, dcy, lens


def _weight_gradients(dgates, l, x, h0, y, hseq):
    """Layer l's (dW_ih and dW_hh flattened, db twice for b_ih and b_hh) from
    its dgates [T, B, 4H]: dW_ih = dgates^T x^l, dW_hh = dgates^T [h0,
    h_0..h_{T-2}], db = the sum of dgates (accumulated in float32)."""
    steps, batch = x.shape[0], x.shape[1]
    units = h0.shape[2]
    inp = x if l == 0 else hseq[l - 1]
    out = y if l == h0.shape[0] - 1 else hseq[l]
    dg = dgates.reshape(steps * batch, 4 * units)
    h_prev = torch.cat([h0[l:l + 1], out[:-1]]).view(steps * batch, units)
    d_w_ih = dg.t() @ inp.reshape(steps * batch, inp.shape[-1])
    d_w_hh = dg.t() @ h_prev
    d_b = dg.sum(0, dtype=_accumulation(x.dtype)).to(x.dtype)
    return torch.cat([d_w_ih.reshape(-1), d_w_hh.reshape(-1)]), torch.cat([d_b, d_b])


def backward_stack_kernel(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths, *,
                          check: bool = False, variant: int | None = None):
    """Every layer's backward recurrence of an LSTM stack in ONE launch of the
    reverse-wavefront kernel (wavefront.cuh, "The stack backward").

    params: the canonical flat buffer (layer 0's W_ih not read); gates
    [L, T, B, 4H], cseq [L, T, B, H] float32 (`forward_training`'s); c0,
    dhy, dcy [L, B, H] and dy [T, B, H] (the TOP layer's output gradient) in
    the element type; lengths int32 [B] or None. Returns (dgates [L, T, B,
    4H], 0 at t >= length; dh0, dc0 [L, B, H] float32). `check`: synchronise
    and raise `library.WavefrontError` if a wait timed out (a bug).
    `variant`: None (the library's `STACK_BACKWARD_VARIANT`), 0, 1 or 2.
    `stack_recurrence_reference` is the same in torch."""
    library = _library()
    if variant is None:
        variant = library.STACK_BACKWARD_VARIANT
    num_layers, steps, batch, units = cseq.shape
    dgates = dy.new_empty((num_layers, steps, batch, 4 * units))
    dh0 = torch.empty((num_layers, batch, units), dtype=torch.float32, device=dy.device)
    dc0 = torch.empty_like(dh0)
    lib = library.load()
    workspace = torch.empty(lib.backward_stack_workspace_bytes(num_layers, units, batch, steps),
                            dtype=torch.uint8, device=dy.device)
    tensors = (params, gates, cseq, c0, dy, dhy, dcy)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("backward_stack_kernel: every tensor must be contiguous")
    lib.backward_stack(launch_stream(dy.device), str(dy.dtype).replace("torch.", ""),
                       num_layers, units, batch, steps, input_size,
                       params=params.data_ptr(), gates=gates.data_ptr(), cseq=cseq.data_ptr(),
                       c0=c0.data_ptr(), dy=dy.data_ptr(), dhy=dhy.data_ptr(),
                       dcy=dcy.data_ptr(),
                       lengths=lengths.data_ptr() if lengths is not None else 0,
                       dgates=dgates.data_ptr(), dh0=dh0.data_ptr(), dc0=dc0.data_ptr(),
                       workspace=workspace.data_ptr(), variant=variant)
    if check:
        word = workspace.view(torch.int32)[library.STACK_TIMEOUT_WORD].item()
        if word != 0:
            raise library.WavefrontError(
                "the reverse-wavefront backward's wait timed out (a bug): the results are wrong")
    return dgates, dh0, dc0


def stack_recurrence_reference(params, input_size, gates, cseq, c0, dy, dhy, dcy, lengths):
    """`backward_stack_kernel` in torch (any device): per layer from the top,
    `recurrence_reference` with dy^l = dgates^{l+1} W_ih^{l+1} kept in the
    accumulation dtype, as the kernel keeps it in float32."""
    num_layers, steps, batch, units = cseq.shape
    acc = _accumulation(dy.dtype)
    views = _layer_views(params, num_layers, units, input_size)
    dgates = dy.new_empty((num_layers, steps, batch, 4 * units))
    dh0 = torch.empty((num_layers, batch, units), dtype=acc, device=dy.device)
    dc0 = torch.empty_like(dh0)
    grad = dy
    for l in reversed(range(num_layers)):
        dg, dh0[l], dc0[l] = recurrence_reference(views[l][1], gates[l], cseq[l], c0[l], grad,
                                                  dhy[l], dcy[l], lengths, dtype=dy.dtype)
        dgates[l] = dg
        if l > 0:
            grad = dg.to(acc) @ views[l][0].to(acc)
    return dgates, dh0, dc0


def backward_stack_wavefront(params, x, h0, c0, lengths, y, saved, dy, dhy, dcy, *,
                             recurrence=backward_stack_kernel):
    """`backward_stack` with every layer's recurrence in ONE launch
    (`recurrence`: `backward_stack_kernel`, or a reference in tests), then
    the GEMMs; the layers' dx above the first stay inside the kernel."""
    hseq, gates, cseq = saved
    steps, batch, input_size = x.shape
    num_layers, _, units = h0.shape
    dy, dhy, dcy, lens = _upstream(x.dtype, y, h0, c0, dy, dhy, dcy, lengths)
    dgates, dh0, dc0 = recurrence(params.contiguous(), input_size, gates.contiguous(),
                                  cseq.contiguous(), c0.contiguous(), dy, dhy, dcy, lens)
    mats, biases = zip(*(_weight_gradients(dgates[l], l, x, h0, y, hseq)
                         for l in range(num_layers)))
    w_ih0 = _layer_views(params, num_layers, units, input_size)[0][0]
    dx = (dgates[0].reshape(steps * batch, 4 * units) @ w_ih0).view(steps, batch, input_size)
    return dx, torch.cat(mats + biases), dh0.to(x.dtype), dc0.to(x.dtype)


class _TrainableLSTM(torch.autograd.Function):
    """forward: `saving` (the kernel saving gates and c); backward:
    `stack_backward` with `recurrence`."""

    @staticmethod
    def forward(ctx, x, params, h0, c0, lengths, saving, recurrence, stack_backward):
        y, hy, cy, saved = saving(x, params, h0, c0, lengths)
        ctx.save_for_backward(x, params, h0, c0, y, *saved)
        ctx.lengths, ctx.recurrence, ctx.stack_backward = lengths, recurrence, stack_backward
        return y, hy, cy

    @staticmethod
    def backward(ctx, dy, dhy, dcy):
        x, params, h0, c0, y, *saved = ctx.saved_tensors
        dx, dparams, dh0, dc0 = ctx.stack_backward(params, x, h0, c0, ctx.lengths, y, saved, dy,
                                                   dhy, dcy, recurrence=ctx.recurrence)
        return dx, dparams, dh0, dc0, None, None, None, None


class _TrainableGRU(torch.autograd.Function):
    """`_TrainableLSTM` for a GRU stack (no c0, no cy; one backward launch a layer)."""

    @staticmethod
    def forward(ctx, x, params, h0, lengths, saving, recurrence):
        y, hy, _, saved = saving(x, params, h0, None, lengths)
        ctx.save_for_backward(x, params, h0, y, *saved)
        ctx.lengths, ctx.recurrence = lengths, recurrence
        return y, hy

    @staticmethod
    def backward(ctx, dy, dhy):
        x, params, h0, y, *saved = ctx.saved_tensors
        dx, dparams, dh0, _ = backward_stack(params, x, h0, None, ctx.lengths, y, saved, dy, dhy,
                                             None, recurrence=ctx.recurrence, kind="gru")
        return dx, dparams, dh0, None, None, None


def trainable_forward(x: torch.Tensor, params: torch.Tensor, h0: torch.Tensor,
                      c0: torch.Tensor | None, lengths: torch.Tensor | None = None, *,
                      saving=None, recurrence=None, backward: str = "auto",
                      kind: str = "lstm"):
    """An LSTM or GRU stack on the kernel with the kernel's gradient (autograd).

    Like `forward`, differentiable with respect to x, params (so the tensors
    `flat_params` concatenated), h0 and c0. `backward`: "auto" (the reverse
    wavefront backward where `library.backward_stack_reason` accepts the
    stack, else "layer"), "layer" or "stack" (LSTM only). `saving` and
    `recurrence` replace the forward kernel and the backward's recurrence
    (the CPU tests' torch versions). Outside the kernels' limits it raises
    `library.WavefrontError` (`training_reason` says so beforehand).

    Raises:
        ValueError: an LSTM's c0 is None, an unknown `backward`, or a GRU's
            "stack".

    Example (on a Hopper GPU):

        >>> lstm = torch.nn.LSTM(512, 512, 4).cuda().half()  # doctest: +SKIP
        >>> y, hy, cy = trainable_forward(x, flat_params(lstm), h0, c0)  # doctest: +SKIP
        >>> (y.float().square().sum()).backward()  # doctest: +SKIP"""
    if kind not in _GATES:
        raise ValueError(f"trainable_forward: kind must be one of {tuple(_GATES)}; "
                         f"received {kind!r}")
    if kind == "lstm" and c0 is None:
        raise ValueError("trainable_forward: an LSTM needs c0")
    choice = backward_choice(x, h0, backward, kind=kind)
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else None
    if kind == "gru":
        if choice.backward == "stack":
            raise ValueError("trainable_forward: backward='stack' (the reverse-wavefront "
                             "backward) runs LSTM stacks only; a GRU runs backward='layer' "
                             "or 'auto'")
        y, hy = _TrainableGRU.apply(x.contiguous(), params.contiguous(), h0.contiguous(), lens,
                                    saving or functools.partial(forward_training, kind="gru"),
                                    recurrence or backward_layer)
        return y, hy, None
    if choice.backward == "stack":
        stack_backward, recurrence = backward_stack_wavefront, recurrence or backward_stack_kernel
    else:
        stack_backward, recurrence = backward_stack, recurrence or backward_layer
    return _TrainableLSTM.apply(x.contiguous(), params.contiguous(), h0.contiguous(),
                                c0.contiguous(), lens, saving or forward_training,
                                recurrence, stack_backward)


def backward_choice(x: torch.Tensor, h0: torch.Tensor, backward: str = "auto", *,
                    kind: str = "lstm"):
    """The backward `trainable_forward` runs for x and h0 on x's device
    (`library.choose_backward`: which, and why).

    Raises:
        ValueError: `backward` is not "auto", "layer" or "stack"."""
    library = _library()
    library.check_backward(backward, "trainable_forward: backward")
    steps, batch = int(x.shape[0]), int(x.shape[1])
    num_layers, units = int(h0.shape[0]), int(h0.shape[2])
    unavailable = _stack_unavailable(x.device) if backward == "auto" else None
    ordinal = 0
    if backward == "auto" and unavailable is None:
        ordinal = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return library.choose_backward(backward, kind, num_layers, units, batch, steps, ordinal,
                                   unavailable=unavailable)


def _stack_unavailable(device: torch.device) -> str | None:
    """Why no reverse-wavefront backward can run on `device` whatever the
    shape (not a CUDA device), or None."""
    if device.type != "cuda":
        return "the reverse-wavefront backward runs on CUDA devices only"
    return None


def training_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                    input_size: int, dtype: torch.dtype, device: torch.device,
                    **structure) -> str | None:
    """Why `trainable_forward` cannot run this stack here, or None: the
    forward's `unsupported_reason`, then the backward kernel's."""
    return (unsupported_reason(kind, num_layers, units, batch, steps, input_size, dtype, device,
                               **structure)
            or _backward_reason(kind, units, batch, steps, device))


def _backward_reason(kind: str, units: int, batch: int, steps: int,
                     device: torch.device) -> str | None:
    """`library.backward_reason` on `device` (a CUDA device the forward's
    checks accepted)."""
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    return library_reason("backward_reason", kind, units, batch, steps, ordinal)


def run_trainable(sequences, call):
    """`run_stack` for training: the kernel's forward and backward (the
    gradient reaches the Keras variables through `pack_params`); the
    `KernelRun`'s algorithm names the backward ("backward=stack" or "=layer").

    Raises:
        NotImplementedError: the kernels cannot run this call (the reason)."""
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    x, params, h0, c0, lengths = _kernel_inputs(sequences, call, training=True)
    choice = backward_choice(x, h0, kind=call.stack.kind)
    y, hy, cy = trainable_forward(x, params, h0, c0, lengths, backward=choice.backward,
                                  kind=call.stack.kind)
    return StackRun(y.transpose(0, 1), hy, cy,
                    KernelRun(TRAINING_KERNEL_NAME, f"backward={choice.backward}"))


def _kernel_inputs(sequences, call, *, training: bool):
    """(x [T, B, I], params, h0, c0 or None, lengths or None) for a
    `StackCall`, after the forward's (and with `training` the backward's)
    checks.

    Raises:
        NotImplementedError: the kernels cannot run this call (the reason)."""
    from rnnfuse.backends import torch as kernels

    stack, mask = call.stack, call.mask
    x = sequences
    batch, steps, input_size = (int(d) for d in x.shape)
    reason = unsupported_reason(
        stack.kind, stack.num_levels, stack.units, batch, steps, input_size, x.dtype, x.device,
        directions=stack.num_directions, proj_size=stack.proj_size,
        summed_inputs=any(stack.input_scale(i) is not None for i in range(stack.num_levels)),
        dropout=call.dropout)
    if reason is None and training:
        reason = _backward_reason(stack.kind, stack.units, batch, steps, x.device)
    if reason is not None:
        raise NotImplementedError(reason)
    lengths = None
    if mask is not None:
        lengths = torch.as_tensor(mask, device=x.device).to(torch.int32).sum(dim=1)
    if call.reverse:
        full = lengths if lengths is not None else torch.full((batch,), steps, device=x.device)
        x = kernels._reverse_within_lengths(x, full)
    params = flat_params(kernels.pack_params(stack, x.dtype, x.device))
    h0 = kernels._states(call.initial_h, stack, stack.units, batch, x)
    c0 = (kernels._states(call.initial_c, stack, stack.units, batch, x)
          if stack.kind == "lstm" else None)
    return x.transpose(0, 1), params, h0, c0, lengths


def run_stack(sequences, call):
    """`rnnfuse.backends.torch.run_stack` on the wavefront kernel, inference
    only; `seed`, `algorithm`, `kernel` and `training` are not read.

    Raises:
        NotImplementedError: the kernel cannot run this call (the reason)."""
    from rnnfuse.backends.base import StackRun
    from rnnfuse.reasons import KernelRun

    x, params, h0, c0, lengths = _kernel_inputs(sequences, call, training=False)
    y, hy, cy = forward(x.contiguous(), params, h0, c0, lengths, kind=call.stack.kind)
    return StackRun(y.transpose(0, 1), hy, cy, KernelRun(KERNEL_NAME))


def run_autograd(sequences, call):
    """`run_trainable` where autograd will want a gradient of this call
    (`wants_gradient`), else `run_stack`. Unidirectional stacks only.

    Raises:
        NotImplementedError: the kernels cannot run this call; the caller
            runs cuDNN."""
    if wants_gradient(sequences, call.stack, call.initial_h, call.initial_c):
        return run_trainable(sequences, call)
    return run_stack(sequences, call)


def wants_gradient(sequences, stack, initial_h=None, initial_c=None) -> bool:
    """Whether autograd records this call: gradients are on and the input,
    an initial state or a variable of the stack requires a gradient."""
    if not torch.is_grad_enabled():
        return False
    variables = [w.value for level in stack.cells for cell in level for w in cell.weights]
    tensors = [sequences, *(initial_h or []), *(initial_c or []), *variables]
    return any(getattr(t, "requires_grad", False) for t in tensors)


def reference_forward(kind: str, weights: Sequence[torch.Tensor], x: torch.Tensor,
                      h0: torch.Tensor, c0: torch.Tensor | None,
                      lengths: torch.Tensor | None = None):
    """The stack in float64 with cuDNN's rules for lengths (the tests'
    reference): `weights` PyTorch's per-layer list, x [T, B, I]; returns
    (y, hy, cy or None)."""
    steps, batch, _ = x.shape
    w = [t.double() for t in weights]
    layers, units = len(w) // 4, w[1].shape[1]
    inp = x.double()
    if lengths is None:
        lengths = torch.full((batch,), steps, device=x.device)
    alive = torch.arange(steps, device=x.device)[:, None] < lengths.to(x.device)[None, :]
    hy, cy = [], []
    for l in range(layers):
        w_ih, w_hh, b_ih, b_hh = w[4 * l: 4 * l + 4]
        xp = inp @ w_ih.t() + b_ih
        h = h0[l].double().clone()
        c = c0[l].double().clone() if kind == "lstm" else None
        out = torch.zeros(steps, batch, units, dtype=torch.float64, device=x.device)
        for t in range(steps):
            hh = h @ w_hh.t() + b_hh
            if kind == "lstm":
                i, f, g, o = (xp[t] + hh).chunk(4, dim=1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
            else:
                xr, xz, xn = xp[t].chunk(3, dim=1)
                hr, hz, hn = hh.chunk(3, dim=1)
                r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
                h_new = (1 - z) * torch.tanh(xn + r * hn) + z * h
            a = alive[t][:, None]
            h = torch.where(a, h_new, h)
            if kind == "lstm":
                c = torch.where(a, c_new, c)
            out[t] = torch.where(a, h_new, torch.zeros_like(h_new))
        inp = out
        hy.append(h)
        cy.append(c)
    return inp, torch.stack(hy), (torch.stack(cy) if kind == "lstm" else None)
