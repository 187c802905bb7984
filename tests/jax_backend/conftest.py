"""Tests of the JAX backend: collected only under KERAS_BACKEND=jax.

    KERAS_BACKEND=jax .venv/bin/python -m pytest -q tests/jax_backend

The cuDNN core's FFI calls have no CPU lowering, so on the CPU the
`emulated_core` fixture puts an emulation of its targets
(core_emulation.py: cuDNN's equations in jax.numpy) in place of the calls
and says the backend is available. The GPU tests
(tests/gpu/test_gpu_core_jax.py) run the real calls.
"""

from __future__ import annotations

import keras
import pytest

if keras.backend.backend() != "jax":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def emulated_core(monkeypatch):
    """The core's FFI targets -> their emulation; records each call
    (`.calls`: (target, attributes); `.stacks`: one dict a forward)."""
    import core_emulation

    return core_emulation.install(monkeypatch)


@pytest.fixture(autouse=True)
def _restores_matmul_precision():
    """`rnnfuse check`'s exact float32 sets JAX's matmul precision for its
    process; a test that runs it in this one must not leak it to the next."""
    import jax

    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)
