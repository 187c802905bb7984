"""Per-shape decisions on the real device (rnnfuse/tuning/per_shape.py).

The predict case: 8x LSTM(128), T=20. Inference tuned at batch 32
(Keras' `predict` default) once chose persistent_dynamic (4.18 ms a layer
against 5.82), whose speed does not carry: `predict(x, batch_size=128)` then
ran 0.68x. Now the new bucket is timed before it runs, and predict at 128
must be at least 0.97x of the original model's.

    python -m pytest -q -s tests/gpu/test_gpu_per_shape.py
"""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, max_abs_diff
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache

# Both time on the device (first-batch and per-shape tuning see a GPU only
# there): left out of RNNFUSE_GPU_DRYRUN runs. `cudnn_op`: with rnnfuse's
# op loaded, as users run (conftest turns it off for the older tests).
pytestmark = [pytest.mark.gpu, pytest.mark.real_gpu_only, pytest.mark.cudnn_op]

ROUNDS = 7


def _model():
    layers = [keras.layers.LSTM(128, return_sequences=i < 7) for i in range(8)]
    return keras.Sequential([keras.Input((20, 128)), *layers, keras.layers.Dense(1)])


def _call_seconds(model, x, batch_size):
    start = time.perf_counter()
    model.predict(x, batch_size=batch_size, verbose=0)
    return time.perf_counter() - start


def test_predict_at_four_times_the_tuned_batch_is_not_slower(tmp_path):
    model = _model()
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    assert getattr(fast, "_rnnfuse_autotune", None) is not None, "first-batch tuning sees no GPU"
    x = np.random.default_rng(0).standard_normal((128 * 32, 20, 128)).astype("float32")
    fast.predict(x[:256], verbose=0)  # tuned at batch 32, predict's default
    out = fast.predict(x, batch_size=128, verbose=0)  # a new bucket: timed first
    assert max_abs_diff(out, model.predict(x, batch_size=128, verbose=0)) <= 1e-3
    buckets = {tuple(r["bucket"]): r for r in first_batch.decisions(fast) if r["mode"] == "inference"}
    assert set(buckets) == {(32, 16), (128, 16)}, buckets
    at_128 = buckets[(128, 16)]
    assert at_128["source"].startswith("measured"), at_128
    (layer,) = fused_layers(fast)
    if at_128["chosen"] != "per-layer":
        # Not a silent fallback: the chosen fused plan ran on rnnfuse's op.
        assert layer.last_path == "fused" and layer.last_path.kernel.name == "RnnfuseCudnnRnn", (
            layer.last_path.kernel, at_128)
        assert at_128["chosen"].partition("@")[2] == layer.last_path.kernel.algorithm.replace("standard", "")
    times = {"original": [], "optimized": []}
    for r in range(ROUNDS):  # interleaved whole predict calls, warm
        for name, m in (("original", model), ("optimized", fast))[:: 1 if r % 2 == 0 else -1]:
            times[name].append(_call_seconds(m, x, 128))
    speedup = statistics.median(times["original"]) / statistics.median(times["optimized"])
    print(f"predict at 128 after tuning at 32: {speedup:.2f}x", at_128["chosen"], at_128["timings_ms"])
    assert speedup >= 0.97, (speedup, at_128)


def _tape_step(model, x, y):
    import tensorflow as tf

    optimizer = keras.optimizers.Adam()
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32) - y))
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    return lambda: float(step())


def test_a_custom_gradient_tape_loop_gets_a_timed_plan_and_is_not_slower(tmp_path):
    """A custom training loop: 4x LSTM(256), B8, T200, float32, in the
    user's own tf.function: the fused layer times its plan at the step's
    first trace (it ran the static table's plan at 0.82x before)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("a GradientTape loop")
    inp = keras.Input((200, 256))
    h = inp
    for i in range(4):
        h = keras.layers.LSTM(256, return_sequences=i < 3)(h)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 200, 256)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    steps = {"original": _tape_step(model, x, y), "optimized": _tape_step(fast, x, y)}
    for step in steps.values():
        step()  # traces; the optimized one times its plan inside the trace
    (record,) = first_batch.decisions(fast)
    assert record["mode"] == "training" and record["source"].startswith("measured"), record
    (layer,) = fused_layers(fast)
    if record["chosen"] != "per-layer":
        assert layer.last_path.kernel is not None and layer.last_path.kernel.name == "RnnfuseCudnnRnn", (
            layer.last_path.kernel, record)
    times = {name: [] for name in steps}
    for r in range(ROUNDS):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            for _ in range(10):
                steps[name]()
            times[name].append((time.perf_counter() - start) / 10)
    speedup = statistics.median(times["original"]) / statistics.median(times["optimized"])
    print(f"custom loop 4x LSTM(256) B8 T200: {speedup:.2f}x", record["chosen"], record["timings_ms"])
    assert speedup >= 0.97, (speedup, record)
