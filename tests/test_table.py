"""rnnfuse.tuning.table: the static plan table's rules."""

from __future__ import annotations

import pytest

from rnnfuse.tuning import table
from rnnfuse.plan import FUSED, PER_LAYER
from rnnfuse.tuning.table import Regime, plan_for_regime


@pytest.mark.parametrize(
    "regime, name",
    [
        (Regime("rnn_tanh", 512, 4, False, True, "float32", True), "fused"),
        (Regime("lstm", 512, 4, False, False, "float16", True), "fused @persistent_static+tc"),
        (Regime("gru", 1024, 4, False, False, "float32", True), "split 2+2"),
        (Regime("lstm", 1024, 2, False, False, "float32", False), PER_LAYER.name),
        (Regime("lstm", 64, 2, False, False, "float64", True), FUSED.name),
        # Refitted: SimpleRNN inference keeps Keras' (XLA-compiled) layers,
        # in every dtype; SimpleRNN training still fuses.
        (Regime("rnn_tanh", 64, 3, False, True, "float16", False), PER_LAYER.name),
        (Regime("rnn_relu", 32, 2, False, True, "float32", False), PER_LAYER.name),
        (Regime("rnn_tanh", 64, 3, False, True, "float16", True), "fused @persistent_static+tc"),
    ],
)
def test_first_matching_rule_gives_the_plan(regime, name):
    assert plan_for_regime(regime).name == name


def test_num_layers_spells_out_the_pieces():
    regime = Regime("gru", 1024, 4, False, False, "float32", True)
    assert plan_for_regime(regime, 4).pieces == (2, 2)


def test_every_rule_has_a_name_and_its_evidence():
    for name, predicate, plan, evidence in table.RULES:
        assert name and evidence and callable(predicate) and callable(plan)
    assert table.RULES[-1][1](Regime("lstm", 1, 1, False, False, "x", False))
    assert set(table.TABLES) == {"tensorflow", "fused", "per_layer"}
    assert table.TABLES["per_layer"](None, "float32", False) == PER_LAYER
