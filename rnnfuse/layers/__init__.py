"""Recurrent layers rnnfuse adds to Keras.

- `ProjectedLSTM` / `ProjectedLSTMCell`: an LSTM with a recurrent
  projection (LSTMP, Sak et al. 2014; PyTorch's `nn.LSTM(proj_size=...)`),
  with fast paths on TensorFlow and torch (see `rnnfuse.layers.projected_lstm`;
  the kernels live in `rnnfuse.backends.<framework>.projected_lstm`).

Importing this package registers the layers for Keras serialization
(`rnnfuse>ProjectedLSTM`, `rnnfuse>ProjectedLSTMCell`).

Example:

    >>> import numpy as np
    >>> from rnnfuse.layers import ProjectedLSTM
    >>> layer = ProjectedLSTM(8, proj_size=3, return_sequences=True)
    >>> tuple(layer(np.zeros((2, 5, 4), "float32")).shape)
    (2, 5, 3)
"""

from rnnfuse.layers.projected_lstm import ProjectedLSTM, ProjectedLSTMCell

__all__ = ["ProjectedLSTM", "ProjectedLSTMCell"]
