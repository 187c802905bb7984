"""MirroredStrategy over two GPUs with the fused cuDNN kernel on each replica.

Two real GPUs, or one GPU split into two logical GPUs
by the plugin tests/gpu/logical_gpus.py, which tools/gpu/run_tests.sh loads
(it changes nothing where there are two GPUs):

    PYTHONPATH=tests/gpu python3 -m pytest -p logical_gpus tests/gpu/test_gpu_distribute.py

Skipped without a GPU, or with one GPU and no plugin; fails if the plugin is
loaded and TensorFlow still sees fewer than two GPUs. On logical GPUs it
shows correctness and replica consistency (each replica traces the fused
kernel, the replica copies stay equal, losses and weights match single-GPU
training), not scaling: both replicas share one GPU (see the plugin's
docstring and docs/deployment.md). With RNNFUSE_REPORT_DIR set, writes the
numbers (loss curves, epoch times, replica spread, physical and logical
GPUs) there as distribute.json.

The all-reduce is `ReductionToOneDevice`, not NCCL: the staged TensorFlow
carries no NCCL library, and the lent machines keep NVLink multicast off
(NCCL_NVLS_ENABLE=0 is kept set here in any case).
"""

from __future__ import annotations

import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gpu_report import report  # noqa: E402
from gpu_timing import EpochTimes  # noqa: E402

import rnnfuse  # noqa: E402
from rnnfuse.backends import tensorflow as tf_backend  # noqa: E402

STEPS, FEATURES, UNITS = 64, 32, 128
GLOBAL_BATCH, SAMPLES, EPOCHS = 128, 1024, 3


def _gpus() -> list:
    import tensorflow as tf

    return tf.config.list_logical_devices("GPU")


def _split_asked() -> bool:
    """Whether the logical-GPU plugin was loaded (`-p logical_gpus`)."""
    return "logical_gpus" in sys.modules


pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow" or not _gpus() or (len(_gpus()) < 2 and not _split_asked()),
    reason="needs TensorFlow and two GPUs (on one GPU: -p logical_gpus, see the module doc)",
)


def _stack() -> keras.Model:
    return keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.LSTM(UNITS, return_sequences=True),
        keras.layers.LSTM(UNITS, return_sequences=True),
        keras.layers.LSTM(UNITS),
        keras.layers.Dense(4),
    ])


def test_mirrored_fit_on_two_gpus_trains_the_same_variables(monkeypatch, tmp_path):
    import tensorflow as tf

    assert len(_gpus()) >= 2, "the logical-GPU plugin is loaded but TensorFlow sees one GPU"
    calls = []
    real = tf_backend.cudnn_rnn
    monkeypatch.setattr(tf_backend, "cudnn_rnn", lambda **kw: calls.append(1) or real(**kw))
    devices = [d.name for d in _gpus()[:2]]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((SAMPLES, 4)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _stack()
        fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)  # whatever the table says
        fast.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    initial = model.get_weights()
    timer = EpochTimes()
    got = fast.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                   verbose=0, callbacks=[timer])
    assert len(calls) >= 2, "the fused kernel was not traced on both replicas"
    spread = 0.0
    for v in model.trainable_variables:
        copies = strategy.experimental_local_results(v.value)
        assert len(copies) == 2
        assert len({c.device for c in copies}) == 2
        spread = max(spread, max(float(np.max(np.abs(c.numpy() - copies[0].numpy())))
                                 for c in copies))
    # Single-GPU reference: the same global batches, the original layers.
    reference = _stack()
    reference.set_weights(initial)
    reference.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    ref_timer = EpochTimes()
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                         verbose=0, callbacks=[ref_timer])
    weight_diff = max(float(np.max(np.abs(a - b)))
                      for a, b in zip(model.get_weights(), reference.get_weights()))
    report("distribute", {
        "devices": devices,
        "physical_gpus": len(tf.config.list_physical_devices("GPU")),
        "logical_gpus": len(_gpus()),
        "loss_mirrored_fused": got.history["loss"],
        "loss_single_gpu_original": want.history["loss"],
        "epoch_s_mirrored_fused": timer.times,
        "epoch_s_single_gpu_original": ref_timer.times,
        "replica_spread": spread,
        "max_weight_diff": weight_diff,
        "fused_calls": len(calls),
    })
    # The trained result saves (the original's file) and loads.
    fast.save(tmp_path / "fast.keras")
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "fast.keras")
    plain = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded) is keras.Sequential
    want_y = model.predict(x[:32], verbose=0)
    assert float(np.max(np.abs(loaded.predict(x[:32], verbose=0) - want_y))) <= 1e-4
    assert float(np.max(np.abs(plain.predict(x[:32], verbose=0) - want_y))) <= 1e-4
    assert spread == 0.0
    assert got.history["loss"][-1] < got.history["loss"][0]
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-3)
    assert weight_diff <= 1e-3
