"""Recurrent layers rnnfuse adds to Keras: `ProjectedLSTM` and its cell,
an LSTM with a recurrent projection, registered for Keras serialization.

>>> import numpy as np
>>> layer = ProjectedLSTM(8, proj_size=3, return_sequences=True)
>>> tuple(layer(np.zeros((2, 5, 4), "float32")).shape)
(2, 5, 3)
"""

from rnnfuse.layers.projected_lstm import ProjectedLSTM, ProjectedLSTMCell

__all__ = ["ProjectedLSTM", "ProjectedLSTMCell"]
