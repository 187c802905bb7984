"""On CUDA, a group whose plan keeps the original layers dispatches exactly
the original model's torch ops on every entry point (Keras' own cuDNN
layers underneath): the decision pinned by a fixed clock, as
bench/bench_kept_original.py pins it.

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_torch_kept_original.py
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

from builders import fused_layers  # noqa: E402
from torch_checks import torch_ops  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))
import bench_kept_original as kept  # noqa: E402


@pytest.mark.parametrize("cell", ["bi_lstm:3:64:8:40:mixed_float16", "lstm:3:64:8:40"])
def test_a_kept_original_group_dispatches_the_original_models_ops(cell):
    shape = kept.parse_cell(cell)
    model = kept.build(shape)
    fast = kept.kept_original(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3 * shape["batch"], shape["steps"], kept.FEATURES)).astype("float32")
    y = rng.standard_normal((3 * shape["batch"], 1)).astype("float32")
    for m in (model, fast):
        m.compile(optimizer="adam", loss="mse")
        m.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)
    assert fused_layers(fast)
    xb, yb = x[: shape["batch"]], y[: shape["batch"]]
    entry_points = {"train_on_batch": lambda m: m.train_on_batch(xb, yb),
                    "test_on_batch": lambda m: m.test_on_batch(xb, yb),
                    "predict_on_batch": lambda m: m.predict_on_batch(xb),
                    "fit": lambda m: m.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)}
    for name, run in entry_points.items():
        for m in (model, fast):
            run(m)  # warm: Keras makes each mode's step on its first call
        original, optimized = torch_ops(lambda: run(model)), torch_ops(lambda: run(fast))
        assert all(r.plan.per_layer for r in fast._rnnfuse_autotune.decided.values())
        print(f"GPU_REPORT kept original {cell} {name}: {sum(original.values())} torch ops "
              f"a call, optimized {sum(optimized.values())}")
        assert sum(original.values()) > 50, name
        assert optimized == original, f"{name}: {optimized - original} more, {original - optimized} fewer"
