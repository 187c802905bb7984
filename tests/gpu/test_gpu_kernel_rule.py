"""The static table's kernel rule on a real GPU, on whichever Keras backend
runs the file: a fit and a predict too short to time run a stack in the
rule's regime on rnnfuse's wavefront kernel, with results close to the
same weights in float32 (Keras' own mixed_float16 LSTM fails on JAX).

    KERAS_BACKEND=torch python3 -m pytest -q tests/gpu/test_gpu_kernel_rule.py
    KERAS_BACKEND=jax python3 -m pytest -q tests/gpu/test_gpu_kernel_rule.py
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers, stack_model
from rnnfuse.backends import get_backend
from rnnfuse.tuning import first_batch

pytestmark = [pytest.mark.real_gpu_only, pytest.mark.call_budget, pytest.mark.cudnn_op]
BATCH, STEPS, FEATURES = 32, 500, 64


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _model(policy: str):
    keras.mixed_precision.set_global_policy(policy)
    try:
        return stack_model("lstm", 4, units=256, input_size=FEATURES, steps=STEPS, head=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_short_call_in_the_regime_runs_the_kernel_and_matches_float32():
    """One-step predict and fit under `optimize`'s defaults: nothing can be
    timed, the static plan is the kernel's (a silent cuDNN fallback fails),
    and the outputs and one SGD step's update match the float32 twin's."""
    rng = np.random.default_rng(3)
    twin, model = _model("float32"), _model("mixed_float16")
    model.set_weights(twin.get_weights())
    start = twin.get_weights()
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((BATCH, 3)).astype("float32")
    (group,) = rnnfuse.analyze(model).groups
    reason = get_backend().kernel_reason("wavefront", group, (BATCH, STEPS, FEATURES),
                                         training=True)
    assert reason is None, f"the kernel does not take the stack here: {reason}"
    fast = rnnfuse.optimize(model, cache=False)
    assert _rel(fast.predict(x, batch_size=BATCH, verbose=0),
                twin.predict(x, batch_size=BATCH, verbose=0)) <= 2e-2
    (layer,) = fused_layers(fast)
    assert layer.plan.kernel == "wavefront", layer.plan
    assert "wavefront" in layer.last_path.kernel.name.lower(), layer.last_path
    for m in (fast, twin):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", auto_scale_loss=False)
        m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert "wavefront" in layer.last_path.kernel.name.lower(), layer.last_path
    records = first_batch.decisions(fast)
    assert {r["mode"] for r in records} == {"inference", "training"}
    assert all(r["chosen"] == "fused on wavefront" and not r["timings_ms"] for r in records), records
    fast_delta = np.concatenate([(a - b).ravel() for a, b in zip(model.get_weights(), start)])
    twin_delta = np.concatenate([(a - b).ravel() for a, b in zip(twin.get_weights(), start)])
    assert _rel(fast_delta, twin_delta) <= 5e-2
