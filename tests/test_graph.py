"""rnnfuse.passes.graph: the layer graph's nodes, edges and roles."""

from __future__ import annotations

import keras

from rnnfuse.passes.graph import build_layer_graph, is_graph_model

L = keras.layers


def test_sequential_chain_and_model_io_nodes():
    m = keras.Sequential([keras.Input((5, 3)), L.LSTM(4, return_sequences=True, name="a"), L.LSTM(4, name="b")])
    g = build_layer_graph(m)
    assert list(g.successors("a")) == ["b"]
    assert g.nodes["a"]["kind"] == "layer" and g.nodes["a"]["calls"] == 1
    assert g.edges["a", "b"]["role"] == "sequence" and g.edges["a", "b"]["index"] == 0
    assert any(g.nodes[n]["kind"] == "output" for n in g.successors("b"))


def test_initial_state_edges_carry_their_role_and_index():
    enc_in, dec_in = keras.Input((5, 3)), keras.Input((4, 3))
    _, h, c = L.LSTM(8, return_state=True, name="enc")(enc_in)
    out = L.LSTM(8, name="dec")(dec_in, initial_state=[h, c])
    g = build_layer_graph(keras.Model([enc_in, dec_in], out))
    edge = g.edges["enc", "dec"]
    assert edge["role"] == "initial_state" and edge["index"] in (1, 2)


def test_nested_models_are_expanded_with_qualified_names():
    inner = keras.Sequential([keras.Input((5, 3)), L.GRU(4, return_sequences=True, name="g")], name="enc")
    inp = keras.Input((5, 3))
    m = keras.Model(inp, L.GRU(4, name="top")(inner(inp)))
    g = build_layer_graph(m)
    assert "enc/g" in g and g.nodes["enc/g"]["scope"] == "enc/"
    assert is_graph_model(m) and is_graph_model(inner)


def test_a_shared_layer_counts_its_calls():
    shared = L.LSTM(4, return_sequences=True, name="s")
    inp = keras.Input((5, 3))
    m = keras.Model(inp, L.Add()([shared(inp), shared(inp)]))
    g = build_layer_graph(m)
    assert g.nodes["s"]["calls"] == 2
