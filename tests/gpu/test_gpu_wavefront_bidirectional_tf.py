"""Bidirectional stacks on rnnfuse's wavefront ops under TensorFlow on a
real Hopper GPU (rnnfuse/backends/tensorflow/wavefront_bidirectional.py,
its switch turned on here):

    python3 -m pytest -q -s tests/gpu/test_gpu_wavefront_bidirectional_tf.py

(on the lent GPU: `TF_TESTS=tests/gpu/test_gpu_wavefront_bidirectional_tf.py
bash tools/gpu/batch.sh tf-setup tf-build tf-tests`).

A FusedRNN of Keras Bidirectional LSTM / GRU layers on the "wavefront"
plan in mixed_float16, against the same layers in float32 on Keras'
generic loop: outputs and every gradient (a tape of a weighted sum, in a
tf.function) as ||a - b|| / ||b||, a masked call included, and a predict
step. Spies on the one-layer calls (the inference op's `forward`, the
saving forward, the backward recurrences) record what each traced step
ran, so a silent fallback to cuDNN fails.

RNNFUSE_GPU_DRYRUN=1 runs them on the CPU with the faked ops of
tests/wavefront_fakes.py, to check the tests themselves.
"""

from __future__ import annotations

import os

import keras
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip("the TensorFlow GPU tests need KERAS_BACKEND=tensorflow",
                allow_module_level=True)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from builders import bidirectional_stack, fused_layers  # noqa: E402
from gpu_compare import fused_and_generic_twin, rel as _rel  # noqa: E402
from gpu_report import report  # noqa: E402
from rnnfuse.backends import tensorflow as tf_backend  # noqa: E402
from rnnfuse.backends.tensorflow import op_build, wavefront_op  # noqa: E402
from rnnfuse.backends.tensorflow import wavefront_bidirectional as bidir  # noqa: E402
from rnnfuse.backends.tensorflow import wavefront_training  # noqa: E402

# The op loads with RNNFUSE_DISABLE_OP unset (tests/gpu/conftest.py).
pytestmark = pytest.mark.cudnn_op
DRYRUN = bool(os.environ.get("RNNFUSE_GPU_DRYRUN"))
HOPPER = ("H100", "H200", "H800", "GH200")
TOLERANCE = 1e-2  # float16 against float32, ||a - b|| / ||b||; gradients twice this
FEATURES = 32


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setattr(bidir, "BIDIRECTIONAL", True)
    if DRYRUN:
        from wavefront_fakes import install

        install(monkeypatch, 10**6)
        return
    device = tf_backend.device_environment()["device"]
    if not any(name in device for name in HOPPER):
        pytest.skip(f"the wavefront kernel runs on Hopper; this GPU is {device}")
    op_build.reset_for_tests()
    if op_build.load_wavefront_op() is None:
        pytest.fail(f"the wavefront op did not load: {op_build.wavefront_load_failure()}")


@pytest.fixture
def traced(monkeypatch):
    """The one-layer calls traced into steps from now on, in order (they still run)."""
    names = []
    for module, attr, name in [(wavefront_op, "forward", "forward"),
                               (wavefront_training, "forward_saving", "forward_saving"),
                               (wavefront_training, "backward_layer", "backward_layer"),
                               (wavefront_training, "backward_stack_kernel", "backward_stack")]:
        real = getattr(module, attr)

        def spy(*args, real=real, name=name, **kwargs):
            names.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, attr, spy)
    return names


def _models(kind, layers, units, steps, merge_mode, masked):
    """(the model in mixed_float16 optimized onto the wavefront plan, the
    same layers in float32 on Keras' generic loop with its weights)."""
    return fused_and_generic_twin(
        lambda: bidirectional_stack(kind, merge_mode, layers, units, steps, features=FEATURES,
                                    masked=masked), "mixed_float16")


def _outputs_and_grads(model, x, weights):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            out = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_sum(out * weights)
        return out, tape.gradient(loss, model.trainable_variables)

    return step(x)


@pytest.mark.parametrize("kind,layers,units,merge_mode,masked", [
    ("lstm", 2, 128, "concat", True), ("gru", 3, 64, "sum", False)])
def test_outputs_and_gradients_match_keras_bidirectional_in_float32(
        kind, layers, units, merge_mode, masked, traced):
    steps, batch = (10, 4) if DRYRUN else (40, 16)
    fast, reference = _models(kind, layers, units, steps, merge_mode, masked)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, steps, FEATURES)).astype("float32")
    if masked:  # right-padded lengths down to 1; the padding is zeros
        lengths = np.linspace(steps, 1, batch).astype(int)
        x[np.arange(steps)[None, :] >= lengths[:, None]] = 0.0
    x = tf.constant(x)
    weights = tf.constant(rng.standard_normal(reference(x).shape), tf.float32)
    out, grads = _outputs_and_grads(fast, x, weights)
    (layer,) = fused_layers(fast)
    ran = layer.last_path.kernel
    assert layer.last_path.kind == "fused", layer.last_path
    assert ran.name == wavefront_op.TRAINING_KERNEL_NAME and ran.note is None, ran
    assert ran.algorithm.startswith(bidir.ALGORITHM), ran
    backward = "backward_stack" if ran.algorithm.endswith("stack") else "backward_layer"
    # One call a direction of each layer (a masked step may trace a branch again).
    assert traced.count("forward_saving") >= 2 * layers, traced
    assert traced.count(backward) >= 2 * layers, traced
    want_out, want_grads = _outputs_and_grads(reference, x, weights)
    errors = {"out": _rel(out, want_out)}
    errors.update({f"grad_{v.path}": _rel(g, w)
                   for v, g, w in zip(fast.trainable_variables, grads, want_grads)})
    report(f"tf_wavefront_bidirectional_{kind}", errors)
    for name, err in errors.items():
        assert err <= (2 * TOLERANCE if name.startswith("grad") else TOLERANCE), (name, err)
    del traced[:]
    predicted = np.asarray(fast.predict(x, batch_size=batch, verbose=0), np.float32)
    assert traced.count("forward") >= 2 * layers, traced
    assert layer.last_path.kernel.name == wavefront_op.KERNEL_NAME, layer.last_path
    assert layer.last_path.kernel.note is None, layer.last_path
    assert _rel(predicted, want_out) <= TOLERANCE
