"""The forward's opt-in variant 4 (wavefront.cuh, "Variant 4": variant 2's
wgmma products with hs staged by tensor copies on mbarriers) on a real
Hopper GPU, through torch:

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_wavefront_tma_torch.py

Every shape is bench/bench_wavefront.py's `check_case` with variant 4: NaN-
poisoned outputs, the kernel's outputs and final states against a float64
reference and cuDNN, and within the dtype's tolerance of variant 0's on the
same inputs (LSTM: the saved gates and c too). The shapes are the headline
family (4 x 512, batch 64) and EDGE_CASES (a half of one row, several
chunks, K padded to 1024, one half only). A stack whose plan the variant
does not take is refused with the reason, never run.
"""

from __future__ import annotations

import os
import sys

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

# The real packages before bench_wavefront's stand-ins, which the conftest's
# fixtures would otherwise import.
from rnnfuse.tuning import first_batch  # noqa: E402, F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_wavefront  # noqa: E402

pytestmark = pytest.mark.real_gpu_only
SHAPES = bench_wavefront.FIXED_CASES[:4] + bench_wavefront.EDGE_CASES


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wavefront kernel runs on Hopper (compute capability 9.0)")


@pytest.mark.parametrize("case", SHAPES, ids=[f"{c[0]}{c[1]}x{c[2]}-b{c[3]}-{c[6]}" for c in SHAPES])
def test_variant_four_is_exact(case):
    row = bench_wavefront.check_case(*case, seed=4, variant=4)
    assert row["status"] == "ok", row
    assert "err_vs_variant0" in row


def test_a_plan_variant_four_does_not_take_is_refused_with_the_reason():
    """4 x 480: CTAs of 16 units, but K = 960 splits into no whole 128-byte rows."""
    row = bench_wavefront.check_case("lstm", 4, 480, 64, 5, 480, "float16", False, seed=0,
                                     variant=4)
    assert row["status"] == "fallback" and "multiple of 64" in row["reason"], row
