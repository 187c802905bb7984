"""`StackSpec`: what a backend needs to know about a fused stack.

Example:

    >>> import keras
    >>> cells = ((keras.layers.LSTMCell(4),), (keras.layers.LSTMCell(4),))
    >>> spec = StackSpec(kind="lstm", units=4, cells=cells)
    >>> spec.num_levels, spec.num_directions, spec.num_pseudo_layers
    (2, 1, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["StackSpec", "GATES"]

# Gate matrices per cell kind (cuDNN's "pseudo-layer" has 2*G matrices).
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """A stack of recurrent levels that one fused call runs."""

    # cuDNN cell mode: "lstm", "gru", "rnn_tanh" or "rnn_relu".
    kind: str
    # Width of each cell's state.
    units: int
    # cells[i][d]: the Keras cell of level i, direction d (0 fwd, 1 bwd);
    # backends read each cell's kernel, recurrent_kernel and bias.
    cells: tuple[tuple[Any, ...], ...]
    # Recurrent projection width (0: none).
    proj_size: int = 0
    # Some of the original layers have no Keras cuDNN path (SimpleRNN,
    # RNN(cell), no bias): Keras runs them in its generic loop, whose float32
    # matmuls follow the backend's matmul precision, not cuDNN's (torch:
    # `torch.backends.cuda.matmul.allow_tf32`, False by default, while
    # `torch.backends.cudnn.allow_tf32` is True by default).
    keras_loop: bool = False

    @property
    def num_levels(self) -> int:
        return len(self.cells)

    @property
    def num_directions(self) -> int:
        return len(self.cells[0])

    @property
    def num_pseudo_layers(self) -> int:
        """Levels times directions: the first dimension of cuDNN states."""
        return self.num_levels * self.num_directions

    @property
    def output_size(self) -> int:
        return self.proj_size or self.units
