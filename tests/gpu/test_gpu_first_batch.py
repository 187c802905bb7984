"""First-batch tuning on the real device: timed on the GPU, plans switched.

The plan switch is forced with a timer that ranks the candidates (so the
test does not depend on which plan this GPU happens to favour), then a real
timing run checks that the chosen plan is the fastest measured one.
"""

from __future__ import annotations

import numpy as np
import pytest

import rnnfuse
from builders import assert_fastest_or_kept_original, fused_layers, max_abs_diff, stack_model
from rnnfuse.tuning import first_batch
from rnnfuse.tuning.cache import PlanCache

pytestmark = pytest.mark.gpu


def _ranked(order):
    def measure(steps):
        return {n: {"median": 1.0 + (order.index(n) if n in order else 10)} for n in steps}

    return measure


def _fit_once(fast, x, y):
    fast.compile(optimizer="adam", loss="mse")
    fast.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_first_fit_switches_plans_on_the_gpu(tmp_path):
    assert first_batch.can_time_here(), "first-batch tuning sees no GPU"
    model = stack_model("lstm", 2, units=64, input_size=16, steps=50)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 50, 16)).astype("float32")
    y = rng.standard_normal((32, 64)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "a.json"))
    (layer,) = fused_layers(fast)
    fast._rnnfuse_autotune.measure = _ranked(["per-layer"])
    _fit_once(fast, x, y)
    assert layer.plan.per_layer and layer.last_path.startswith("layers:")
    again = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "b.json"))
    (fused,) = fused_layers(again)
    fused.set_plan(rnnfuse.PER_LAYER)
    again._rnnfuse_autotune.measure = _ranked(["fused"])
    _fit_once(again, x, y)
    assert fused.plan.name == "fused" and fused.last_path == "fused"
    assert max_abs_diff(again.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-4


def test_real_timing_keeps_the_fastest_measured_plan(tmp_path):
    model = stack_model("gru", 3, units=128, input_size=32, steps=100)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 100, 32)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "c.json"))
    (result,) = first_batch.prepare(fast, x, 64, training=False)
    assert result.source == "measured" and result.timings
    assert_fastest_or_kept_original(result)
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-4


def test_a_masked_group_is_tuned_on_the_gpu_with_a_padding_mask(tmp_path):
    """A group under Embedding(mask_zero=True): timed with a right-padded mask
    (no persistent candidates, which cuDNN refuses with padded lengths), the
    choice kept, and the optimized model's numbers those of the original."""
    model = stack_model("gru", 3, units=64, input_size=16, steps=60, masked=True)
    rng = np.random.default_rng(2)
    x = rng.integers(1, 11, size=(32, 60)).astype("int32")
    for row, length in enumerate(rng.integers(20, 61, size=32)):
        x[row, length:] = 0
    y = rng.standard_normal((32, 64)).astype("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "m.json"))
    (result,) = first_batch.prepare(fast, x, 32, training=True)
    assert result.source == "measured"
    assert {"per-layer", "fused"} <= set(result.timings)
    assert not any("@" in name for name in result.timings), result.timings
    assert_fastest_or_kept_original(result)
    _fit_once(fast, x, y)
    model.compile(optimizer="adam", loss="mse")
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-4
