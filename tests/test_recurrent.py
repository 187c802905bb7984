"""rnnfuse.recurrent: the structural RecurrentView of each layer spelling."""

from __future__ import annotations

import keras
import pytest

from rnnfuse.recurrent import cell_kind, describe, is_recurrent, keras_has_cudnn_path

L = keras.layers


def _built(layer, shape=(None, 5, 3)):
    layer.build(shape)
    return layer


@pytest.mark.parametrize(
    "layer, kind, levels, directions",
    [
        (L.LSTM(4), "lstm", 1, 1),
        (L.GRU(4), "gru", 1, 1),
        (L.SimpleRNN(4), "rnn_tanh", 1, 1),
        (L.SimpleRNN(4, activation="relu"), "rnn_relu", 1, 1),
        (L.RNN(L.LSTMCell(4)), "lstm", 1, 1),
        (L.RNN(L.StackedRNNCells([L.GRUCell(4), L.GRUCell(4)])), "gru", 2, 1),
        (L.Bidirectional(L.LSTM(4)), "lstm", 1, 2),
    ],
)
def test_every_spelling_has_a_view(layer, kind, levels, directions):
    view = describe(_built(layer))
    assert (view.kind, view.units, view.num_levels, view.num_directions) == (kind, 4, levels, directions)
    assert view.input_size == 3


def test_non_recurrent_layers_are_a_reason():
    assert not is_recurrent(L.Dense(3))
    assert describe(L.Dense(3)).rule == "not_recurrent"


def test_cell_kind_knows_framework_functions_it_is_given():
    cell = L.SimpleRNNCell(4, activation=abs)
    assert cell_kind(cell) is None
    assert cell_kind(cell, {"relu": [abs]}) == "rnn_relu"


def test_keras_cudnn_path_is_lstm_and_gru_with_bias():
    assert keras_has_cudnn_path(describe(_built(L.LSTM(4))))
    assert not keras_has_cudnn_path(describe(_built(L.LSTM(4, use_bias=False))))
    assert not keras_has_cudnn_path(describe(_built(L.SimpleRNN(4))))
