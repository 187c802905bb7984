"""The CUDA stream a torch binding hands to rnnfuse's C-ABI libraries.

    >>> launch_stream(torch.device("cuda", 0))  # doctest: +SKIP
    0
"""

from __future__ import annotations

import torch

__all__ = ["launch_stream"]


def launch_stream(device: torch.device) -> int:
    """torch's current stream on `device` as an int, with the device's context
    current on this thread: autograd's device thread starts without one, and
    a stream query (a runtime call) makes the primary context current."""
    stream = torch.cuda.current_stream(device)
    stream.query()
    return stream.cuda_stream
