"""Lone LSTM/GRU layers and encoder-decoder links as groups of one on the
TensorFlow backend (the fused path through the emulated CudnnRNNV3):
their groups, their plans (static and first-batch tuned), and outputs,
states and gradients against the original (tests/single_layer_checks.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from builders import fused_layers, max_abs_diff
from single_layer_checks import MODELS, assert_fused_matches, assert_groups_of_one, build, inputs
from test_first_batch import FakeTimer, _optimize, fake_gpu  # noqa: F401 (a fixture)

import rnnfuse
from rnnfuse.tuning.cache import PlanCache
from rnnfuse.tuning.plans import candidate_plans


@pytest.mark.parametrize("name", sorted(MODELS))
def test_groups_of_one_fused_match_the_original(name, emulated_cudnn):
    model = build(name)
    assert_groups_of_one(name, model)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert [tuple(l.name for l in f.fused_layers) for f in fused_layers(fast)] == MODELS[name][1]
    emulated_cudnn.clear()
    assert_fused_matches(model, fast, tol=1e-5, grad_tol=1e-4)
    # One emulated kernel call per group, in each of the two runs (the
    # masked model's call traces both branches of its mask check once).
    assert len(emulated_cudnn) >= len(MODELS[name][1])


def test_the_report_says_why_encoder_and_decoder_are_two_calls():
    report = rnnfuse.analyze(build("seq2seq"))
    (entry,) = report.to_dict()["breaks"]
    assert entry["layers"] == ["encoder", "decoder"] and entry["rule"] == "not_sequence_input"
    assert "'decoder' reads 'encoder' as 'initial_state'" in entry["reason"]
    assert "separate groups: 'encoder' -> 'decoder' (not_sequence_input)" in str(report)
    # LSTMs kept apart by other layers have no link, so no break.
    assert not rnnfuse.analyze(build("forecaster")).breaks


def test_the_decoder_starts_from_the_encoders_states(emulated_cudnn):
    model = build("seq2seq")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = inputs(model)
    emulated_cudnn.clear()
    fast(x)
    encoder, decoder = emulated_cudnn
    _, h, c = model.get_layer("encoder")(x[0])
    np.testing.assert_allclose(np.asarray(decoder["input_h"])[0], np.asarray(h), atol=1e-6)
    np.testing.assert_allclose(np.asarray(decoder["input_c"])[0], np.asarray(c), atol=1e-6)
    assert not np.asarray(encoder["input_h"]).any()


def test_the_static_plan_keeps_keras_layer_for_a_group_of_one(emulated_cudnn):
    """No row of the static table measured a lone Keras LSTM/GRU faster
    fused: without timing (tune=False, or a user's own tf.function) the
    original layers run, in float16 too; stacks keep their plans."""
    for name in ("lstm", "seq2seq", "forecaster"):
        model = build(name)
        result = rnnfuse.optimize(model, tune=False, return_result=True)
        assert [(r.plan.name, r.source) for r in result.plans] == [("per-layer", "static")] * len(MODELS[name][1])
        assert fused_layers(result.model) == []
        assert max_abs_diff(result.model(inputs(model)), model(inputs(model))) == 0.0
    keras.config.set_dtype_policy("mixed_float16")
    model = build("lstm")
    keras.config.set_dtype_policy("float32")
    (result,) = rnnfuse.optimize(model, tune=False, return_result=True).plans
    assert result.plan.name == "per-layer"
    stack = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4, return_sequences=True), keras.layers.LSTM(4)])
    (result,) = rnnfuse.optimize(stack, tune=False, return_result=True).plans
    assert result.plan.name == "fused"


def test_a_group_of_one_times_the_original_against_each_algorithm():
    model = build("lstm")
    (group,) = rnnfuse.analyze(model).groups
    names = [p.name for p in candidate_plans(group)]
    assert names == ["per-layer", "fused", "fused @persistent_static+tc", "fused @persistent_dynamic+tc"]


@pytest.mark.parametrize(
    "medians,chosen",
    [({"per-layer": 3.0, "fused": 2.0}, "fused"), ({"per-layer": 3.0, "fused": 2.8}, "per-layer")],
    ids=["fused_wins", "within_the_margin"],
)
def test_first_batch_tuning_decides_each_group_of_one(medians, chosen, fake_gpu, emulated_cudnn, tmp_path):  # noqa: F811
    model = build("seq2seq")
    fast = _optimize(model, FakeTimer(medians), PlanCache(tmp_path / "plans.json"))
    x = inputs(model, batch=8)
    y = [np.asarray(t) for t in model.predict(x, verbose=0)]
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=8, epochs=1, verbose=0)
    layers = fused_layers(fast)
    assert [l.name for l in layers] == ["fused_encoder", "fused_decoder"]
    for layer in layers:
        assert layer.plan == (rnnfuse.Plan((1,)) if chosen == "fused" else rnnfuse.PER_LAYER)
        assert layer.last_path.kind.value == ("fused" if chosen == "fused" else "layers")
    records = rnnfuse.tuning.first_batch.decisions(fast)
    assert [r["chosen"] for r in records] == [chosen, chosen]
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 2e-5
