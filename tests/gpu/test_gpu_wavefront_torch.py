"""rnnfuse's wavefront kernel through torch on a real Hopper GPU.

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch:

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_wavefront_torch.py

As a tuner candidate (the last tests): an optimized 4x512 float16 LSTM's
`predict` at batch 64, T=1000, tuned on this GPU, chooses the wavefront
plan; the custom op really runs in predict (a spy counts its calls: a
silent fallback fails), the outputs match the original model within
float16 rounding, and predict is faster than the original's (the ratio is
a GPU_REPORT line); the same model at batch 8 keeps cuDNN or the original.
Through `fit` (the last test), the same model's training decision chooses
the wavefront plan (the kernel's forward and backward), its training
calls run both kernels, its gradients match the original layers' within
float16 rounding, and `fit` is faster than the original's.

Every check is bench/bench_wavefront.py's `check_case`: fresh random
weights, inputs, initial states (and lengths), NaN-poisoned outputs, the
kernel's outputs AND final states compared with a float64 reference of the
same rounded weights (`wavefront.reference_forward`) and with cuDNN
(torch.nn.LSTM/GRU in the same dtype), as ||out - ref|| / ||ref||: within
the dtype's tolerance and never more than twice cuDNN's own error. Shapes
outside the kernel's limits must be refused (WavefrontError), never run.
The backward kernel's tests are bench_wavefront's `grad_case`: an LSTM's
outputs and every gradient through `wavefront.trainable_forward` against
autograd of the float64 reference and cuDNN's gradient, on v1
(backward="layer"), on v2 (backward="stack") and on the default
("auto": the reverse wavefront at the headline, v1 at 7 x 320, which v2
refuses; the library's backward launches are counted, so a silent
fallback fails). A GRU's gradients likewise (bench_wavefront's
GRU_GRAD_CASES and random GRU shapes, on the per-layer backward, its one
kind: a launch a layer is counted; "auto" is per layer for a GRU), and a
Keras GRU stack's training call through `run_trainable`.
"""

from __future__ import annotations

import json
import os
import random
import sys

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import built_stack, fused_layers  # noqa: E402
from gpu_report import report  # noqa: E402
from gpu_timing import median_seconds, predict_medians  # noqa: E402
from gpu_wavefront_checks import assert_batch_8_keeps_cudnn_or_the_original, assert_fit_is_faster, count_backward_launches, fit_at_the_headline, float16_lstm, new_launch_counts, record_first_shapes, torch_variable_gradients  # noqa: E402
from rnnfuse.backends.base import StackCall  # noqa: E402
from rnnfuse.backends.torch import wavefront  # noqa: E402
from rnnfuse.tuning import first_batch  # noqa: E402
from rnnfuse.tuning.cache import PlanCache  # noqa: E402

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


# -- the backward kernel: an LSTM's and a GRU's gradients -----------------------------


GRAD_FIXED = [c for c in bench_wavefront.GRAD_CASES + bench_wavefront.GRU_GRAD_CASES
              if c[:2] != (8, 512)]


@pytest.fixture
def backward_launches(monkeypatch):
    """Counts the library's backward launches (they still run): the stack
    backward's one a call, the per-layer backward's one a layer."""
    return count_backward_launches(monkeypatch, new_launch_counts())


@pytest.fixture
def layer_backward(monkeypatch):
    """grad_case's trainable_forward on v1 (backward="layer"): the default
    is "auto", which runs the reverse wavefront where it accepts."""
    real = wavefront.trainable_forward
    monkeypatch.setattr(wavefront, "trainable_forward",
                        lambda *a, **kw: real(*a, **{"backward": "layer", **kw}))


@pytest.mark.parametrize("case", GRAD_FIXED, ids=lambda c: "-".join(map(str, c)))
def test_the_backward_kernels_gradients_match_float64_and_cudnn(case, layer_backward,
                                                                backward_launches):
    """bench_wavefront.grad_case: outputs, dx, dh0, an LSTM's dc0 and every
    weight and bias through trainable_forward(backward="layer"), against
    autograd of the float64 reference and cuDNN's gradient: within the
    dtype's tolerance or twice cuDNN's own error, per tensor; one backward
    launch a layer (LSTM and GRU: a GRU that fell back to cuDNN fails)."""
    row = bench_wavefront.grad_case(*case, seed=random.randrange(10_000))
    assert row["status"] == "ok", row
    assert backward_launches == {"stack": 0, "layer": case[0]}, backward_launches


@pytest.mark.parametrize("case", bench_wavefront.random_grad_cases(4, seed=24)
                         + bench_wavefront.random_grad_cases(4, seed=25, kind="gru"),
                         ids=lambda c: "-".join(map(str, c)))
def test_random_shapes_gradients_match_or_are_refused(case, layer_backward, backward_launches):
    row = bench_wavefront.grad_case(*case, seed=random.randrange(10_000))
    assert row["status"] in ("ok", "fallback"), row
    if row["status"] == "ok":
        assert backward_launches == {"stack": 0, "layer": case[0]}, backward_launches


# -- the default backward ("auto"): the reverse wavefront where it accepts, else v1 -----


AUTO_CASES = [
    # (layers, units, batch, steps, inputs, dtype, lengths), the backward that must run
    ((4, 512, 64, 1000, 512, "float16", False), "stack"),  # the headline
    ((7, 320, 8, 30, 64, "float16", True), "layer"),  # 140 CTAs: v2 refuses, v1 runs it
    ((4, 512, 64, 1000, 512, "float16", False, "gru"), "layer"),  # a GRU: v1 (v2 is LSTM only)
]


@pytest.mark.parametrize("case, backward", AUTO_CASES,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v)
def test_the_default_backward_runs_the_stack_where_it_accepts_else_per_layer(
        case, backward, monkeypatch, backward_launches):
    """trainable_forward's default ("auto"): `backward_choice` names the
    backward, the library's launches prove it ran (a silent fallback
    fails), and grad_case's gradients match float64 and cuDNN."""
    layers, units, batch, steps, inputs = case[:5]
    dtype = bench_wavefront.DTYPES[case[5]]
    kind = case[7] if len(case) > 7 else "lstm"
    choice = wavefront.backward_choice(
        torch.zeros(steps, batch, inputs, dtype=dtype, device="cuda"),
        torch.zeros(layers, batch, units, dtype=dtype, device="cuda"), kind=kind)
    assert (choice.backward, choice.requested) == (backward, "auto"), choice
    if backward == "layer":
        assert "reverse-wavefront" in choice.reason, choice
    monkeypatch.setattr(bench_wavefront, "BACKWARD", "auto")  # grad_case: the default path
    row = bench_wavefront.grad_case(*case, seed=random.randrange(10_000))
    assert row["status"] == "ok", row
    assert backward_launches == ({"stack": 1, "layer": 0} if backward == "stack"
                                 else {"stack": 0, "layer": layers}), backward_launches
    report(f"wavefront_grad_auto_torch_{'-'.join(map(str, case))}", {
        "backward": choice.backward, "reason": choice.reason, "worst": row["worst"],
        "cudnn_worst": row["cudnn_worst"], "ratio_to_cudnn": row["ratio_to_cudnn"]})


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_stack_over_the_forwards_limits_is_refused_for_training(kind):
    row = bench_wavefront.grad_case(8, 512, 64, 10, 512, "float16", False, kind, seed=1)
    assert row["status"] == "fallback" and "do not fit" in row["reason"], row


# -- the reverse-wavefront backward (v2, opt-in: trainable_forward(backward="stack")) --


STACK_FIXED = [c for c in bench_wavefront.GRAD_CASES + bench_wavefront.STACK_GRAD_CASES
               if c[:2] not in ((8, 512), (7, 320))]  # LSTM only: v2 runs no GRU


@pytest.mark.parametrize("case", STACK_FIXED, ids=lambda c: "-".join(map(str, c)))
def test_the_stack_backwards_gradients_match_float64_and_cudnn(case, monkeypatch):
    """grad_case with --backward stack: every gradient through the reverse
    wavefront (one launch for all layers; a timed-out wait is an error)."""
    monkeypatch.setattr(bench_wavefront, "BACKWARD", "stack")
    row = bench_wavefront.grad_case(*case, seed=random.randrange(10_000))
    assert row["status"] == "ok", row


def test_a_stack_over_the_stack_backwards_limits_is_refused_from_the_backward_pass(
        monkeypatch):
    """7 x 320 fits the forward (130 CTAs) but not the stack backward (140)."""
    monkeypatch.setattr(bench_wavefront, "BACKWARD", "stack")
    row = bench_wavefront.grad_case(7, 320, 8, 10, 64, "float16", False, seed=1)
    assert row["status"] == "fallback" and "reverse-wavefront" in row["reason"], row


def test_run_stack_runs_a_keras_stack_from_its_live_variables():
    """The backend entry point: Keras cells packed as the torch backend packs
    them, a right-padded mask as lengths; against the float64 reference of
    the same packed (float16) weights."""
    from rnnfuse.backends import torch as torch_backend

    stack = built_stack("lstm", 3, 256, 64)
    x = torch.randn(16, 50, 64, device="cuda").half()
    lengths = torch.randint(1, 51, (16,), device="cuda")
    mask = torch.arange(50, device="cuda")[None, :] < lengths[:, None]
    y, hy, cy, ran = wavefront.run_stack(x, StackCall(stack, mask=mask))
    assert ran.name == wavefront.KERNEL_NAME
    weights = torch_backend.pack_params(stack, torch.float16, "cuda")
    zeros = torch.zeros(3, 16, 256, device="cuda")
    ref_y, ref_h, ref_c = wavefront.reference_forward("lstm", weights, x.transpose(0, 1), zeros,
                                                      zeros, lengths)
    assert bench_wavefront.rel(y.transpose(0, 1), ref_y) < 1e-3
    assert bench_wavefront.rel(hy, ref_h) < 1e-3 and bench_wavefront.rel(cy, ref_c) < 1e-3


def test_run_trainable_trains_a_keras_gru_stack_on_the_kernels(backward_launches):
    """A Keras GRU stack's training call (the backend's entry point, a
    right-padded mask as lengths): the kernel's forward and ONE backward
    launch a layer ran (a silent cuDNN fallback fails), and the gradients
    reaching the Keras variables match autograd of the float64 reference of
    the same packed weights."""
    from rnnfuse.backends import torch as torch_backend

    stack = built_stack("gru", 3, 256, 64)  # reset_after=True: Keras 3's default, cuDNN's
    x = torch.randn(16, 50, 64, device="cuda").half().requires_grad_()
    lengths = torch.randint(1, 51, (16,), device="cuda")
    lengths[0] = 50
    mask = torch.arange(50, device="cuda")[None, :] < lengths[:, None]
    run = wavefront.run_trainable(x, StackCall(stack, mask=mask))
    assert run.kernel.name == wavefront.TRAINING_KERNEL_NAME, run.kernel
    assert run.kernel.algorithm == "backward=layer" and run.final_c is None, run.kernel
    upstream = torch.randn_like(run.outputs, dtype=torch.float32)
    variables = [w.value for level in stack.cells for cell in level for w in cell.weights]
    got = torch.autograd.grad((run.outputs.float() * upstream).sum(), [x, *variables])
    assert backward_launches == {"stack": 0, "layer": 3}, backward_launches
    # float64: the same variables packed in float64 (pack_params is
    # differentiable, so autograd reaches the variables the same way).
    weights = torch_backend.pack_params(stack, torch.float64, "cuda")
    x64 = x.detach().double().requires_grad_()
    zeros = torch.zeros(3, 16, 256, device="cuda", dtype=torch.float64)
    ref_y, _, _ = wavefront.reference_forward("gru", weights, x64.transpose(0, 1), zeros, None,
                                              lengths)
    want = torch.autograd.grad((ref_y.transpose(0, 1) * upstream.double()).sum(),
                               [x64, *variables])
    assert bench_wavefront.rel(run.outputs, ref_y.transpose(0, 1)) < 1e-3
    errors = [bench_wavefront.rel(g.double(), w) for g, w in zip(got, want)]
    report("wavefront_gru_run_trainable_torch", {"grad_rel_errors": errors})
    assert max(errors) < 1e-2, errors  # float16 weights and arithmetic against float64


# -- the tuner candidate, through predict ------------------------------------------------


def _median_call_s(model, x, repeats=7):
    """Median seconds of `model(x, training=False)` on a device batch."""
    with torch.no_grad():
        return median_seconds(lambda: model(x, training=False), repeats,
                              sync=torch.cuda.synchronize)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the custom op's real calls (the op still runs)."""
    return record_first_shapes(monkeypatch, wavefront, "_wavefront_op", [])


def test_predict_of_a_4x512_float16_lstm_at_batch_64_runs_the_custom_op(tmp_path, op_calls):
    model = float16_lstm(4, 512, 1000)
    x = np.random.default_rng(0).standard_normal((256, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    del op_calls[:]
    y = fast.predict(x, batch_size=64, verbose=0)
    (record,) = first_batch.decisions(fast)
    print("GPU_REPORT decision", json.dumps(record, default=str))
    assert record["mode"] == "inference" and record["chosen"] == "fused on wavefront", record
    ran = layer.last_path.kernel
    assert ran.name == wavefront.KERNEL_NAME and ran.note is None, layer.last_path
    # The tuner's steps ran it too; predict's four batches are the last four calls.
    assert op_calls[-4:] == [(1000, 64, 4 * 512)] * 4, op_calls[-6:]
    before = len(op_calls)
    fast.predict(x, batch_size=64, verbose=0)
    assert len(op_calls) == before + 4, "each predict batch runs the custom op"
    want = model.predict(x, batch_size=64, verbose=0)
    diff = np.asarray(y, np.float64) - want
    rel = float(np.linalg.norm(diff) / np.linalg.norm(want))
    assert rel <= 2e-3 and float(np.max(np.abs(diff))) <= 2e-2
    medians = predict_medians({"original": model, "optimized": fast}, x, 64)
    original_s, fast_s = medians["original"], medians["optimized"]
    # A direct call on a batch already on the GPU: what the kernel changes.
    # `predict` of these 256 x 1000 x 512 float32 inputs is host-bound (the
    # recurrence is about an eighth of the call, and the kernel's saving
    # does not show), so it is held to
    # never-slower, the direct call to faster.
    batch = keras.ops.convert_to_tensor(x[:64])
    original_call_s = _median_call_s(model, batch)
    fast_call_s = _median_call_s(fast, batch)
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME, layer.last_path
    report("wavefront_predict_torch", {
        "shape": "4x512 LSTM B64 T1000 float16", "chosen": record["chosen"],
        "timings_ms": record["timings_ms"], "predict_original_ms": 1e3 * original_s,
        "predict_optimized_ms": 1e3 * fast_s, "speedup": original_s / fast_s, "rel_diff": rel,
        "call_original_ms": 1e3 * original_call_s, "call_optimized_ms": 1e3 * fast_call_s,
        "call_speedup": original_call_s / fast_call_s,
    })
    assert fast_call_s < original_call_s, (fast_call_s, original_call_s)
    assert fast_s <= original_s / 0.97, (fast_s, original_s)


def test_predict_at_batch_8_keeps_cudnn_or_the_original(tmp_path):
    assert_batch_8_keeps_cudnn_or_the_original(tmp_path, "wavefront_predict_torch_b8")


# -- the tuner candidate, through fit ----------------------------------------------------


def test_fit_of_a_4x512_float16_lstm_at_batch_64_trains_on_the_kernels_backward(tmp_path):
    model, fast, layer, record, x, y, rng = fit_at_the_headline(
        tmp_path, wavefront.TRAINING_KERNEL_NAME)
    # The kernel's gradients against the original layers' (same variables).
    batch = keras.ops.convert_to_tensor(x[:64])
    upstream = torch.as_tensor(rng.standard_normal((64, 1000, 512)), dtype=torch.float32,
                               device=batch.device)
    got = torch_variable_gradients(fast, batch, upstream, model.trainable_variables)
    assert layer.last_path.kernel.name == wavefront.TRAINING_KERNEL_NAME, layer.last_path
    want = torch_variable_gradients(model, batch, upstream, model.trainable_variables)
    rel = max(float(torch.linalg.norm(g - w) / torch.linalg.norm(w)) for g, w in zip(got, want))
    assert_fit_is_faster("wavefront_fit_torch", model, fast, x, y, record, rel,
                         sync=torch.cuda.synchronize)
