"""rnnfuse.passes.pipeline: the passes run once, in order, each returning a
new frozen record; the rewrite makes a plain model and runs only on plans
the caller chose."""

from __future__ import annotations

import dataclasses

import keras
import pytest

from keras.src.models.functional import Functional

import rnnfuse
from builders import layers_model
from rnnfuse.optimized import OptimizedModel, OptimizedSequential
from rnnfuse.passes import graph as graph_module
from rnnfuse.passes.pipeline import PassOptions, PassResult, run_pipeline

L = keras.layers


def _stack(functional: bool):
    layers = [L.GRU(4, return_sequences=True, name="a"), L.GRU(4, name="b"), L.Dense(2, name="d")]
    return layers_model(layers, functional)


def _fuse_whole(report):
    return [(g, None) for g in report.groups]


@pytest.mark.parametrize("entry", ["analyze", "optimize"])
def test_analyze_and_optimize_build_the_graph_once(entry, monkeypatch):
    calls = []
    build = graph_module.build_layer_graph
    monkeypatch.setattr(graph_module, "build_layer_graph", lambda m: calls.append(m) or build(m))
    model = _stack(functional=True)
    getattr(rnnfuse, entry)(model)
    assert calls == [model]


def test_without_a_plan_choice_nothing_is_rewritten():
    found = run_pipeline(_stack(functional=False), PassOptions())
    assert [g.layers for g in found.report.groups] == [("a", "b")]
    assert found.rewritten is None and not found.modified


@pytest.mark.parametrize("functional", [False, True])
def test_the_rewrite_makes_a_plain_model_and_optimize_an_optimized_one(functional):
    model = _stack(functional)
    done = run_pipeline(model, PassOptions(choose_plans=_fuse_whole))
    assert type(done.rewritten) in (keras.Sequential, Functional)
    assert "FusedRNN" in [type(l).__name__ for l in done.rewritten.layers]
    assert [g.layers for g, _ in done.plans] == [("a", "b")]
    assert isinstance(rnnfuse.optimize(model), (OptimizedSequential, OptimizedModel))


def test_the_plan_choice_sees_the_planning_report():
    seen = []
    run_pipeline(_stack(functional=False), PassOptions(choose_plans=lambda r: seen.append(r) or []))
    assert [g.layers for g in seen[0].groups] == [("a", "b")]


def test_a_pass_result_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PassResult().report = None
