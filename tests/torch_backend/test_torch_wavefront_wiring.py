"""rnnfuse's wavefront kernel as a plan kernel and a tuner candidate for
inference and training (torch backend), on the CPU.

The kernels are faked at their lowest level: the forward custom op's
Python entry `wavefront._wavefront_op` becomes `FakeKernel.op`, which
records each call and computes what the kernel computes from its own
inputs (layer 0's input projection and the canonical flat buffer) with the
float64 reference `wavefront.reference_forward`, with no autograd (as the
custom op has none); the training kernels (`forward_training`,
`backward_layer`) become their torch versions (`reference_forward_saving`,
`recurrence_reference`), recorded; `wavefront.unsupported_reason` keeps
the real dtype/structure checks and fakes the device and the on-chip plan
(a stack fits when layers x units <= LIMIT), and the backward's device
plan (`_backward_reason`) keeps the real rule on the kind (LSTM and GRU). Everything
between `FusedRNN` and the kernels is the real code: the packing, the
choice of forward or forward+backward by autograd, the kernel's gradient
reaching the Keras variables, the fallbacks with their reasons, and the
tuner. The real kernels run on the GPU
(tests/gpu/test_gpu_wavefront_torch.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rnnfuse
from builders import fused_layers, fused_with_plan, max_abs_diff, wavefront_inputs, wavefront_mask, wavefront_stack
from fake_clock import FakeTimer
from rnnfuse.backends.cuda import library
from rnnfuse.backends.torch import wavefront
from rnnfuse.plan import FUSED, Plan
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.tuner import tune_plans

WAVEFRONT = Plan((2,), kernel="wavefront")
LIMIT = 48
FP16_TOL = 5e-3
ENV = {"device": "FakeGPU", "torch": torch.__version__, "cudnn": "9", "calls": "auto",
       "backend": "torch", "rnnfuse": "0.1.0"}


class FakeKernel:
    """The custom op and the device-side checks, faked (see module doc)."""

    def __init__(self):
        self.calls, self.asked, self.refuse_launch = [], [], False
        self.recurrences = 0

    def op(self, xproj, params, h0, c0, lengths, kind, input_size, variant=0):
        if self.refuse_launch:
            raise library.WavefrontError("the cooperative launch was refused")
        steps, batch, gh = xproj.shape
        layers, _, units = h0.shape
        self.calls.append(dict(kind=kind, steps=steps, batch=batch, lengths=lengths.numel(),
                               grad=torch.is_grad_enabled(), variant=variant))
        sizes = [(gh, input_size), (gh, units)] + [(gh, units), (gh, units)] * (layers - 1)
        mats, offset = [], 0
        for rows, cols in sizes:
            mats.append(params[offset:offset + rows * cols].view(rows, cols))
            offset += rows * cols
        biases = params[offset:].view(2 * layers, gh)
        weights = []
        for l in range(layers):
            # x W_ih0^T arrives projected: layer 0's input matrix is the identity.
            w_ih = torch.eye(gh, dtype=xproj.dtype) if l == 0 else mats[2 * l]
            weights += [w_ih, mats[2 * l + 1], biases[2 * l], biases[2 * l + 1]]
        with torch.no_grad():
            y, hy, cy = wavefront.reference_forward(
                kind, weights, xproj, h0, c0 if kind == "lstm" else None,
                lengths if lengths.numel() else None)
        cy = cy.to(xproj.dtype) if kind == "lstm" else h0.new_empty((0,))
        return y.to(xproj.dtype), hy.to(xproj.dtype), cy

    def unsupported_reason(self, kind, num_layers, units, batch, steps, input_size, dtype,
                           device, **structure):
        reason = library.stack_reason(kind, str(dtype).replace("torch.", ""), **structure)
        if reason is not None:
            return reason
        self.asked.append((kind, num_layers, units, batch, steps, input_size))
        if num_layers * units > LIMIT:
            return f"{num_layers} layers of {units} units do not fit on chip"
        return None

    def backward_reason(self, kind, units, batch, steps, device):
        if kind not in library.KINDS:
            return f"the wavefront backward kernel runs LSTM and GRU stacks, not {kind}"
        return None

    def saving(self, x, params, h0, c0, lengths, *, kind="lstm"):
        self.calls.append(dict(kind=kind, steps=x.shape[0], batch=x.shape[1], saving=True,
                               lengths=0 if lengths is None else lengths.numel(), grad=False))
        return wavefront.reference_forward_saving(x, params, h0, c0, lengths, kind=kind)

    def recurrence(self, *args, **kwargs):
        self.recurrences += 1
        return wavefront.recurrence_reference(*args, **kwargs)


@pytest.fixture
def fake_kernel(monkeypatch):
    kernel = FakeKernel()
    monkeypatch.setattr(wavefront, "_wavefront_op", kernel.op)
    monkeypatch.setattr(wavefront, "unsupported_reason", kernel.unsupported_reason)
    monkeypatch.setattr(wavefront, "_backward_reason", kernel.backward_reason)
    monkeypatch.setattr(wavefront, "forward_training", kernel.saving)
    monkeypatch.setattr(wavefront, "backward_layer", kernel.recurrence)
    yield kernel


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("masked", [False, True])
def test_an_inference_call_runs_the_custom_op(fake_kernel, half, kind, masked):
    layer = fused_with_plan(wavefront_stack(kind, go_backwards_first=not masked), WAVEFRONT)
    x, mask = wavefront_inputs(), wavefront_mask(masked)
    with torch.no_grad():
        y = layer(x, mask=mask, training=False)
    ran = layer.last_path.kernel
    assert ran.name == "torch.ops.rnnfuse.wavefront_forward" and ran.note is None
    assert [c["lengths"] for c in fake_kernel.calls] == [4 if masked else 0]
    assert [c["variant"] for c in fake_kernel.calls] == [library.FORWARD_VARIANT]
    with torch.no_grad():
        layer.set_plan(FUSED)
        want = layer(x, mask=mask, training=False)
        layer.set_plan(Plan(()))
        original = layer(x, mask=mask, training=False)
    assert len(fake_kernel.calls) == 1
    assert max_abs_diff(y, want) <= 2e-3 and max_abs_diff(y, original) <= FP16_TOL


def _layer_inputs_and_weights(kind, plan=WAVEFRONT, *, units=8, **stack_kwargs):
    """(a `wavefront_stack`'s FusedRNN on `plan`, its inputs, loss weights
    of its outputs' shape): a gradient test's case."""
    layer = fused_with_plan(wavefront_stack(kind, units=units, **stack_kwargs), plan)
    weights = torch.tensor(np.random.default_rng(3).standard_normal((4, 7, units)),
                           dtype=torch.float32)
    return layer, wavefront_inputs(), weights


def _training_gradients(layer, x, weights, training=True):
    """The gradients of a weighted sum of `layer`'s outputs, as a training
    step takes them: (the variables' gradients, in layer order)."""
    y = layer(x, training=training).float()
    params = [v.value for v in layer.trainable_variables]
    grads = torch.autograd.grad((y * weights).sum(), params)
    return [g.double().numpy() for g in grads]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_training_call_runs_the_kernels_forward_and_backward(fake_kernel, half, kind):
    layer, x, weights = _layer_inputs_and_weights(kind)
    grads = _training_gradients(layer, x, weights)
    assert layer.last_path.kernel.name == wavefront.TRAINING_KERNEL_NAME
    assert layer.last_path.kernel.note is None
    assert layer.last_path.kernel.algorithm == "backward=layer"  # off CUDA and for a GRU
    assert [(c.get("saving"), c["kind"]) for c in fake_kernel.calls] == [(True, kind)]
    assert fake_kernel.recurrences == 2, "the backward ran one recurrence per layer"
    layer.set_plan(FUSED)
    cudnn = _training_gradients(layer, x, weights)
    layer.set_plan(Plan(()))
    original = _training_gradients(layer, x, weights)
    for got, want, keras_own in zip(grads, cudnn, original):
        scale = max(1.0, np.max(np.abs(want)))
        assert np.max(np.abs(got - want)) <= FP16_TOL * scale
        assert np.max(np.abs(got - keras_own)) <= FP16_TOL * scale
    assert all(np.max(np.abs(g)) > 0 for g in grads)


def test_a_call_autograd_does_not_record_runs_the_forward_alone(fake_kernel, half):
    layer = fused_with_plan(wavefront_stack(), WAVEFRONT)
    with torch.no_grad():
        layer(wavefront_inputs(), training=True)
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME
    assert [c.get("saving") for c in fake_kernel.calls] == [None]


def test_a_refused_shape_and_a_refused_launch_run_cudnn_with_the_reason(fake_kernel, half):
    model = wavefront_stack(layers=4, units=16)
    layer = fused_with_plan(model, Plan((4,), kernel="wavefront"))
    x = wavefront_inputs()
    with torch.no_grad():
        y = layer(x, training=False)
    assert fake_kernel.calls == [] and "do not fit on chip" in layer.last_path.kernel.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL
    fake_kernel.refuse_launch = True
    small = fused_with_plan(wavefront_stack(), WAVEFRONT)
    with torch.no_grad():
        small(x, training=False)
    assert small.last_path.kernel.name == "torch._VF.lstm"
    assert "the cooperative launch was refused" in small.last_path.kernel.note


def _gradients(layer, x, weights):
    x = torch.tensor(x, requires_grad=True)
    y = layer(x, training=False).float()
    params = [v.value for v in layer.trainable_variables]
    grads = torch.autograd.grad((y * weights).sum(), [x, *params])
    return [g.double().numpy() for g in grads]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_gradients_through_an_inference_call_are_the_kernels(fake_kernel, half, kind):
    layer, x, weights = _layer_inputs_and_weights(kind)
    grads = _gradients(layer, x, weights)
    assert [c.get("saving") for c in fake_kernel.calls] == [True]
    assert fake_kernel.recurrences == 2
    assert layer.last_path.kernel.name == wavefront.TRAINING_KERNEL_NAME
    layer.set_plan(FUSED)
    for got, want in zip(grads, _gradients(layer, x, weights)):
        assert np.max(np.abs(got - want)) <= FP16_TOL * max(1.0, np.max(np.abs(want)))
    assert all(np.max(np.abs(g)) > 0 for g in grads)


def _groups(model):
    return rnnfuse.analyze(model).groups


def test_the_tuner_times_the_kernel_for_inference_and_keeps_the_faster(fake_kernel, half):
    groups = _groups(wavefront_stack())
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (result,) = tune_plans(groups, lambda g: (4, 7, 5), training=False, measure=timer,
                           progress=False)
    assert "fused on wavefront" in timer.names[0] and result.plan == WAVEFRONT
    assert fake_kernel.asked[0] == ("lstm", 2, 8, 4, 7, 5)
    assert len(fake_kernel.calls) >= 1, "the step ran the kernel (its first call)"
    slower = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 1.2})
    (kept,) = tune_plans(groups, lambda g: (4, 7, 5), training=False, measure=slower,
                         progress=False)
    assert kept.plan == Plan((2,))
    (big,) = tune_plans(_groups(wavefront_stack(layers=4, units=16)), lambda g: (4, 7, 5),
                        training=False, measure=FakeTimer({}), progress=False)
    assert "do not fit on chip" in big.rejected["fused on wavefront"]


def test_the_tuner_times_the_kernels_backward_for_an_lstms_training(fake_kernel, half):
    groups = _groups(wavefront_stack())
    trainer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "fused on wavefront": 0.5})
    (trained,) = tune_plans(groups, lambda g: (4, 7, 5), training=True, measure=trainer,
                            progress=False)
    assert "fused on wavefront" in trainer.names[0]
    assert trained.plan == WAVEFRONT and "fused on wavefront" not in trained.rejected
    assert fake_kernel.recurrences >= 2, "the step (and the gradient check) ran the backward"
    # A GRU stack is a training candidate too (its per-layer backward).
    (gru,) = tune_plans(_groups(wavefront_stack("gru")), lambda g: (4, 7, 5), training=True,
                        measure=FakeTimer({"per-layer": 2.0, "fused": 1.0,
                                           "fused on wavefront": 0.1}), progress=False)
    assert gru.plan == WAVEFRONT and "fused on wavefront" not in gru.rejected


def test_a_kernel_backward_with_wrong_gradients_is_rejected(fake_kernel, half, monkeypatch):
    def wrong(*args):
        dgates, dh0, dc0 = wavefront.recurrence_reference(*args)
        return dgates * 1.5, dh0, dc0

    monkeypatch.setattr(wavefront, "backward_layer", wrong)
    (trained,) = tune_plans(_groups(wavefront_stack()), lambda g: (4, 7, 5), training=True,
                            measure=FakeTimer({"per-layer": 2.0, "fused": 1.0,
                                               "fused on wavefront": 0.5}), progress=False)
    assert trained.plan == Plan((2,))
    assert "gradient error" in trained.rejected["fused on wavefront"]


def _tuned_here(model, tmp_path, monkeypatch, fastest):
    """(fast, its FusedRNN): `model` optimized to tune on its first batch,
    here on the CPU, on a fake timer that makes `fastest` the fastest plan
    (0.5 s against per-layer's 2 and fused's 1)."""
    monkeypatch.setattr(first_batch, "can_time_here", lambda environment=None: True)
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    state = fast._rnnfuse_autotune
    state.environment = dict(ENV)
    state.measure = FakeTimer({"per-layer": 2.0, "fused": 1.0, fastest: 0.5})
    state.fit_share = None  # a tiny predict times everything
    (layer,) = fused_layers(fast)
    return fast, layer


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_predict_and_fit_each_choose_their_plan(fake_kernel, half, tmp_path, monkeypatch, kind):
    # A device to time on (the timer is fake; the steps run on the CPU).
    model = wavefront_stack(kind)
    fast, layer = _tuned_here(model, tmp_path, monkeypatch, "fused on wavefront")
    x = wavefront_inputs(batch=8)
    y = fast.predict(x, batch_size=8, verbose=0)
    assert layer.plan == WAVEFRONT
    assert layer.last_path.kernel.name == "torch.ops.rnnfuse.wavefront_forward"
    assert max_abs_diff(y, model.predict(x, verbose=0)) <= FP16_TOL
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, np.asarray(y, "float32"), batch_size=8, epochs=1, verbose=0)
    records = {r["mode"]: r["chosen"] for r in first_batch.decisions(fast)}
    assert records == {"inference": "fused on wavefront", "training": "fused on wavefront"}
    assert layer.last_path.kernel.name == wavefront.TRAINING_KERNEL_NAME


# -- stacks larger than the chip: consecutive segments on the kernel ----------------------

SEGMENTS = Plan((2, 2), kernel="wavefront")


def test_a_stack_over_the_limit_runs_as_segments_on_the_custom_op(fake_kernel, half):
    """4 x 16 units do not fit (LIMIT 48) as one launch; 2 + 2 do: two
    launches, each over its own two layers, equal to the same split on
    cuDNN and to the original layers."""
    model = wavefront_stack(layers=4, units=16)
    layer = fused_with_plan(model, SEGMENTS)
    x = wavefront_inputs()
    with torch.no_grad():
        y = layer(x, training=False)
        ran = layer.last_path.kernel
        layer.set_plan(Plan((2, 2)))
        want = layer(x, training=False)
        layer.set_plan(Plan(()))
        original = layer(x, training=False)
    assert ran.name == wavefront.KERNEL_NAME and ran.note is None
    assert [(c["steps"], c["batch"]) for c in fake_kernel.calls] == [(7, 4)] * 2
    assert [a[1:3] + a[5:] for a in fake_kernel.asked] == [(2, 16, 5), (2, 16, 16)]
    assert max_abs_diff(y, want) <= 2e-3 and max_abs_diff(y, original) <= FP16_TOL


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_training_call_runs_each_segments_forward_and_backward(fake_kernel, half, kind):
    layer, x, weights = _layer_inputs_and_weights(kind, SEGMENTS, layers=4, units=16)
    grads = _training_gradients(layer, x, weights)
    ran = layer.last_path.kernel
    assert ran.name == wavefront.TRAINING_KERNEL_NAME and ran.note is None
    assert [c.get("saving") for c in fake_kernel.calls] == [True, True]
    assert fake_kernel.recurrences == 4, "one backward recurrence a layer of each segment"
    layer.set_plan(Plan((2, 2)))
    cudnn = _training_gradients(layer, x, weights)
    layer.set_plan(Plan(()))
    original = _training_gradients(layer, x, weights)
    assert len(grads) == 12
    for got, want, keras_own in zip(grads, cudnn, original):
        scale = max(1.0, np.max(np.abs(want)))
        assert np.max(np.abs(got - want)) <= FP16_TOL * scale
        assert np.max(np.abs(got - keras_own)) <= FP16_TOL * scale
        assert np.max(np.abs(got)) > 0


def test_a_segment_the_kernel_refuses_runs_cudnn_and_the_path_says_why(fake_kernel, half):
    model = wavefront_stack(layers=4, units=32)  # 2 x 32 > LIMIT: each segment refused
    layer = fused_with_plan(model, SEGMENTS)
    x = wavefront_inputs()
    with torch.no_grad():
        y = layer(x, training=False)
    ran = layer.last_path.kernel
    assert fake_kernel.calls == [] and ran.name == "torch._VF.lstm"
    assert "2 layers of 32 units do not fit on chip" in ran.note
    assert max_abs_diff(y, model(x)) <= FP16_TOL


@pytest.mark.parametrize("training", [False, True])
def test_the_tuner_times_segments_where_the_whole_stack_does_not_fit(
        fake_kernel, half, training):
    groups = _groups(wavefront_stack(layers=4, units=16))
    timer = FakeTimer({"per-layer": 2.0, "fused": 1.0, "split 2+2 on wavefront": 0.5})
    (result,) = tune_plans(groups, lambda g: (4, 7, 5), training=training, measure=timer,
                           progress=False)
    assert "split 2+2 on wavefront" in timer.names[0]
    assert result.plan == SEGMENTS
    assert "timed as segments that each fit instead: split 2+2 on wavefront" in (
        result.rejected["fused on wavefront"])
    assert len(fake_kernel.calls) >= 2, "the step ran both segments on the kernel"
    (slower,) = tune_plans(groups, lambda g: (4, 7, 5), training=training, progress=False,
                           measure=FakeTimer({"per-layer": 2.0, "fused": 1.0,
                                              "split 2+2 on wavefront": 1.2}))
    assert slower.plan.kernel == "cudnn"


def test_predict_and_fit_choose_segments_on_the_first_batch(
        fake_kernel, half, tmp_path, monkeypatch):
    model = wavefront_stack(layers=4, units=16)
    fast, layer = _tuned_here(model, tmp_path, monkeypatch, "split 2+2 on wavefront")
    x = wavefront_inputs(batch=8)
    y = fast.predict(x, batch_size=8, verbose=0)
    assert layer.plan == SEGMENTS
    assert layer.last_path.kernel.name == wavefront.KERNEL_NAME
    assert layer.last_path.kernel.note is None
    assert max_abs_diff(y, model.predict(x, verbose=0)) <= FP16_TOL
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, np.asarray(y, "float32"), batch_size=8, epochs=1, verbose=0)
    records = {r["mode"]: r["chosen"] for r in first_batch.decisions(fast)}
    assert records == {"inference": "split 2+2 on wavefront",
                       "training": "split 2+2 on wavefront"}
    assert layer.last_path.kernel.name == wavefront.TRAINING_KERNEL_NAME
