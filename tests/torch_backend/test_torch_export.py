"""Saving and exporting an optimized model under the torch backend.

On torch the fused call runs on the CPU too (PyTorch's own `torch._VF`
kernels), so a traced export of the optimized model would hold PyTorch's
fused RNN op. `fast.export(path, format="onnx")` exports the original layers
instead: the same ONNX graph as the original model's export, which
onnxruntime runs on the CPU with the original's numbers. `fast.save(path)`
writes the original's file, which `rnnfuse.load_model` fuses again.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
from builders import random_inputs, stack_model

import rnnfuse


def _ops(path) -> collections.Counter:
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_onnx_export_is_the_original_models_onnx(torch_calls, tmp_path):
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
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


def test_save_writes_the_original_file_and_load_model_fuses_it_again(torch_calls, tmp_path):
    model = stack_model("gru", 2, units=4, input_size=3, steps=5, head=True)
    fast = rnnfuse.optimize(model, tune=False)
    fast.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(4)
    x, y = random_inputs(model, 8, rng), rng.standard_normal((8, 3)).astype("float32")
    fast.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert torch_calls, "fit did not run the fused call"
    fast.save(tmp_path / "m.keras")
    want = keras.ops.convert_to_numpy(model(x))
    plain = keras.models.load_model(tmp_path / "m.keras")
    assert [type(l).__name__ for l in plain.layers] == [type(l).__name__ for l in model.layers]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(plain(x)), want, atol=1e-6)
    again = rnnfuse.load_model(tmp_path / "m.keras")
    torch_calls.clear()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(again(x)), want, atol=1e-5)
    assert torch_calls, "the loaded model does not run fused"
    assert int(keras.ops.convert_to_numpy(again.optimizer.iterations)) == 2
