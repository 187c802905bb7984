"""Tests of the PyTorch backend: collected only under KERAS_BACKEND=torch.

Run them with (torch==2.13.0, the CPU build, in the venv):

    KERAS_BACKEND=torch .venv/bin/python -m pytest -q tests/torch

Under any other Keras backend the files here are not collected at all (they
import torch, which a TensorFlow-only environment need not have).

On the CPU these tests run the real fused kernels (PyTorch's CPU
implementations of `torch._VF.lstm/gru/rnn_*`), not an emulation.
"""

from __future__ import annotations

import keras
import pytest

if keras.backend.backend() != "torch":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def torch_calls(monkeypatch):
    """Records every `torch._VF` call the torch backend makes.

    Yields a list of dicts (mode, packed, params, num_layers, dropout, train,
    bidirectional); the calls still run.
    """
    from torch_checks import vf_call

    from rnnfuse.backends import torch as torch_backend

    calls = []
    real = torch_backend.torch_rnn

    def spy(mode, *args):
        calls.append(vf_call(mode, args))
        return real(mode, *args)

    monkeypatch.setattr(torch_backend, "torch_rnn", spy)
    yield calls


def _fake_device(monkeypatch, steps):
    """The tuner sees `torch_checks.FAKE_GPU_ENV` and builds its candidates'
    steps with `steps` (in place of `tuner._steps`)."""
    from torch_checks import FAKE_GPU_ENV

    from rnnfuse.tuning import first_batch, per_shape, tuner

    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(FAKE_GPU_ENV))
    monkeypatch.setattr(per_shape, "device_environment", lambda: dict(FAKE_GPU_ENV))
    monkeypatch.setattr(tuner, "_steps", steps)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A device to 'time' on; the candidates' steps are never built (the
    test's timer is a fake)."""
    _fake_device(monkeypatch, lambda group, plans, *a, **k: {p.name: None for p in plans})


@pytest.fixture
def fake_gpu_online(monkeypatch):
    """A device to time on where any timing apart from the fit's own steps
    fails the test. Returns the arguments of each such timing (the tuner
    may catch the failure)."""
    timed_apart = []

    def no_offline_timing(*args, **kwargs):
        timed_apart.append(args)
        raise AssertionError("timed apart from the fit")

    _fake_device(monkeypatch, no_offline_timing)
    return timed_apart


def pytest_collection_modifyitems(config, items):
    # Keras' torch convert_to_numpy calls np.array(tensor); NumPy 2 warns
    # that torch's __array__ takes no `copy`. Not ours; keep the output clean.
    here = "tests/torch_backend/"
    quiet = pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    )
    for item in items:
        if here in str(item.fspath).replace("\\", "/"):
            item.add_marker(quiet)
