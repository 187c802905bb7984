"""ProjectedLSTM's torch fast path: one `torch._VF.lstm` call with
`proj_size` (path "torch_fused"), through `rnnfuse.backends.torch.run_stack`.

`reason` says which cells it cannot compute exactly; `run` raises
NotImplementedError for a mask that is not right-padded, and the layer
then runs Keras' generic loop.

Example:

    >>> import keras
    >>> cell = keras.layers.LSTMCell(4)
    >>> cell.proj_size = 4  # as a ProjectedLSTMCell(4, proj_size=4)
    >>> reason(cell)
    'PyTorch needs proj_size < units; received proj_size=4 with units=4'
"""

from __future__ import annotations

import torch
from keras import ops

from rnnfuse.backends.base import ProjectedLSTMCall, StackCall, StackSpec, tanh_sigmoid

__all__ = ["reason", "run"]

MASK_REASON = "the mask is not right-padded, or a sequence is empty"
# PyTorch's own tanh/sigmoid/relu (TorchBackend.activation_functions).
ACTIVATIONS = {"tanh": [torch.tanh], "sigmoid": [torch.sigmoid], "relu": [torch.relu]}


def reason(cell) -> str | None:
    """Why PyTorch's proj_size LSTM cannot compute this cell exactly, or None."""
    from rnnfuse.backends import torch as torch_backend

    if not tanh_sigmoid(cell, ACTIVATIONS):
        return "PyTorch's fused LSTM computes only tanh and sigmoid activations"
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    return torch_backend.unsupported_reason(stack, cell.compute_dtype)


def run(sequences, initial_state, mask, call: ProjectedLSTMCall):
    """((last_output, outputs, [h, c]), "torch_fused") for one call whose
    cell `reason` accepts; NotImplementedError for a mask it cannot take."""
    from rnnfuse.backends import torch as torch_backend

    # Keras traces shapes on the "meta" device, where a mask has no values
    # (and ops.cond takes its true branch, as this does).
    if mask is not None:
        mask = ops.convert_to_tensor(mask)
        if mask.device.type != "meta" and not bool(torch_backend.mask_is_supported(mask)):
            raise NotImplementedError(MASK_REASON)
    return _inner_loop(call, sequences, initial_state, mask), "torch_fused"


def _inner_loop(call: ProjectedLSTMCall, sequences, initial_state, mask):
    """What `keras.layers.RNN.inner_loop` returns, from one projected
    `torch._VF.lstm` call.

    `run_stack` reverses each sequence within its length, while Keras' loop
    reverses the whole padded sequence (a go_backwards layer first sees the
    padding), so outputs are rearranged to Keras' order; a masked step's
    output is zeros with `zero_output_for_mask`, else the last unmasked one."""
    from rnnfuse.backends import torch as torch_backend

    cell = call.cell
    stack = StackSpec("lstm", cell.units, ((cell,),), proj_size=cell.proj_size)
    outputs, final_h, final_c, _ = torch_backend.run_stack(call.dropped_out(sequences), StackCall(
        stack,
        initial_h=[initial_state[0]],
        initial_c=[initial_state[1]],
        mask=mask,
        reverse=call.go_backwards,
    ))
    h_last, c_last = final_h[0], final_c[0]
    if mask is not None:
        keep = ops.convert_to_tensor(mask).to(device=outputs.device, dtype=torch.bool)
        if call.go_backwards:
            # Valid step j (processed j-th) moves to position T - length + j.
            steps = outputs.shape[1]
            lengths = keep.sum(dim=1, keepdim=True)  # [B, 1]
            source = torch.arange(steps, device=outputs.device)[None] - (steps - lengths)
            gathered = torch.gather(
                outputs, 1, source.clamp(min=0)[:, :, None].expand_as(outputs)
            )
            outputs = torch.where(
                (source >= 0)[:, :, None], gathered, torch.zeros_like(gathered)
            )
        elif not call.zero_output_for_mask:
            # Past its length a row repeats its last output: the final h.
            outputs = torch.where(keep[:, :, None], outputs, h_last[:, None, :])
    return call.inner_loop_result(outputs, h_last, c_last)
