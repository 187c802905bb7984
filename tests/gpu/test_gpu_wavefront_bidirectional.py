"""Bidirectional layers on the wavefront kernel (one launch a layer, both
directions concurrently; in training, two streams), through torch, on a
real Hopper GPU (docs/kernel.md, "Bidirectional layers"). The tuner times
it beside cuDNN where `library.BIDIRECTIONAL` is on (the default); these
tests turn it on whatever the default.

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
- Training (`trainable_forward`, a one-layer launch a direction): through
  Keras (the concurrent form, the default) outputs and gradients against
  the original layers; directly, the concurrent form against the
  sequential one and float64 torch, with the launches' streams (direction
  1's forward and backward on a second one).
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
from torch_checks import module_run, planned_then_original  # noqa: E402
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
    y_rel = _rel(*(m(x, training=True).detach().float().cpu().numpy() for m in (layer, model)))
    assert layer.last_path.kernel.algorithm == bidir.TRAINING_ALGORITHM, layer.last_path
    report("wavefront_bidirectional_training", {"kind": kind, "grad_rel_diff": rel,
                                                "y_rel_diff": y_rel})
    assert rel <= 2e-2, rel
    assert y_rel <= REL_TOL, y_rel


@pytest.fixture
def launch_streams(monkeypatch):
    """The CUDA stream of each real launch of the one-layer training kernels
    (the saving forward's, the backward's either form); they still run."""
    seen = {"forward": [], "backward": []}
    for name, key in (("forward", "forward"), ("backward", "backward"),
                      ("backward_stack", "backward")):
        real = getattr(library.WavefrontLibrary, name)

        def spy(self, stream, *args, _real=real, _key=key, **kw):
            seen[_key].append(stream)
            return _real(self, stream, *args, **kw)

        monkeypatch.setattr(library.WavefrontLibrary, name, spy)
    return seen


TRAINING_CASES = [
    # (kind, layers, units, inputs, batch, steps, masked); 1024 units: the two
    # directions' grids cannot all be resident at once, so they take turns.
    ("lstm", 2, 256, 80, 16, 100, False),
    ("gru", 2, 256, 80, 16, 100, True),
    ("lstm", 1, 1024, 80, 16, 40, True),
]


@pytest.mark.parametrize("case", TRAINING_CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_concurrent_training_form_matches_the_sequential_one_and_float64(
        launch_streams, case):
    """`trainable_forward(concurrent=True)`: direction 1's saving forward and
    backward on a second stream, direction 0's on the current one; outputs
    and every gradient as the sequential form's and float64 torch's."""
    import copy

    kind, layers, units, inputs, batch, steps, masked = case
    reason = bidir.training_reason(kind, layers, units, batch, steps, inputs, torch.float16,
                                   torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(11)
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    mod = cls(inputs, units, layers, bidirectional=True).cuda().half()
    ref = copy.deepcopy(mod).double()
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").half()
    h0, c0 = (0.5 * torch.randn(2, 2 * layers, batch, units, generator=gen,
                                device="cuda")).half()
    lens = None
    if masked:
        lens = torch.randint(1, steps + 1, (batch,), generator=gen, device="cuda")
        lens[0] = steps
    alive = (torch.arange(steps, device="cuda")[:, None]
             < (lens if lens is not None else steps))[..., None]
    dy = torch.randn(steps, batch, 2 * units, generator=gen, device="cuda") * alive
    dh = torch.randn(2 * layers, batch, units, generator=gen, device="cuda")

    def run(weights, dtype, forward):
        leaves = [t.detach().to(dtype).requires_grad_()
                  for t in ((x, h0, c0) if kind == "lstm" else (x, h0))]
        y, hy, cy = forward(leaves, weights)
        loss = ((y.to(dy.dtype) * dy).sum() + (hy.to(dh.dtype) * dh).sum()
                + (0 if cy is None else (cy.to(dh.dtype) * dh).sum()))
        grads = torch.autograd.grad(loss, leaves + list(weights))
        return [t.detach().double() for t in (y, hy) + ((cy,) if cy is not None else ()) + grads]

    def ours(concurrent):
        def forward(leaves, weights):
            return bidir.trainable_forward(leaves[0], weights, leaves[1],
                                           leaves[2] if kind == "lstm" else None, lens,
                                           kind=kind, concurrent=concurrent)
        launch_streams["forward"].clear()
        launch_streams["backward"].clear()
        weights = [w.detach().clone().requires_grad_() for w in mod._flat_weights]
        got = run(weights, torch.float16, forward)
        torch.cuda.synchronize()
        return got, {k: list(v) for k, v in launch_streams.items()}

    def torchs(leaves, weights):
        ref._flat_weights = list(weights)
        return module_run(ref, kind, leaves[0], leaves[1],
                          leaves[2] if kind == "lstm" else None,
                          None if lens is None else lens.cpu())

    sequential, one_stream = ours(False)
    concurrent, two_streams = ours(True)
    want = run([w.detach().double().requires_grad_() for w in mod._flat_weights],
               torch.float64, torchs)
    here = torch.cuda.current_stream().cuda_stream
    assert set(one_stream["forward"]) == set(one_stream["backward"]) == {here}, one_stream
    assert len(set(two_streams["forward"])) == 2 and here in two_streams["forward"], two_streams
    assert set(two_streams["backward"]) == set(two_streams["forward"]), \
        "autograd runs direction 1's backward on its forward's stream"
    assert len(two_streams["forward"]) == 2 * layers
    def rel(a, b):
        return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30))

    outputs = 3 if kind == "lstm" else 2
    row = {"case": list(case),
           "bit_identical": all(torch.equal(a, b) for a, b in zip(concurrent, sequential)),
           "concurrent_vs_sequential": max(rel(a, b) for a, b in zip(concurrent, sequential)),
           "outputs_vs_float64": max(rel(a, b) for a, b in
                                     zip(concurrent[:outputs], want[:outputs])),
           "grads_vs_float64": max(rel(a, b) for a, b in
                                   zip(concurrent[outputs:], want[outputs:])),
           "sequential_grads_vs_float64": max(rel(a, b) for a, b in
                                              zip(sequential[outputs:], want[outputs:]))}
    print("GPU_REPORT bidirectional_concurrent_training", json.dumps(row))
    report("wavefront_bidirectional_concurrent_training", row)
    assert row["concurrent_vs_sequential"] <= 1e-3, row
    assert row["outputs_vs_float64"] <= 5e-3, row
    assert row["grads_vs_float64"] <= 2e-2, row
