"""Pass 1: the layer graph of a built Keras model, as a networkx DiGraph.

Nodes are layer calls keyed by qualified name (``"encoder/lstm_1"``; nested
models expanded, with ``<input:NAME>``/``<output:NAME>`` nodes at their
boundaries), with attributes ``kind`` ("layer", "input", "output",
"opaque"), ``layer``, ``scope``, ``calls`` and ``mask_sources``. Edges are
tensors, with ``role`` ("sequence", "initial_state", "mask", "other",
"output") and ``index``. ``graph.graph["scopes"]`` maps scopes to models.

>>> import keras
>>> m = keras.Sequential([keras.Input((5, 3)),
...     keras.layers.LSTM(4, return_sequences=True, name="a"), keras.layers.LSTM(4, name="b")])
>>> list(build_layer_graph(m).successors("a"))
['b']
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import keras
import networkx as nx
from keras import tree

from rnnfuse.passes.result import PassOptions, PassResult

__all__ = ["build_layer_graph", "graph_pass", "is_functional", "is_graph_model"]


def is_functional(model: Any) -> bool:
    """Whether `model` is a Functional model (not Sequential, not subclassed)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional) and not isinstance(
        model, keras.Sequential
    )


def is_graph_model(model: Any) -> bool:
    """Whether rnnfuse can see `model`'s layer graph."""
    return isinstance(model, keras.Sequential) or is_functional(model)


def graph_pass(model: keras.Model, so_far: PassResult, options: PassOptions) -> PassResult:
    """Pass 1: `model`'s layer graph; none for a subclassed model."""
    if not is_graph_model(model):
        return so_far
    return dataclasses.replace(so_far, graph=build_layer_graph(model))


def build_layer_graph(model: keras.Model) -> nx.DiGraph:
    """The layer graph of a built Sequential or Functional `model`, a
    `networkx.DiGraph` as the module doc describes."""
    graph = nx.DiGraph(scopes={})
    builder = _GraphBuilder(graph)
    builder.add_model(model, scope="")
    for key, data in graph.nodes(data=True):
        if data.get("layer") is not None:
            data["calls"] = builder.call_counts[id(data["layer"])]
    return graph


class _GraphBuilder:
    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        # id(layer) -> number of calls anywhere in the model.
        self.call_counts: collections.Counter = collections.Counter()
        # id(submodel) -> (input keys, output keys), expanded once.
        self.expanded: dict[int, tuple[list[str], list[str]]] = {}

    def add_model(self, model: Any, scope: str) -> tuple[list[str], list[str]]:
        """Adds `model`'s graph; returns its input and output node keys."""
        self.graph.graph["scopes"][scope] = model
        if isinstance(model, keras.Sequential):
            return self._add_sequential(model, scope)
        return self._add_functional(model, scope)

    # -- nodes -------------------------------------------------------------

    def _layer_node(self, layer: Any, scope: str) -> str:
        key = scope + layer.name
        self.call_counts[id(layer)] += 1
        if key not in self.graph:
            kind = "layer"
            if isinstance(layer, keras.Model) and not is_graph_model(layer):
                kind = "opaque"
            self.graph.add_node(key, kind=kind, layer=layer, scope=scope)
        return key

    def _submodel(self, model: Any, scope: str) -> tuple[list[str], list[str]]:
        self.call_counts[id(model)] += 1
        if id(model) not in self.expanded:
            self.expanded[id(model)] = self.add_model(
                model, scope=f"{scope}{model.name}/"
            )
        return self.expanded[id(model)]

    def _add_edge(self, src: str, dst: str, role: str, index: int) -> None:
        if self.graph.has_edge(src, dst):
            # Keep the most specific role: "sequence" wins over the rest.
            if self.graph.edges[src, dst]["role"] == "sequence":
                return
        self.graph.add_edge(src, dst, role=role, index=index)

    # -- Sequential ----------------------------------------------------------

    def _add_sequential(self, model: Any, scope: str):
        input_key = f"{scope}<input:{_sequential_input_name(model)}>"
        self.graph.add_node(input_key, kind="input", layer=None, scope=scope)
        prev = input_key
        for layer in model.layers:
            if is_graph_model(layer):
                inputs, outputs = self._submodel(layer, scope)
                self._add_edge(prev, inputs[0], "sequence", 0)
                prev = outputs[0]
                continue
            key = self._layer_node(layer, scope)
            self._add_edge(prev, key, "sequence", 0)
            prev = key
        output_key = f"{scope}<output:{model.name}>"
        self.graph.add_node(output_key, kind="output", layer=None, scope=scope)
        self._add_edge(prev, output_key, "output", 0)
        return [input_key], [output_key]

    # -- Functional ----------------------------------------------------------

    def _add_functional(self, model: Any, scope: str):
        # id(KerasTensor) -> (graph key of its producer, output index)
        source: dict[int, tuple[str, int]] = {}
        input_keys = []
        for tensor in model.inputs:
            key = f"{scope}<input:{tensor.name}>"
            self.graph.add_node(key, kind="input", layer=None, scope=scope)
            source[id(tensor)] = (key, 0)
            input_keys.append(key)

        for depth in sorted(model._nodes_by_depth, reverse=True):
            for node in model._nodes_by_depth[depth]:
                op = node.operation
                if op is None or node.is_input:
                    continue
                if is_graph_model(op):
                    self._add_submodel_call(node, op, scope, source)
                    continue
                key = self._layer_node(op, scope)
                masks = set()
                for role, tensor in _argument_roles(node):
                    if id(tensor) in source:
                        src, index = source[id(tensor)]
                        self._add_edge(src, key, role, index)
                        if role == "mask":
                            masks.add((src, index))
                self.graph.nodes[key].setdefault("mask_sources", frozenset(masks))
                for i, out in enumerate(node.outputs):
                    source[id(out)] = (key, i)

        output_keys = []
        for name, tensor in zip(model.output_names, model.outputs):
            key = f"{scope}<output:{name}>"
            self.graph.add_node(key, kind="output", layer=None, scope=scope)
            if id(tensor) in source:
                src, index = source[id(tensor)]
                self._add_edge(src, key, "output", index)
            output_keys.append(key)
        return input_keys, output_keys

    def _add_submodel_call(self, node, submodel, scope, source) -> None:
        inputs, outputs = self._submodel(submodel, scope)
        flat_inputs = [
            t for _, t in _argument_roles(node) if id(t) in source
        ]
        for tensor, key in zip(flat_inputs, inputs):
            src, index = source[id(tensor)]
            self._add_edge(src, key, "sequence", index)
        for out, key in zip(node.outputs, outputs):
            source[id(out)] = (key, 0)


def _argument_roles(node) -> list[tuple[str, Any]]:
    """(role, KerasTensor) for every tensor a layer call received."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    roles = []
    for i, arg in enumerate(args):
        role = "sequence" if i == 0 else "initial_state" if i == 1 else "other"
        roles += [(role, t) for t in tree.flatten(arg) if _is_keras_tensor(t)]
    for name, arg in kwargs.items():
        role = name if name in ("initial_state", "mask") else "other"
        roles += [(role, t) for t in tree.flatten(arg) if _is_keras_tensor(t)]
    return roles


def _is_keras_tensor(x: Any) -> bool:
    return isinstance(x, keras.KerasTensor)


def _sequential_input_name(model: Any) -> str:
    try:
        return model.inputs[0].name
    except (AttributeError, IndexError, TypeError, ValueError):
        return "input"
