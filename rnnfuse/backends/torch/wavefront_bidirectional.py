"""torch binding of bidirectional layers on rnnfuse's wavefront kernel.

Layer l + 1 needs both directions of layer l whole, so there is no
wavefront across bidirectional layers; a layer's two directions run in one
launch on disjoint CTAs instead (wavefront.cuh, "Independent layers").
Per layer, time-major:

1. xproj = inp W_ih^T for both directions as one matmul ([T, B, 2 G H]),
   direction 1's reversed within each row's length
   (`reverse_within_lengths`), so both run forward in time;
2. one launch: y [2, T, B, H], hy, cy [2, B, H] from the layer's canonical
   buffer (`flat_params` of its forward, then backward weights);
3. direction 1's output reversed back, the two concatenated ([T, B, 2H]).

`forward` has no gradient; `trainable_forward` is the training form (each
direction of each layer a one-layer `wavefront.trainable_forward`, the two
directions on two CUDA streams).
`run_stack` is the backend's call.

Example (on a Hopper GPU, with library.BIDIRECTIONAL on):

    >>> lstm = torch.nn.LSTM(80, 384, 4, bidirectional=True)  # doctest: +SKIP
    >>> y, hy, cy = forward(x, lstm.cuda().half()._flat_weights, h0, c0, None,
    ...                     kind="lstm")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from rnnfuse.backends.base import GATES
from rnnfuse.backends.torch import streams
from rnnfuse.backends.torch.streams import launch_stream
from rnnfuse.backends.torch.wavefront import flat_params, library_reason

__all__ = ["KERNEL_NAME", "TRAINING_ALGORITHM", "forward", "reverse_within_lengths",
           "run_stack", "trainable_forward", "training_reason", "unsupported_reason"]

# The `KernelRun` name of a call on the kernel.
KERNEL_NAME = "torch.ops.rnnfuse.wavefront_directions"
# ... and the algorithm of a training call's (`trainable_forward`).
TRAINING_ALGORITHM = "bidirectional: a launch a direction"


def _library():
    from rnnfuse.backends.cuda import library

    return library


def reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """x [T, B, ...] with each row's first len steps reversed (t -> len - 1
    - t) and its padded steps where they are (None: every row T long).

    >>> x = torch.arange(4.0).view(4, 1, 1).expand(4, 2, 1)
    >>> reverse_within_lengths(x, torch.tensor([4, 2]))[:, :, 0].t().tolist()
    [[3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 2.0, 3.0]]"""
    steps = x.shape[0]
    if lengths is None:
        return x.flip(0)
    t = torch.arange(steps, device=x.device)[:, None]
    lens = lengths.to(device=x.device, dtype=torch.long)[None, :]
    index = torch.where(t < lens, lens - 1 - t, t)  # [T, B]
    index = index.view(steps, -1, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 0, index)


@torch.library.custom_op("rnnfuse::wavefront_directions", mutates_args=())
def _directions_op(xproj: torch.Tensor, params: torch.Tensor, h0: torch.Tensor,
                   c0: torch.Tensor, lengths: torch.Tensor, kind: str, input_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    directions, steps, batch, gh = xproj.shape
    units = gh // GATES[kind]
    y = xproj.new_empty((directions, steps, batch, units))
    hy = torch.empty_like(h0)
    cy = torch.empty_like(h0) if kind == "lstm" else h0.new_empty((0,))
    lib = _library().load()
    workspace = torch.empty(lib.directions_workspace_bytes(directions), dtype=torch.uint8,
                            device=xproj.device)
    for t in (xproj, params, h0, y, hy) + ((c0, cy) if kind == "lstm" else ()):
        if not t.is_contiguous() or t.dtype != xproj.dtype or t.device != xproj.device:
            raise ValueError("wavefront_directions: every tensor must be contiguous, of "
                             f"xproj's dtype and device ({xproj.dtype}, {xproj.device})")
    lib.forward_directions(
        launch_stream(xproj.device), str(xproj.dtype).replace("torch.", ""), kind, units,
        batch, steps, input_size, xproj=xproj.data_ptr(), params=params.data_ptr(),
        h0=h0.data_ptr(), c0=c0.data_ptr() if kind == "lstm" else 0,
        lengths=lengths.data_ptr() if lengths.numel() else 0, y=y.data_ptr(),
        hy=hy.data_ptr(), cy=cy.data_ptr() if kind == "lstm" else 0,
        workspace=workspace.data_ptr(), directions=directions)
    return y, hy, cy


@_directions_op.register_fake
def _(xproj, params, h0, c0, lengths, kind, input_size):
    directions, steps, batch, gh = xproj.shape
    cy = torch.empty_like(h0) if kind == "lstm" else h0.new_empty((0,))
    return (xproj.new_empty((directions, steps, batch, gh // GATES[kind])),
            torch.empty_like(h0), cy)


def _checked_weights(weights: Sequence[torch.Tensor], where: str) -> list[torch.Tensor]:
    """`weights` as a list of 8 tensors a layer; ValueError naming `where`."""
    weights = list(weights)
    if not weights or len(weights) % 8:
        raise ValueError(f"wavefront_bidirectional.{where}: expected [w_ih, w_hh, b_ih, b_hh] "
                         f"for each direction of each layer; received {len(weights)} tensors")
    return weights


def forward(x: torch.Tensor, weights: Sequence[torch.Tensor], h0: torch.Tensor,
            c0: torch.Tensor | None, lengths: torch.Tensor | None, *, kind: str):
    """A bidirectional stack, one launch a layer (see the module doc).

    x [T, B, I]; weights: PyTorch's [w_ih, w_hh, b_ih, b_hh] per pseudo
    layer (layer-major, forward before backward); h0, c0 [2L, B, H];
    lengths [B] (int, on x's device) or None. Returns (y [T, B, 2H] with
    zeros past each length, hy [2L, B, H], cy [2L, B, H] or None).

    Raises:
        ValueError: weights that are not 8 tensors a layer.
        library.WavefrontError: a launch the library refuses."""
    weights = _checked_weights(weights, "forward")
    layers = len(weights) // 8
    gh = int(weights[0].shape[0])
    lens = (lengths.to(device=x.device, dtype=torch.int32).contiguous() if lengths is not None
            else torch.empty(0, dtype=torch.int32, device=x.device))
    inp, hys, cys = x, [], []
    for l in range(layers):
        w = weights[8 * l:8 * l + 8]
        steps, batch, width = inp.shape
        both = (inp.reshape(steps * batch, width) @ torch.cat([w[0], w[4]]).t()).view(
            steps, batch, 2 * gh)
        xproj = torch.stack([both[..., :gh], reverse_within_lengths(both[..., gh:], lengths)])
        c = c0[2 * l:2 * l + 2].contiguous() if kind == "lstm" else h0.new_empty((0,))
        y, hy, cy = _directions_op(xproj.contiguous(), flat_params(w).contiguous(),
                                   h0[2 * l:2 * l + 2].contiguous(), c, lens, kind, width)
        inp = torch.cat([y[0], reverse_within_lengths(y[1], lengths)], dim=-1)
        hys.append(hy)
        cys.append(cy)
    return inp, torch.cat(hys), (torch.cat(cys) if kind == "lstm" else None)


def _direction(wavefront, inp, weights, h0, c0, lengths, kind, k):
    """Pseudo layer k (direction k % 2) as a one-layer `wavefront.trainable_forward`:
    (y in inp's time order, hy, cy)."""
    src = inp if k % 2 == 0 else reverse_within_lengths(inp, lengths)
    y, hy, cy = wavefront.trainable_forward(
        src, flat_params(weights[4 * k:4 * k + 4]), h0[k:k + 1],
        c0[k:k + 1] if kind == "lstm" else None, lengths, kind=kind)
    return (y if k % 2 == 0 else reverse_within_lengths(y, lengths)), hy, cy


def trainable_forward(x: torch.Tensor, weights: Sequence[torch.Tensor], h0: torch.Tensor,
                      c0: torch.Tensor | None, lengths: torch.Tensor | None, *, kind: str,
                      concurrent: bool = True):
    """`forward` with the kernels' gradient (autograd): each direction of each
    layer a one-layer `wavefront.trainable_forward`, direction 1 over the
    reversed input (no new kernel needed). `concurrent` (on CUDA): direction
    1 on a side stream (`streams.SideStream`), forward and backward, else
    one direction after the other; the same kernels either way.

    Raises:
        ValueError: weights that are not 8 tensors a layer.
        library.WavefrontError: a launch the library refuses."""
    from rnnfuse.backends.torch import wavefront

    weights = _checked_weights(weights, "trainable_forward")
    side = streams.side_stream(x.device) if concurrent else None
    inp, hys, cys = x, [], []
    for l in range(len(weights) // 8):
        run = functools.partial(_direction, wavefront, inp, weights, h0, c0, lengths, kind)
        if side is None:
            outs = [run(2 * l), run(2 * l + 1)]
        else:  # each grid is cooperative (resident whole): where both do not fit, one waits
            side.fork(inp, h0, c0, lengths, *weights[8 * l + 4:8 * l + 8])
            with side.running():
                second = run(2 * l + 1)
            outs = [run(2 * l), second]
            side.join(*second)
        inp = torch.cat([y for y, _, _ in outs], dim=-1)
        hys += [hy for _, hy, _ in outs]
        cys += [cy for _, _, cy in outs]
    return inp, torch.cat(hys), (torch.cat(cys) if kind == "lstm" else None)


def _structure_reason(library, kind: str, dtype: torch.dtype, device: torch.device,
                      proj_size: int, dropout: float) -> tuple[str | None, int | None]:
    """(why not, None) where the kernel never runs this stack here whatever
    the shape, else (None, the device's CUDA ordinal)."""
    reason = library.stack_reason(kind, str(dtype).replace("torch.", ""), proj_size=proj_size,
                                  dropout=dropout)
    if reason is not None:
        return reason, None
    if not library.BIDIRECTIONAL:
        return library.BIDIRECTIONAL_OFF, None
    if device.type != "cuda":
        return "the wavefront kernel runs on CUDA devices only", None
    return None, (device.index if device.index is not None else torch.cuda.current_device())


def training_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                    input_size: int, dtype: torch.dtype, device: torch.device, *,
                    proj_size: int = 0, dropout: float = 0.0) -> str | None:
    """Why `trainable_forward` cannot run this stack here, or None: the
    structure checks, the one-layer forward plans and the backward's."""
    library = _library()
    reason, ordinal = _structure_reason(library, kind, dtype, device, proj_size, dropout)
    if reason is not None:
        return reason
    for width in {int(input_size), 2 * int(units)}:
        reason = library_reason("device_reason", kind, 1, units, batch, steps, width, ordinal)
        if reason is not None:
            return reason
    return library_reason("backward_reason", kind, units, batch, steps, ordinal)


def unsupported_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                       input_size: int, dtype: torch.dtype, device: torch.device, *,
                       proj_size: int = 0, dropout: float = 0.0) -> str | None:
    """Why the kernel cannot run this bidirectional stack here, or None: the
    structure checks, then `library.bidirectional_reason`."""
    library = _library()
    reason, ordinal = _structure_reason(library, kind, dtype, device, proj_size, dropout)
    if reason is not None:
        return reason
    return library_reason("bidirectional_reason", kind, units, batch, steps, input_size, ordinal)


def run_stack(sequences, call):
    """`rnnfuse.backends.torch.run_stack` of a bidirectional stack on the
    kernel: `trainable_forward` where autograd records the call, else
    `forward`.

    Raises:
        NotImplementedError: the kernels cannot run this call; the caller
            runs cuDNN."""
    from rnnfuse.backends import torch as kernels
    from rnnfuse.backends.base import StackRun
    from rnnfuse.backends.torch import wavefront
    from rnnfuse.reasons import KernelRun

    stack = call.stack
    if call.reverse:
        raise NotImplementedError("a bidirectional stack whose first layer reads reversed "
                                  "sequences runs cuDNN")
    x = sequences
    batch, steps, input_size = (int(d) for d in x.shape)
    training = wavefront.wants_gradient(sequences, stack, call.initial_h, call.initial_c)
    check = training_reason if training else unsupported_reason
    reason = check(stack.kind, stack.num_levels, stack.units, batch, steps, input_size, x.dtype,
                   x.device, proj_size=stack.proj_size, dropout=call.dropout)
    if reason is not None:
        raise NotImplementedError(reason)
    lengths = None
    if call.mask is not None:
        lengths = torch.as_tensor(call.mask, device=x.device).to(torch.int32).sum(dim=1)
    weights = kernels.pack_params(stack, x.dtype, x.device)
    h0 = kernels._states(call.initial_h, stack, stack.units, batch, x)
    c0 = (kernels._states(call.initial_c, stack, stack.units, batch, x)
          if stack.kind == "lstm" else None)
    if training:
        y, hy, cy = trainable_forward(x.transpose(0, 1), weights, h0, c0, lengths,
                                      kind=stack.kind)
        return StackRun(y.transpose(0, 1), hy, cy,
                        KernelRun(wavefront.TRAINING_KERNEL_NAME, TRAINING_ALGORITHM))
    y, hy, cy = forward(x.transpose(0, 1).contiguous(), weights, h0, c0, lengths,
                        kind=stack.kind)
    return StackRun(y.transpose(0, 1), hy, cy, KernelRun(KERNEL_NAME))
