"""The online-agreement benchmark's verdicts (bench/bench_online_agreement.py):
the issue's target is read from them."""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_online_agreement as agreement  # noqa: E402

FULL = {"chosen": "fused", "timings_ms": {"fused": 10.0, "split 2+2": 10.3, "per-layer": 20.0}}


def test_a_different_choice_is_read_from_full_timings_medians():
    assert agreement.judge(FULL, {"chosen": "fused"})["verdict"] == "agrees"
    near = agreement.judge(FULL, {"chosen": "split 2+2"})
    assert near["verdict"] == "within 5%" and abs(near["ratio"] - 1.03) < 1e-9
    assert agreement.judge(FULL, {"chosen": "per-layer"})["verdict"] == "slower"
    assert agreement.judge(FULL, {"chosen": "wavefront"})["verdict"] == "unmeasured"


def test_the_target_needs_nine_in_ten_agreeing_and_no_slower_choice():
    agree = {"verdict": "agrees", "ratio": 1.0}
    near = {"verdict": "within 5%", "ratio": 1.04}
    assert agreement.summarize([agree] * 9 + [near])["met"]
    assert not agreement.summarize([agree] * 8 + [near] * 2)["met"]
    assert not agreement.summarize([agree] * 19 + [{"verdict": "slower", "ratio": 1.3}])["met"]
    assert not agreement.summarize([agree] * 19 + [{"verdict": "unmeasured", "ratio": None}])["met"]
    assert not agreement.summarize([])["met"]


# -- the decisions: full timing keeps the original layers -------------------------------


def _full_timing_keeps_the_layers(monkeypatch):
    """A model whose full timing finds the original layers fastest: optimize
    then makes no fused layer, as on a GPU where they win."""
    import rnnfuse.api
    from builders import stack_model
    from rnnfuse.plan import PER_LAYER
    from rnnfuse.tuning.tuner import TuneResult

    def measured(groups, shape_of, **kwargs):
        return [TuneResult(g, PER_LAYER, "measured", {"per-layer": 0.010, "fused": 0.012})
                for g in groups]

    monkeypatch.setattr(rnnfuse.api, "tune_plans", measured)
    model = stack_model("lstm", 2)
    return model, agreement.full_timing(model, np.zeros((4, 7, 5), "float32"))


def test_full_timing_that_keeps_the_original_layers_is_a_decision(monkeypatch):
    model, full = _full_timing_keeps_the_layers(monkeypatch)
    layers = [layer.name for layer in model.layers if isinstance(layer, keras.layers.LSTM)]
    assert full == [dict(layers=layers, chosen="per-layer", source="measured",
                         timings_ms={"per-layer": 10.0, "fused": 12.0}, rejected={})]
    same = agreement.compare(full, [dict(layers=layers, chosen="per-layer", source="online")])
    assert same["verdicts"][0]["verdict"] == "agrees"
    assert agreement.summarize(same["verdicts"])["met"]
    other = agreement.compare(full, [dict(layers=layers, chosen="fused", source="online")])
    (verdict,) = other["verdicts"]
    assert verdict["verdict"] == "slower" and abs(verdict["ratio"] - 1.2) < 1e-9
    (missing,) = agreement.compare(full, [])["verdicts"]
    assert missing["verdict"] == "undecided" and not agreement.summarize([missing])["met"]


def test_full_timing_that_timed_nothing_says_so():
    """No GPU here: the static table decides, which is no timing to compare with."""
    from builders import stack_model

    with pytest.raises(RuntimeError, match="full timing timed nothing here"):
        agreement.full_timing(stack_model("lstm", 2), np.zeros((4, 7, 5), "float32"))


def test_online_tuning_that_keeps_the_original_layers_agrees(monkeypatch, emulated_cudnn):
    """The online side on a faked device (tests/test_online.py's), where the
    original layers' steps are the fastest: its decision is the original
    layers, as full timing's, and the shape agrees."""
    from builders import race_online
    from rnnfuse.tuning import first_batch

    env = {"device": "FakeGPU", "backend": "tensorflow", "rnnfuse": "0.1.0"}
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(env))
    ran, attach = [], first_batch.attach

    def attach_racing(model, groups, state):
        made = attach(model, groups, state)
        race_online(made, {"per-layer": 1.0, "fused": 2.0, "split 1+1": 3.0}, ran)
        return made

    monkeypatch.setattr(first_batch, "attach", attach_racing)
    model, full = _full_timing_keeps_the_layers(monkeypatch)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 7, 5)).astype("float32"), rng.standard_normal((4, 6))
    online = agreement.online_decisions(model, x, y.astype("float32"), steps=30)
    assert [o["chosen"] for o in online] == ["per-layer"] and "online" in online[0]["source"]
    assert {"per-layer", "fused"} <= set(ran)
    assert agreement.summarize(agreement.compare(full, online)["verdicts"])["met"]
