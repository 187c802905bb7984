"""rnnfuse.placement: where a group's plan runs here (CPU, TensorFlow)."""

from __future__ import annotations

from rnnfuse import placement as pl
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.plan import FUSED, PER_LAYER, Plan


def test_a_per_layer_plan_runs_the_original_layers_with_the_source_as_reason():
    static = pl.placement(PER_LAYER)
    assert (static.fused, static.how) == (False, "the original layers")
    assert "static plan" in static.why
    assert "forced" in pl.placement(PER_LAYER, "forced").why
    assert "timing" in pl.placement(PER_LAYER, "tuned:first_batch").why
    assert str(static) == f"the original layers ({static.why})"


def test_fused_plans_need_the_kernel_to_be_available(monkeypatch):
    monkeypatch.setattr(tf_backend, "is_available", lambda: False)
    where = pl.placement(FUSED)
    assert not where.fused and "needs a CUDA GPU" in where.why
    monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    assert pl.placement(FUSED) == pl.Placement(True, "one fused call")
    assert pl.placement(Plan((2, 2))).how == "2 fused calls"


def test_nothing_fused_reason_joins_distinct_reasons_or_is_none(monkeypatch):
    monkeypatch.setattr(tf_backend, "is_available", lambda: False)
    assert pl.nothing_fused_reason([]) is None
    why = pl.nothing_fused_reason([FUSED, FUSED, PER_LAYER], ["static"] * 3)
    assert why.count("needs a CUDA GPU") == 1 and "; " in why
    monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    assert pl.nothing_fused_reason([PER_LAYER, FUSED]) is None
    assert pl.backend_name() == "tensorflow"
