"""rnnfuse.rules: the registry, the generated rule table, and every
recurrent layer accounted for."""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import types

import keras
import pytest

import rnnfuse
from rnnfuse import rules
from rnnfuse.passes.graph import is_graph_model
from rnnfuse.recurrent import is_recurrent

L = keras.layers
ROOT = pathlib.Path(rnnfuse.__file__).parent
GUIDE = ROOT.parent / "docs" / "guide.md"
EXAMPLES = ROOT.parent / "examples"


def test_guide_rule_table_is_generated_from_the_registry():
    sys.path.insert(0, str(ROOT.parent / "tools"))
    try:
        import rules_table
    finally:
        sys.path.remove(str(ROOT.parent / "tools"))
    text = GUIDE.read_text()
    assert "<!-- rules-table:begin -->" in text
    assert rules_table.render(text) == text, "run: python tools/rules_table.py"


def test_every_rule_has_a_scope_and_a_one_line_doc():
    for (scope, name), r in rules.RULES.items():
        assert (r.scope, r.name) == (scope, name)
        assert scope in rules.SCOPES
        assert r.doc and "\n" not in r.doc and "|" not in r.doc
        assert callable(r.check)


def test_every_reason_rnnfuse_gives_names_a_registered_rule():
    """Every `Reason("<rule>", ...)` in the package names a registry rule
    (describe's two structural answers aside: they never reach a report).
    A check that returns a bare message gets its own rule's name."""
    names = {name for _, name in rules.RULES}
    structural = {"not_recurrent", "not_described"}
    found = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Reason"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    assert found - names - structural == set()


def test_a_check_that_returns_a_message_gives_a_reason_of_its_rule():
    r = rules.RULES[("layer", "recurrent_dropout")]
    cell = types.SimpleNamespace(recurrent_dropout=0.5)
    reason = r.check(cell, None)
    assert reason.rule == "recurrent_dropout" and "recurrent_dropout=0.5" in reason
    assert r.check(types.SimpleNamespace(recurrent_dropout=0), None) is None


def _seq(*layers, shape=(6, 4)):
    return keras.Sequential([keras.Input(shape), *layers])


def test_a_layer_next_to_an_unfusable_one_names_its_own_rule():
    model = _seq(
        L.GRU(4, recurrent_dropout=0.2, return_sequences=True, name="g"),
        L.SimpleRNN(4, name="s"),
    )
    # By default a SimpleRNN fuses from one layer (a loop kind) ...
    assert [g.layers for g in rnnfuse.analyze(model).groups] == [("s",)]
    # ... with min_layers=2 it stays, naming its neighbour's rule.
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.skipped["g"].rule == "recurrent_dropout"
    assert report.skipped["s"].rule == "neighbour_unfusable"
    assert "'g'" in report.skipped["s"] and "recurrent_dropout" in report.skipped["s"]


def test_encoder_decoder_initial_state_link_is_not_sequence_input():
    enc_in, dec_in = keras.Input((5, 3)), keras.Input((4, 3))
    _, h, c = L.LSTM(8, return_state=True, name="enc")(enc_in)
    out = L.LSTM(8, name="dec")(dec_in, initial_state=[h, c])
    model = keras.Model([enc_in, dec_in], out)
    report = rnnfuse.analyze(model)
    # Two groups of one, not one stack.
    assert [g.layers for g in report.groups] == [("enc",), ("dec",)]
    assert report.breaks[("enc", "dec")].rule == "not_sequence_input"
    assert "'initial_state'" in report.breaks[("enc", "dec")]
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.skipped["enc"].rule == "not_sequence_input"
    assert report.skipped["dec"].rule == "not_sequence_input"


class _Holder(L.Layer):
    """A custom layer that runs an LSTM inside its call()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.LSTM(4, return_sequences=True, name="inner_lstm")

    def call(self, x):
        return self.inner(x)


def _accounted(model, report) -> tuple[int, int]:
    """(recurrent layers anywhere in `model`, layers the report names)."""
    count = 0

    def walk(layer):
        nonlocal count
        for sub in layer.layers if is_graph_model(layer) else []:
            if is_graph_model(sub):
                walk(sub)
            elif is_recurrent(sub):
                count += 1
            else:
                count += len(rules.recurrent_sublayers(sub))

    walk(model)
    named = len(report.skipped) + sum(len(g.layers) for g in report.groups)
    return count, named


def test_recurrent_layers_in_wrappers_and_custom_layers_get_a_reason():
    inp = keras.Input((3, 6, 4))
    x = L.TimeDistributed(L.LSTM(4, name="frame_lstm"), name="td")(inp)
    y = _Holder(name="holder")(x)
    y = L.LSTM(4, return_sequences=True, name="a")(y)
    out = L.LSTM(4, name="b")(y)
    model = keras.Model(inp, out)
    report = rnnfuse.analyze(model)
    assert report.skipped["td/frame_lstm"].rule == "wrapped_layer"
    assert report.skipped["holder/inner_lstm"].rule == "wrapped_layer"
    assert "TimeDistributed" in report.skipped["td/frame_lstm"]
    assert [g.layers for g in report.groups] == [("a", "b")]
    count, named = _accounted(model, report)
    assert count == named == 4


@pytest.mark.parametrize("name", ["text_classifier", "speech_encoder", "forecaster"])
def test_every_recurrent_layer_of_the_examples_is_accounted_for(name):
    sys.path.insert(0, str(EXAMPLES))
    try:
        module = __import__(name)
    finally:
        sys.path.remove(str(EXAMPLES))
    model = module.build_model()
    count, named = _accounted(model, rnnfuse.analyze(model))
    assert count == named > 0


def test_layer_reason_runs_the_registry_in_order():
    layer = L.LSTM(4, unroll=True, recurrent_dropout=0.1)
    layer.build((None, 3, 2))
    # Part rules run before cell rules.
    assert rules.layer_reason(layer).rule == "unroll"
    bi = L.Bidirectional(L.GRU(4, reset_after=False))
    bi.build((None, 3, 2))
    reason = rules.layer_reason(bi)
    assert reason.rule == "reset_after" and reason.startswith("its forward layer")


def test_rules_for_is_remembered_and_sees_a_rule_registered_later(monkeypatch):
    """The runtime check asks the same question on every call: the answer
    is kept, and a rule added to the registry afterwards is in the next one."""
    from rnnfuse.rules import registry

    first = rules.rules_for("runtime", "call")
    assert rules.rules_for("runtime", "call") == first
    late = rules.Rule("late_rule", "runtime", "a rule registered after the first call",
                      lambda *args: "late", "call")
    monkeypatch.setitem(registry.RULES, ("runtime", "late_rule"), late)
    assert rules.rules_for("runtime", "call") == first + [late]
