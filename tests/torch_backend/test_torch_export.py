"""ONNX export of an optimized model under the torch backend.

On torch the fused call runs on the CPU too (PyTorch's own `torch._VF`
kernels), so a traced export of the optimized model would hold PyTorch's
fused RNN op. `fast.export(path, format="onnx")` exports the original layers
instead: the same ONNX graph as the original model's export, which
onnxruntime runs on the CPU with the original's numbers.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
from builders import random_inputs, stack_model

import rnnfuse

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_onnx_export_is_the_original_models_onnx(torch_calls, tmp_path):
    model = stack_model("lstm", 2, units=4, input_size=3, steps=5, head=True)
    x = random_inputs(model, 2, np.random.default_rng(3))
    want = keras.ops.convert_to_numpy(model(x))
    fast = rnnfuse.optimize(model, tune=False)
    fast(x)
    assert torch_calls, "the optimized model does not run fused here"
    torch_calls.clear()
    fast.export(str(tmp_path / "fast.onnx"), format="onnx", verbose=False)
    assert not torch_calls, "the export traced the fused call"
    model.export(str(tmp_path / "original.onnx"), format="onnx", verbose=False)
    assert _ops(tmp_path / "fast.onnx") == _ops(tmp_path / "original.onnx")
    session = onnxruntime.InferenceSession(
        str(tmp_path / "fast.onnx"), providers=["CPUExecutionProvider"]
    )
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
