"""rnnfuse's wavefront kernel through torch on a real Hopper GPU (the H200).

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch:

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_wavefront_torch.py

Every check is bench/bench_wavefront.py's `check_case`: fresh random
weights, inputs, initial states (and lengths), NaN-poisoned outputs, the
kernel's outputs AND final states compared with a float64 reference of the
same rounded weights (`wavefront.reference_forward`) and with cuDNN
(torch.nn.LSTM/GRU in the same dtype), as ||out - ref|| / ||ref||: within
the dtype's tolerance and never more than twice cuDNN's own error. Shapes
outside the kernel's limits must be refused (WavefrontError), never run.
"""

from __future__ import annotations

import os
import random
import sys

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

from rnnfuse.backends.base import StackSpec  # noqa: E402
from rnnfuse.backends.torch import wavefront  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_wavefront  # noqa: E402

pytestmark = pytest.mark.real_gpu_only


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wavefront kernel runs on Hopper (compute capability 9.0)")


def _check(*case, seed):
    """bench_wavefront.check_case: poisoned outputs, float64 and cuDNN."""
    row = bench_wavefront.check_case(*case, seed=seed)
    assert row["status"] == "ok", row


# The benchmark's fixed cases that fit on chip (its last one must fall back).
FIXED = [c for c in bench_wavefront.FIXED_CASES if c[1:3] != (8, 512)]


@pytest.mark.parametrize("case", FIXED, ids=lambda c: "-".join(map(str, c)))
def test_the_kernel_matches_float64_and_cudnn(case):
    _check(*case, seed=random.randrange(10_000))


@pytest.mark.parametrize("case", bench_wavefront.random_cases(9, seed=24),
                         ids=lambda c: "-".join(map(str, c)))
def test_random_shapes_match_float64_and_cudnn_or_are_refused(case):
    """Two in three random shapes fit on chip; the rest must be refused."""
    row = bench_wavefront.check_case(*case, seed=random.randrange(10_000))
    assert row["status"] in ("ok", "fallback"), row


@pytest.mark.parametrize("shape", [("lstm", 8, 512, 64), ("gru", 2, 1024, 64)])
def test_shapes_over_the_limits_are_refused_not_run(shape):
    kind, layers, units, batch = shape
    row = bench_wavefront.check_case(kind, layers, units, batch, 10, units, "float16", False, seed=1)
    assert row["status"] == "fallback" and "do not fit" in row["reason"], row


def test_run_stack_runs_a_keras_stack_from_its_live_variables():
    """The backend entry point: Keras cells packed as the torch backend packs
    them, a right-padded mask as lengths; against the float64 reference of
    the same packed (float16) weights."""
    from rnnfuse.backends import torch as torch_backend

    cells = []
    for i in range(3):
        cell = keras.layers.LSTMCell(256)
        cell.build((None, 64 if i == 0 else 256))
        cells.append((cell,))
    stack = StackSpec("lstm", 256, tuple(cells))
    x = torch.randn(16, 50, 64, device="cuda").half()
    lengths = torch.randint(1, 51, (16,), device="cuda")
    mask = torch.arange(50, device="cuda")[None, :] < lengths[:, None]
    y, hy, cy = wavefront.run_stack(x, stack=stack, mask=mask)
    weights = torch_backend.pack_params(stack, torch.float16, "cuda")
    zeros = torch.zeros(3, 16, 256, device="cuda")
    ref_y, ref_h, ref_c = wavefront.reference_forward("lstm", weights, x.transpose(0, 1), zeros,
                                                      zeros, lengths)
    assert bench_wavefront.rel(y.transpose(0, 1), ref_y) < 1e-3
    assert bench_wavefront.rel(hy, ref_h) < 1e-3 and bench_wavefront.rel(cy, ref_c) < 1e-3
