"""Tests of the JAX backend: collected only under KERAS_BACKEND=jax.

    KERAS_BACKEND=jax .venv/bin/python -m pytest -q tests/jax_backend

jax.experimental.rnn's cuDNN call has no CPU lowering, so on the CPU the
`emulated_jax_lstm` fixture puts its own reference implementation
(`jax.experimental.rnn.lstm_ref`, fed the blob through
`unpack_lstm_weights`, i.e. the same layout cuDNN reads) in place of the
call and says the backend is available. The GPU tests
(tests/gpu/test_gpu_jax.py) run the real call.
"""

from __future__ import annotations

import keras
import pytest

if keras.backend.backend() != "jax":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def emulated_jax_lstm(monkeypatch):
    """jax.experimental.rnn.lstm -> its reference; records each call."""
    from jax.experimental import rnn

    from rnnfuse.backends import jax as jax_backend

    calls = []

    def reference(x, h0, c0, blob, lengths, *, input_size, hidden_size, num_layers, dropout,
                  bidirectional):
        calls.append(dict(num_layers=num_layers, bidirectional=bidirectional,
                          blob_size=int(blob.shape[0])))
        w_ih, w_hh, b_ih, b_hh = rnn.unpack_lstm_weights(
            blob, input_size, hidden_size, num_layers, bidirectional
        )
        return rnn.lstm_ref(x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, input_size,
                            hidden_size, num_layers, dropout, bidirectional)

    monkeypatch.setattr(jax_backend, "jax_lstm", reference)
    monkeypatch.setattr(jax_backend, "is_available", lambda: True)
    return calls
