"""The CUDA streams a torch binding hands to rnnfuse's C-ABI libraries.

    >>> launch_stream(torch.device("cuda", 0))  # doctest: +SKIP
    0
    >>> side_stream(torch.device("cpu")) is None
    True
"""

from __future__ import annotations

import torch

__all__ = ["SideStream", "launch_stream", "side_stream"]


def launch_stream(device: torch.device) -> int:
    """torch's current stream on `device` as an int, with the device's context
    current on this thread: autograd's device thread starts without one, and
    a stream query (a runtime call) makes the primary context current."""
    stream = torch.cuda.current_stream(device)
    stream.query()
    return stream.cuda_stream


class SideStream:
    """A second stream of a CUDA device for work independent of the current
    stream's: `fork`, work `with side.running()`, more work here, `join`.
    Autograd runs each node's backward on its forward's stream, so the
    backward of the side's work runs there too."""

    def __init__(self, device: torch.device):
        self.current = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)

    def fork(self, *inputs: torch.Tensor | None) -> None:
        """The side waits for the current stream's work so far; `inputs`
        (allocated here, read there, also by the backward) are not reused
        before the side's work on them is done."""
        self.side.wait_stream(self.current)
        for t in inputs:
            if t is not None:
                t.record_stream(self.side)

    def running(self):
        return torch.cuda.stream(self.side)

    def join(self, *outputs: torch.Tensor | None) -> None:
        """The current stream waits for the side's work so far; `outputs`
        (allocated there, read here) likewise."""
        self.current.wait_stream(self.side)
        for t in outputs:
            if t is not None:
                t.record_stream(self.current)


def side_stream(device: torch.device) -> SideStream | None:
    """A `SideStream` of `device`; None (the work runs one piece after the
    other) off CUDA and inside a trace (torch.compile)."""
    eager = device.type == "cuda" and not torch.compiler.is_compiling()
    return SideStream(device) if eager else None
