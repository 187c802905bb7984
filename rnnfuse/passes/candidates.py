"""Pass 2: the layer rules over the graph: a `RecurrentView` (may fuse) or
a `Reason` per recurrent layer, those out of reach included.

>>> import keras
>>> from rnnfuse.passes.graph import build_layer_graph
>>> m = keras.Sequential([keras.Input((6, 2)),
...     keras.layers.LSTM(4, return_sequences=True, name="a"), keras.layers.LSTM(4, name="b")])
>>> found = find_candidates(build_layer_graph(m))
>>> sorted(found.views), found.reasons
(['a', 'b'], {})
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import keras
import networkx as nx

from rnnfuse import rules
from rnnfuse.backends import get_backend
from rnnfuse.passes.result import PassOptions, PassResult
from rnnfuse.reasons import Reason
from rnnfuse.recurrent import RecurrentView, describe, is_recurrent

__all__ = ["Candidates", "find_candidates", "rules_pass"]


@dataclasses.dataclass(frozen=True)
class Candidates:
    """What the layer rules say of each recurrent layer."""

    # Node key -> the view of a layer that may fuse.
    views: Mapping[str, RecurrentView]
    # Key -> why that recurrent layer (or one inside a node) may not.
    reasons: Mapping[str, Reason]
    # The graph nodes that are recurrent layers, fusable or not.
    recurrent: frozenset[str]


def rules_pass(model: keras.Model, so_far: PassResult, options: PassOptions) -> PassResult:
    """Pass 2: `find_candidates` over the graph; for a subclassed model,
    which has none, the same reason for every recurrent layer in it."""
    if so_far.graph is not None:
        found = find_candidates(so_far.graph, get_backend().activation_functions())
    else:
        why = Reason(
            "subclassed_model",
            f"it is inside the subclassed model '{model.name}', whose call() "
            "rnnfuse cannot see into",
        )
        layers = [l for l in model._flatten_layers(include_self=False) if is_recurrent(l)]
        found = Candidates({}, {layer.name: why for layer in layers}, frozenset())
    return dataclasses.replace(so_far, candidates=found)


def find_candidates(graph: nx.DiGraph, activations: Any = None) -> Candidates:
    """A view or a reason for every recurrent layer in `graph`."""
    views: dict[str, RecurrentView] = {}
    reasons: dict[str, Reason] = {}
    recurrent = set()
    for key, data in graph.nodes(data=True):
        if data["kind"] == "opaque":
            for layer in rules.recurrent_sublayers(data["layer"]):
                reasons[f"{key}/{layer.name}"] = rules.subclassed_model(key)
            continue
        if data["kind"] != "layer":
            continue
        if not is_recurrent(data["layer"]):
            for layer in rules.recurrent_sublayers(data["layer"]):
                reasons[f"{key}/{layer.name}"] = rules.wrapped_layer(key, data["layer"])
            continue
        recurrent.add(key)
        reason = rules.layer_reason(data["layer"], activations=activations, graph=graph, key=key)
        view = describe(data["layer"], activations=activations) if reason is None else reason
        if isinstance(view, Reason):
            reasons[key] = view
        else:
            views[key] = view
    return Candidates(views, reasons, frozenset(recurrent))

