"""Bidirectional stacks, RNN(cell), RNN(StackedRNNCells) and absorbed Dropout.

Each case is compared with the original model through the emulated
CudnnRNNV3 (outputs, states and gradients), plus the rules these layers add.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, max_abs_diff, random_inputs, rnn_layer, stack_model

L = keras.layers
MERGE_MODES = ["concat", "sum", "mul", "ave", None]
CELLS = {"lstm": L.LSTMCell, "gru": L.GRUCell, "rnn_tanh": L.SimpleRNNCell}


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-0.5, 0.5, v.shape).astype(v.dtype))


def _check(model, emulated_cudnn, *, masked_padding="right", tol=2e-5, seed=0):
    """optimize(model) == model in outputs and gradients, fused path used."""
    _randomize(model, seed)
    fast = rnnfuse.optimize(model)
    assert len(fused_layers(fast)) == 1, rnnfuse.analyze(model)
    rng = np.random.default_rng(seed)
    x = random_inputs(model, 3, rng, padding=masked_padding)
    emulated_cudnn.clear()
    grads = []
    for m in (model, fast):
        with tf.GradientTape() as tape:
            out = m(x)
            loss = sum(tf.reduce_sum(tf.cast(t, "float32") ** 2) for t in keras.tree.flatten(out))
        grads.append((out, tape.gradient(loss, model.trainable_variables)))
    (expected, g0), (got, g1) = grads
    assert emulated_cudnn, fused_layers(fast)[0].last_path
    assert keras.tree.map_structure(lambda t: tuple(t.shape), got) == keras.tree.map_structure(
        lambda t: tuple(t.shape), expected
    )
    assert max_abs_diff(got, expected) <= tol
    for a, b in zip(g0, g1):
        assert float(tf.reduce_max(tf.abs(tf.convert_to_tensor(a) - tf.convert_to_tensor(b)))) <= 10 * tol
    return fast


# -- Bidirectional ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, merge_mode",
    [(k, m) for m in MERGE_MODES for k in ("lstm", "gru")]
    + [(k, "concat") for k in ("rnn_tanh", "rnn_relu")],
)
def test_bidirectional_stack_every_last_merge_mode(kind, merge_mode, emulated_cudnn):
    inp = keras.Input((5,), dtype="int32")
    x = L.Embedding(11, 3, mask_zero=True)(inp)
    x = L.Bidirectional(rnn_layer(kind, 3, return_sequences=True))(x)
    out = L.Bidirectional(rnn_layer(kind, 3, return_sequences=True), merge_mode=merge_mode)(x)
    _check(keras.Model(inp, out), emulated_cudnn)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("return_sequences", [True, False])
def test_bidirectional_return_state_and_initial_state(kind, return_sequences, emulated_cudnn):
    n = 2 if kind == "lstm" else 1
    inp = keras.Input((6, 3))
    states = [keras.Input((4,)) for _ in range(2 * n)]
    x = L.Bidirectional(rnn_layer(kind, 4, return_sequences=True))(inp, initial_state=states)
    out = L.Bidirectional(
        rnn_layer(kind, 4, return_sequences=return_sequences, return_state=True)
    )(x)
    model = keras.Model([inp] + states, out)
    assert len(model.outputs) == 1 + 2 * n  # output, forward states, backward states
    _check(model, emulated_cudnn)


def test_bidirectional_with_custom_backward_layer(emulated_cudnn):
    inp = keras.Input((6, 3))
    x = L.Bidirectional(
        L.GRU(4, return_sequences=True),
        backward_layer=L.GRU(4, return_sequences=True, go_backwards=True, name="mine"),
    )(inp)
    out = L.Bidirectional(L.GRU(4))(x)
    _check(keras.Model(inp, out), emulated_cudnn)


def test_bidirectional_sequential_stack(emulated_cudnn):
    model = keras.Sequential(
        [keras.Input((6, 3))]
        + [L.Bidirectional(L.LSTM(4, return_sequences=True)) for _ in range(3)]
        + [L.Dense(2)]
    )
    fast = _check(model, emulated_cudnn)
    group = rnnfuse.analyze(model).groups[0]
    assert group.bidirectional and group.num_layers == 3
    assert emulated_cudnn[0]["direction"] == "bidirectional"
    assert isinstance(fast, keras.Sequential)


def test_bidirectional_rules():
    def model(*layers):
        return keras.Sequential([keras.Input((6, 3)), *layers])

    # A non-concat merge must be last.
    r = rnnfuse.analyze(model(
        L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode="ave", name="a"),
        L.Bidirectional(L.LSTM(4), name="b"),
    ))
    assert r.skipped["a"].rule == "merge_mode"
    # Directions that differ in width.
    r = rnnfuse.analyze(model(
        L.Bidirectional(
            L.LSTM(4, return_sequences=True),
            backward_layer=L.LSTM(5, return_sequences=True, go_backwards=True),
            name="a",
        ),
        L.Bidirectional(L.LSTM(4), name="b"),
    ))
    assert r.skipped["a"].rule == "bidirectional_mismatch"
    # Dropout inside a Bidirectional draws one mask per direction.
    r = rnnfuse.analyze(model(
        L.Bidirectional(L.GRU(4, return_sequences=True, dropout=0.2), name="a"),
        L.Bidirectional(L.GRU(4), name="b"),
    ))
    assert r.skipped["a"].rule == "bidirectional_dropout"
    # A rule of the wrapped layer names the direction.
    r = rnnfuse.analyze(model(
        L.Bidirectional(L.LSTM(4, return_sequences=True, unroll=True), name="a"),
        L.Bidirectional(L.LSTM(4), name="b"),
    ))
    assert r.skipped["a"].rule == "unroll"
    assert "forward layer" in r.skipped["a"]


# -- RNN(cell) and StackedRNNCells --------------------------------------------------


@pytest.mark.parametrize("kind", list(CELLS))
def test_rnn_of_cell_is_treated_as_its_layer(kind, emulated_cudnn):
    cell = CELLS[kind]
    model = keras.Sequential(
        [keras.Input((7,), dtype="int32"), L.Embedding(11, 3, mask_zero=True)]
        + [L.RNN(cell(5), return_sequences=True) for _ in range(2)]
        + [rnn_layer(kind, 5)]
    )
    fast = _check(model, emulated_cudnn)
    assert rnnfuse.analyze(model).groups[0].num_layers == 3
    assert fast.layers[1].__class__.__name__ == "FusedRNN"


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("return_state", [False, True])
def test_stacked_rnn_cells_count_as_levels(kind, return_state, emulated_cudnn):
    cell = CELLS[kind]
    inp = keras.Input((6, 3))
    x = L.RNN(cell(5), return_sequences=True)(inp)
    out = L.RNN(
        L.StackedRNNCells([cell(5), cell(5)]), return_sequences=True, return_state=return_state
    )(x)
    model = keras.Model(inp, out)
    _check(model, emulated_cudnn)
    (group,) = rnnfuse.analyze(model).groups
    assert group.num_layers == 3 and len(group.layers) == 2


def test_a_single_stacked_rnn_cells_layer_fuses_on_its_own(emulated_cudnn):
    inp = keras.Input((6, 3))
    out = L.RNN(L.StackedRNNCells([L.GRUCell(4) for _ in range(3)]))(inp)
    _check(keras.Model(inp, out), emulated_cudnn)


def test_stacked_cells_rules():
    def analyze(cells):
        inp = keras.Input((6, 3))
        out = L.RNN(L.StackedRNNCells(cells), name="s")(inp)
        return rnnfuse.analyze(keras.Model(inp, out)).skipped["s"]

    assert analyze([L.GRUCell(4), L.LSTMCell(4)]).rule == "mixed_cells"
    assert analyze([L.GRUCell(4), L.GRUCell(5)]).rule == "mixed_units"
    assert analyze([L.GRUCell(4), L.GRUCell(4, dropout=0.1)]).rule == "dropout"


def test_dropout_with_implementation_1_is_not_fused():
    model = keras.Sequential([
        keras.Input((6, 3)),
        L.LSTM(4, return_sequences=True, dropout=0.2, implementation=1, name="a"),
        L.LSTM(4, name="b"),
    ])
    assert rnnfuse.analyze(model).skipped["a"].rule == "dropout_implementation"


# -- absorbed Dropout -------------------------------------------------------------------


def _dropout_stack(rates, functional=True):
    layers = [L.LSTM(4, return_sequences=True, name="l0")]
    for i, rate in enumerate(rates, start=1):
        if rate is not None:
            layers.append(L.Dropout(rate, name=f"d{i}"))
        layers.append(L.LSTM(4, return_sequences=True, name=f"l{i}"))
    if not functional:
        return keras.Sequential([keras.Input((6, 3)), *layers])
    inp = keras.Input((6, 3))
    x = inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("functional", [True, False])
def test_dropout_between_layers_is_absorbed_and_exact_at_inference(functional, emulated_cudnn):
    model = _dropout_stack([0.3, 0.3], functional)
    report = rnnfuse.analyze(model)
    (group,) = report.groups
    assert group.layers == ("l0", "l1", "l2")
    assert group.absorbed_dropout == ("d1", "d2")
    assert report.absorbed == {"d1": "l0", "d2": "l0"}
    assert "absorbs d1, d2" in str(report)
    fast = _check(model, emulated_cudnn)
    assert not any(isinstance(l, L.Dropout) for l in fast.layers)
    assert emulated_cudnn[-1]["dropout"] == 0.0  # inference: no dropout


def test_absorbed_dropout_goes_to_cudnn_when_training(emulated_cudnn):
    model = _dropout_stack([0.25, 0.25])
    fast = rnnfuse.optimize(model)
    fast(np.zeros((2, 6, 3), "float32"), training=True)
    assert emulated_cudnn[-1]["dropout"] == 0.25


def test_absorb_dropout_false_keeps_dropout_as_a_break():
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.3]), absorb_dropout=False)
    assert report.groups == ()
    assert "'d1' (Dropout)" in report.skipped["l0"]


def test_mixed_dropout_rates_split_the_run():
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.3, None, None]))
    assert [g.layers for g in report.groups] == [("l0", "l1", "l2"), ("l3", "l4")]
    assert report.skipped == {}
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.5]))
    assert [g.layers for g in report.groups] == [("l0", "l1")]
    assert report.skipped["l2"].rule == "dropout_between"


def test_dropout_with_noise_shape_is_not_absorbed():
    inp = keras.Input((6, 3))
    x = L.LSTM(4, return_sequences=True, name="a")(inp)
    x = L.Dropout(0.2, noise_shape=(None, 1, 4), name="d")(x)
    out = L.LSTM(4, name="b")(x)
    report = rnnfuse.analyze(keras.Model(inp, out))
    assert report.groups == ()
    assert "'d' (Dropout)" in report.skipped["a"]


# -- loop kinds fuse from one layer (issue 15, coverage) ------------------------


def _single(kind: str) -> keras.Model:
    inp = keras.Input((7, 5))
    layer = {
        "simple_rnn": lambda: L.SimpleRNN(6, activation="relu"),
        "rnn_cell": lambda: L.RNN(L.GRUCell(6)),
        "stacked_cells": lambda: L.RNN(L.StackedRNNCells([L.LSTMCell(6)])),
        "bidirectional_simple_rnn": lambda: L.Bidirectional(L.SimpleRNN(6)),
    }[kind]()
    return keras.Model(inp, L.Dense(2)(layer(inp)))


@pytest.mark.parametrize("kind", ["simple_rnn", "rnn_cell", "stacked_cells", "bidirectional_simple_rnn"])
def test_a_single_loop_layer_fuses_by_default(kind, emulated_cudnn):
    model = _single(kind)
    report = rnnfuse.analyze(model)
    assert len(report.groups) == 1 and report.groups[0].num_layers == 1
    fast = rnnfuse.optimize(model)
    x = np.random.default_rng(0).standard_normal((3, 7, 5)).astype("float32")
    emulated_cudnn.clear()
    assert max_abs_diff(fast(x), model(x)) <= 1e-5
    assert emulated_cudnn, "the fused kernel did not run"
    # An explicit min_layers applies to every kind.
    assert rnnfuse.analyze(model, min_layers=2).skipped


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_single_cudnn_layer_stays_as_it_is(kind):
    model = stack_model(kind, 1, head=True)
    report = rnnfuse.analyze(model)
    assert report.groups == ()
    assert "min_layers=2" in report.skipped[f"{kind}_0"]
