"""Bidirectional layers on the wavefront kernel (one launch a layer, both
directions concurrently), through torch, on a real Hopper GPU
(docs/kernel.md, "Bidirectional layers"). The path is off by default
(`library.BIDIRECTIONAL`); these tests turn it on for their run, and must
pass before it is turned on for users.

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch; in its own
process (a path that has never run on a GPU may fault, which ends the
process):

    KERAS_BACKEND=torch python3 -m pytest -q -s tests/gpu/test_gpu_wavefront_bidirectional.py

- `bench_wavefront.bidirectional_cell`: the kernel's outputs and final
  states against float64 of the same rounded weights and against cuDNN's
  bidirectional nn.LSTM/nn.GRU, with and without lengths, at the issue's
  shapes and small ones (partial CTAs, batch 1, one layer).
- A Keras bidirectional stack (concat, sum, ave) under `fused on
  wavefront`: an inference call launches the directions op once a layer
  (a spy counts the launches: a silent fallback fails), the layer's path
  has no note, and the outputs match the original layers.
- The tuner: `predict` of a BiLSTM 4 x 384 at batch 24 times the kernel
  (its decision is a GPU_REPORT line); where chosen, it ran.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import fused_layers  # noqa: E402
from gpu_report import report  # noqa: E402
from gpu_wavefront_checks import count_backward_launches, new_launch_counts, predict_and_report, record_first_shapes, torch_variable_gradients  # noqa: E402
from rnnfuse.backends.cuda import library  # noqa: E402
from rnnfuse.backends.torch import wavefront_bidirectional as bidir  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402
from torch_checks import planned_then_original  # noqa: E402
from rnnfuse.tuning.cache import PlanCache  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_wavefront  # noqa: E402

pytestmark = pytest.mark.real_gpu_only

REL_TOL = 2e-3


@pytest.fixture(autouse=True)
def _hopper_and_on(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wavefront kernel runs on Hopper (compute capability 9.0)")
    monkeypatch.setattr(library, "BIDIRECTIONAL", True)


@pytest.fixture
def launches(monkeypatch):
    """The directions op's real launches (xproj shapes); they still run."""
    return record_first_shapes(monkeypatch, bidir, "_directions_op", [])


CASES = [
    # (kind, layers, units, inputs, batch, steps, dtype)
    ("lstm", 4, 384, 80, 24, 700, "float16"),
    ("gru", 5, 512, 512, 32, 500, "float16"),
    ("lstm", 1, 64, 3, 1, 9, "float16"),
    ("lstm", 2, 200, 40, 33, 50, "bfloat16"),
    ("gru", 3, 128, 16, 7, 31, "bfloat16"),
    ("lstm", 2, 1024, 80, 16, 40, "float16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("with_lengths", [False, True])
def test_the_kernel_matches_float64_and_cudnn(case, with_lengths, launches):
    row = bench_wavefront.bidirectional_cell(*case, reps=3, with_lengths=with_lengths)
    print("GPU_REPORT bidirectional", json.dumps(row, default=str))
    report("wavefront_bidirectional_check", row)
    assert launches[0] == (2, case[5], case[4], (4 if case[0] == "lstm" else 3) * case[2])
    assert len(launches) >= case[1], "one launch a layer"
    assert row["status"] == "ok", row
    for key in ("y", "hy", "cy"):
        if f"err_{key}" in row:
            assert row[f"err_{key}"] <= 2 * row[f"cudnn_err_{key}"] + 1e-4, row


def _bi_model(kind, merge_mode, layers, units, inputs, steps):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        rnn = keras.layers.LSTM if kind == "lstm" else keras.layers.GRU
        inp = keras.Input((steps, inputs))
        x = inp
        for i in range(layers):
            x = keras.layers.Bidirectional(rnn(units, return_sequences=True),
                                           merge_mode=merge_mode)(x)
        return keras.Model(inp, x)
    finally:
        keras.config.set_dtype_policy("float32")


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("kind, merge_mode", [("lstm", "concat"), ("lstm", "sum"),
                                              ("gru", "ave")])
@pytest.mark.parametrize("masked", [False, True])
def test_a_keras_stack_runs_one_launch_a_layer(launches, kind, merge_mode, masked):
    layers, units, inputs, batch, steps = 3, 256, 80, 16, 120
    model = _bi_model(kind, merge_mode, layers, units, inputs, steps)
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    layer.set_plan(Plan((layers,), kernel="wavefront"))
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(rng.standard_normal((batch, steps, inputs)).astype("float32"))
    mask = None
    if masked:
        lengths = rng.integers(1, steps + 1, batch)
        lengths[0] = steps
        mask = keras.ops.convert_to_tensor(np.arange(steps)[None, :] < lengths[:, None])
    y, ran, want = planned_then_original(layer, x, mask)
    assert ran.name == bidir.KERNEL_NAME and ran.note is None, layer.last_path
    assert launches == [(2, steps, batch, (4 if kind == "lstm" else 3) * units)] * layers
    rel = _rel(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(want))
    report("wavefront_bidirectional_keras", {"kind": kind, "merge": merge_mode,
                                             "masked": masked, "rel_diff": rel})
    assert rel <= REL_TOL, rel


def test_predict_of_a_bilstm_4x384_times_the_kernel(tmp_path, launches):
    model = _bi_model("lstm", "concat", 4, 384, 80, 700)
    x = np.random.default_rng(1).standard_normal((48, 700, 80)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    y, record = predict_and_report("wavefront_bidirectional_predict",
                                   "BiLSTM 4x384 in80 B24 T700 float16", fast, x, 24)
    assert "fused on wavefront" in record["timings_ms"], record
    assert _rel(y, model.predict(x, batch_size=24, verbose=0)) <= REL_TOL
    if record["chosen"] == "fused on wavefront":
        ran = layer.last_path.kernel
        assert ran.name == bidir.KERNEL_NAME and ran.note is None, layer.last_path


@pytest.fixture
def training_launches(monkeypatch):
    """The one-layer training kernels' real calls: the saving forward's and
    the backward recurrences (per layer v1 or the one-layer stack v2)."""
    from rnnfuse.backends.torch import wavefront

    calls = {"saving": 0, **new_launch_counts()}
    saving = wavefront.forward_training

    def saving_spy(*args, **kwargs):
        calls["saving"] += 1
        return saving(*args, **kwargs)

    monkeypatch.setattr(wavefront, "forward_training", saving_spy)
    return count_backward_launches(monkeypatch, calls)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_training_call_runs_a_launch_a_direction_with_matching_gradients(
        training_launches, launches, kind):
    layers, units, inputs, batch, steps = 3, 256, 80, 16, 100
    model = _bi_model(kind, "concat", layers, units, inputs, steps)
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    layer.set_plan(Plan((layers,), kernel="wavefront"))
    rng = np.random.default_rng(2)
    x = keras.ops.convert_to_tensor(rng.standard_normal((batch, steps, inputs)).astype("float32"))
    upstream = torch.as_tensor(rng.standard_normal((batch, steps, 2 * units)),
                               dtype=torch.float32, device=x.device)
    got = torch_variable_gradients(layer, x, upstream, model.trainable_variables)
    ran = layer.last_path.kernel
    assert ran.name == "rnnfuse wavefront forward+backward" and ran.note is None, layer.last_path
    assert ran.algorithm == bidir.TRAINING_ALGORITHM
    assert launches == [], "the training form runs the one-layer kernels"
    assert training_launches["saving"] == 2 * layers, training_launches
    assert training_launches["stack"] + training_launches["layer"] >= 2 * layers
    want = torch_variable_gradients(model, x, upstream, model.trainable_variables)
    rel = max(float(torch.linalg.norm(g - w) / torch.linalg.norm(w)) for g, w in zip(got, want))
    report("wavefront_bidirectional_training", {"kind": kind, "grad_rel_diff": rel})
    assert rel <= 2e-2, rel
