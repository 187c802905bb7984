"""rnnfuse.rules.runs: run and backend rules, called directly (the planner's
use of them is in test_rules.py)."""

from __future__ import annotations

import types

import networkx as nx

from rnnfuse.backends.base import NoFusedKernel
from rnnfuse.reasons import Reason
from rnnfuse.rules import runs


def test_dropout_between_compares_the_gap_with_the_run():
    assert runs.dropout_between("a", "b", 0.1, 0.1) is None
    why = runs.dropout_between("a", "b", None, 0.2)
    assert why.rule == "dropout_between"
    assert "between 'a' and 'b' there is no Dropout" in why and "Dropout(0.2)" in why


def test_min_layers_counts_levels():
    assert runs.min_layers_reason(("a", "b"), 2, 2) is None
    assert str(runs.min_layers_reason(("a",), 1, 2)) == "min_layers=2"
    assert "(a -> b) has 2 recurrent levels, fewer than min_layers=3" in runs.min_layers_reason(("a", "b"), 2, 3)


def _graph():
    g = nx.DiGraph()
    g.add_node("rnn", kind="layer", layer=object())
    g.add_node("dense", kind="layer", layer=types.SimpleNamespace())
    g.add_node("out", kind="output")
    g.add_edge("rnn", "dense")
    g.add_edge("rnn", "out")
    return g


def test_lone_reason_prefers_a_failed_link_then_a_neighbour_then_not_stacked():
    g = _graph()
    link = {("rnn", "x"): Reason("units", "8 units vs 4")}
    assert runs.lone_reason(g, "rnn", 1, {}, link, 2) == "not stacked with its neighbour: 8 units vs 4"
    near = runs.lone_reason(g, "rnn", 1, {"dense": Reason("kind", "not recurrent")}, {}, 2)
    assert near.rule == "neighbour_unfusable" and "'dense'" in near
    alone = runs.lone_reason(g, "rnn", 1, {}, {}, 2)
    assert alone.rule == "not_stacked"
    assert "'dense' (SimpleNamespace), a model output" in alone


def test_backend_reason_names_the_run_only_where_a_kernel_exists():
    group = types.SimpleNamespace(layers=("a", "b"))
    none = runs.backend_reason(NoFusedKernel("openvino"), group)
    assert none.rule == "backend" and "openvino" in none and "(run a -> b)" not in none

    class Picky(NoFusedKernel):
        capabilities = NoFusedKernel.capabilities.__class__(
            fused_kernel=True, absorbs_dropout=False, jit_compiles_fused_call=False,
            tunes_one_call_per_layer=False,
        )

        def group_reason(self, group):
            return "LSTM only"

    assert str(runs.backend_reason(Picky("x"), group)) == "LSTM only (run a -> b)"
