"""Stacks larger than the chip on the wavefront kernel, through torch, on a
real Hopper GPU (docs/kernel.md, "Stacks larger than the chip").

Runs only with KERAS_BACKEND=torch and CUDA visible to PyTorch:

    KERAS_BACKEND=torch python3 -m pytest -q -s tests/gpu/test_gpu_wavefront_segments.py

(on the lent GPU: `bash tools/gpu/batch.sh wavefront-segments`).

- The segmentation on this GPU's own plan: 8 x 512 at batch 32 and
  2 x 1024 at batch 16 are refused whole and split 4 + 4 and 1 + 1.
- A Keras 8 x 512 float16 LSTM under `split 4+4 on wavefront`: an
  inference call runs the custom op twice (a spy counts the launches and
  their shapes, so a silent fallback to cuDNN fails), the layer's path
  has no note, and the outputs match the original layers within float16
  rounding; a training call runs each segment's forward and backward
  kernels (the backward launches are counted too), and the variables'
  gradients match the original layers'. The same for 2 x 1024 as 1 + 1.
- A plan the kernel refuses (2 x 1024 whole) runs cuDNN with the reason
  and the original layers' numbers.
- The tuner: `predict` of the 8 x 512 model at batch 32, T = 1000 times
  `split 4+4 on wavefront` (the whole run's refusal says so); where it is
  chosen, it ran (the spy) and matches the original. The decision and its
  timings are a GPU_REPORT line (bench_wavefront.py segments has the
  kernel-level timings against cuDNN's best).
"""

from __future__ import annotations

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the torch backend's GPU tests need KERAS_BACKEND=torch", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rnnfuse  # noqa: E402
from builders import fused_layers  # noqa: E402
from gpu_report import report  # noqa: E402
from gpu_wavefront_checks import count_backward_launches, float16_lstm, new_launch_counts, predict_and_report, record_first_shapes, torch_variable_gradients  # noqa: E402
from rnnfuse.backends.cuda import library, segments  # noqa: E402
from rnnfuse.backends.torch import cudnn_core  # noqa: E402
from rnnfuse.backends.torch import wavefront  # noqa: E402
from rnnfuse.plan import Plan  # noqa: E402
from rnnfuse.tuning.cache import PlanCache  # noqa: E402

pytestmark = pytest.mark.real_gpu_only

# ||optimized - original|| / ||original|| in float16 (the original layers
# run cuDNN in float16 too; both are a few float16 ulps from float64).
REL_TOL = 2e-3

# (layers, units, batch, pieces): stacks this GPU runs only as segments.
SEGMENTED = [(8, 512, 32, (4, 4)), (2, 1024, 16, (1, 1))]


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wavefront kernel runs on Hopper (compute capability 9.0)")


@pytest.fixture
def launches(monkeypatch):
    """Counts the real launches (they still run): the forward custom op's
    xproj shapes, and the backward kernels' calls (stack: one a segment
    where the reverse wavefront runs it; layer: one a layer)."""
    calls = {"forward": [], **new_launch_counts()}
    record_first_shapes(monkeypatch, wavefront, "_wavefront_op", calls["forward"])
    saving = wavefront.forward_training

    def saving_spy(x, *args, **kwargs):
        calls["forward"].append(("saving", *x.shape))
        return saving(x, *args, **kwargs)

    monkeypatch.setattr(wavefront, "forward_training", saving_spy)
    return count_backward_launches(monkeypatch, calls)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _fused(layers, units, steps, pieces):
    """(a `float16_lstm`, its FusedRNN set to run `pieces` on the wavefront kernel)."""
    model = float16_lstm(layers, units, steps)
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    layer.set_plan(Plan(pieces, kernel="wavefront"))
    return model, layer


def _device_limits():
    lib = library.load()
    dev = lib.device(torch.cuda.current_device())
    return lib, dict(sms=dev["sms"], smem=dev["smem"])


@pytest.mark.parametrize("shape, want", [
    (("lstm", 8, 512, 32, 1000, 512), (4, 4)),
    (("lstm", 2, 1024, 16, 1500, 1024), (1, 1)),
])
@pytest.mark.parametrize("training", [False, True])
def test_this_gpus_plan_refuses_the_stack_whole_and_cuts_it(shape, want, training):
    lib, limits = _device_limits()
    assert "do not fit on chip" in lib.plan(*shape, **limits)
    assert segments.stack_segments(lib, *shape, training=training, **limits) == want


@pytest.mark.parametrize("layers, units, batch, pieces", SEGMENTED)
def test_an_inference_call_runs_each_segment_on_the_kernel(launches, layers, units, batch,
                                                           pieces):
    steps = 200
    model, layer = _fused(layers, units, steps, pieces)
    x = keras.ops.convert_to_tensor(
        np.random.default_rng(0).standard_normal((batch, steps, units)).astype("float32"))
    with torch.no_grad():
        y = layer(x, training=False)
        want = model(x, training=False)
    ran = layer.last_path.kernel
    assert ran.name == wavefront.KERNEL_NAME and ran.note is None, layer.last_path
    assert launches["forward"] == [(steps, batch, 4 * units)] * len(pieces), launches
    rel = _rel(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(want))
    report("wavefront_segments_inference", {"shape": f"{layers}x{units} B{batch} T{steps}",
                                             "pieces": list(pieces), "rel_diff": rel})
    assert rel <= REL_TOL, rel


@pytest.mark.parametrize("layers, units, batch, pieces", SEGMENTED)
def test_a_training_call_runs_each_segments_forward_and_backward(launches, layers, units, batch,
                                                                 pieces):
    steps = 100
    model, layer = _fused(layers, units, steps, pieces)
    rng = np.random.default_rng(1)
    x = keras.ops.convert_to_tensor(rng.standard_normal((batch, steps, units)).astype("float32"))
    upstream = torch.as_tensor(rng.standard_normal((batch, steps, units)), dtype=torch.float32,
                               device=x.device)
    got = torch_variable_gradients(layer, x, upstream, model.trainable_variables)
    ran = layer.last_path.kernel
    assert ran.name == wavefront.TRAINING_KERNEL_NAME and ran.note is None, layer.last_path
    assert [c[0] for c in launches["forward"]] == ["saving"] * len(pieces), launches
    # Each segment's backward: one reverse-wavefront launch, or one a layer.
    stack, per_layer = launches["stack"], launches["layer"]
    assert stack + per_layer >= len(pieces) and (stack == len(pieces) or per_layer), launches
    want = torch_variable_gradients(model, x, upstream, model.trainable_variables)
    rel = max(float(torch.linalg.norm(g - w) / torch.linalg.norm(w)) for g, w in zip(got, want))
    report("wavefront_segments_training", {"shape": f"{layers}x{units} B{batch} T{steps}",
                                            "pieces": list(pieces), "backward": ran.algorithm,
                                            "grad_rel_diff": rel})
    assert rel <= 2e-2, rel


def test_a_plan_the_kernel_refuses_runs_cudnn_with_the_reason(launches):
    model, layer = _fused(2, 1024, 50, (2,))
    x = keras.ops.convert_to_tensor(
        np.random.default_rng(2).standard_normal((16, 50, 1024)).astype("float32"))
    with torch.no_grad():
        y = layer(x, training=False)
        want = model(x, training=False)
    ran = layer.last_path.kernel
    # cuDNN runs it: rnnfuse's core, or torch._VF where the core cannot.
    assert launches["forward"] == [] and ran.name in (cudnn_core.KERNEL_NAME, "torch._VF.lstm"), layer.last_path
    assert "do not fit on chip" in ran.note, ran
    assert _rel(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(want)) <= REL_TOL


def test_predict_of_an_8x512_lstm_at_batch_32_times_the_segments(tmp_path, launches):
    model = float16_lstm(8, 512, 1000)
    x = np.random.default_rng(3).standard_normal((64, 1000, 512)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    (layer,) = fused_layers(fast)
    y, record = predict_and_report("wavefront_segments_predict", "8x512 LSTM B32 T1000 float16",
                                   fast, x, 32)
    assert "split 4+4 on wavefront" in record["timings_ms"], record
    assert "split 4+4 on wavefront" in record["rejected"]["fused on wavefront"], record
    want = model.predict(x, batch_size=32, verbose=0)
    assert _rel(y, want) <= REL_TOL
    if record["chosen"] == "split 4+4 on wavefront":
        ran = layer.last_path.kernel
        assert ran.name == wavefront.KERNEL_NAME and ran.note is None, layer.last_path
        before = len(launches["forward"])
        fast.predict(x, batch_size=32, verbose=0)
        assert launches["forward"][before:] == [(1000, 32, 2048)] * 4, launches["forward"]
