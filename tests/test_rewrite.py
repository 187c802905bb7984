"""rnnfuse.passes.rewrite: groups become FusedRNN layers; counted rewrites,
positive and negative; failures recorded, not swallowed."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import rnnfuse
from rnnfuse.passes import build_layer_graph, plan_fusion, rewrite
from rnnfuse.passes.rewrite import rewrite_with_failures

from builders import fused_layers, max_abs_diff

L = keras.layers


def _groups(model):
    return plan_fusion(build_layer_graph(model), model_name=model.name).groups


def _two_runs(functional: bool):
    layers = [
        L.GRU(4, return_sequences=True, name="g1"),
        L.GRU(4, return_sequences=True, name="g2"),
        L.Dense(5, name="mid"),
        L.LSTM(5, return_sequences=True, name="l1"),
        L.LSTM(5, name="l2"),
    ]
    if not functional:
        return keras.Sequential([keras.Input((6, 3)), *layers])
    x = inp = keras.Input((6, 3))
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("functional", [False, True])
def test_each_group_is_one_rewrite(functional):
    model = _two_runs(functional)
    new, failed = rewrite_with_failures(model, _groups(model))
    assert failed == ()
    assert [[l.name for l in f.fused_layers] for f in fused_layers(new)] == [["g1", "g2"], ["l1", "l2"]]
    x = np.random.default_rng(0).standard_normal((2, 6, 3)).astype("float32")
    assert max_abs_diff(new(x), model(x)) == 0.0


@pytest.mark.parametrize("functional", [False, True])
def test_no_group_is_zero_rewrites(functional):
    model = _two_runs(functional)
    new, failed = rewrite_with_failures(model, [])
    assert fused_layers(new) == [] and failed == ()
    named = lambda m: [l.name for l in m.layers if not isinstance(l, keras.layers.InputLayer)]
    assert named(new) == named(model)


def test_a_run_broken_by_a_rule_is_zero_rewrites():
    model = keras.Sequential(
        [keras.Input((6, 3)), L.LSTM(4, return_sequences=True), L.LSTM(8)]
    )
    assert _groups(model) == ()
    assert fused_layers(rnnfuse.optimize(model)) == []


def test_a_failed_group_is_recorded_in_the_result(monkeypatch):
    real = rewrite.FusedRNN

    def flaky(layers, **kwargs):
        if layers[0].name == "g1":
            raise ValueError("cannot stack")
        return real(layers, **kwargs)

    monkeypatch.setattr(rewrite, "FusedRNN", flaky)
    model = _two_runs(True)
    with pytest.warns(rnnfuse.FusionWarning, match="g1 -> g2"):
        result = rnnfuse.optimize(model, return_result=True)
    (failure,) = result.failed
    assert failure.group.layers == ("g1", "g2")
    assert failure.reason == "ValueError: cannot stack"
    assert len(fused_layers(result.model)) == 1
