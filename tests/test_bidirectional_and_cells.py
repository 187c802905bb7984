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
from builders import fused_layers, max_abs_diff, random_inputs, randomize, rnn_layer, sequence_input, stack_model

L = keras.layers
MERGE_MODES = ["concat", "sum", "mul", "ave", None]
CELLS = {"lstm": L.LSTMCell, "gru": L.GRUCell, "rnn_tanh": L.SimpleRNNCell}


def _check(model, emulated_cudnn, *, masked_padding="right", tol=2e-5, seed=0, num_fused=1, **optimize_kwargs):
    """optimize(model) == model in outputs and gradients, fused path used."""
    randomize(model, seed)
    fast = rnnfuse.optimize(model, **optimize_kwargs)
    assert len(fused_layers(fast)) == num_fused, rnnfuse.analyze(model)
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

    # A "mul" merge must be last ("sum" and "ave" are packed: see below).
    r = rnnfuse.analyze(model(
        L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode="mul", name="a"),
        L.Bidirectional(L.LSTM(4), name="b"),
    ))
    assert [g.layers for g in r.groups] == [("a",), ("b",)]
    assert r.breaks[("a", "b")].rule == "merge_mode"
    assert "merge_mode='mul'" in r.breaks[("a", "b")]
    assert "only merge_mode 'concat', 'sum' or 'ave' can be packed" in r.breaks[("a", "b")]
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


# -- "sum" and "ave" below the top of a run -----------------------------------------
#
# cuDNN feeds the next level [fwd, bwd]; the packer doubles that level's input
# kernel ([W; W], [W/2; W/2]) so it reads fwd + bwd or their mean.


def _merged_stack(kind, merge_mode, *, masked, top_merge="concat", levels=3, **top):
    inp, x = sequence_input(masked, 7, 3)
    for i in range(levels - 1):
        x = L.Bidirectional(rnn_layer(kind, 4, return_sequences=True), merge_mode=merge_mode, name=f"b{i}")(x)
    top.setdefault("return_sequences", True)
    out = L.Bidirectional(rnn_layer(kind, 4, **top), merge_mode=top_merge, name=f"b{levels - 1}")(x)
    return keras.Model(inp, out)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "right_padded"])
def test_sum_and_ave_below_the_top_fuse_into_one_call(kind, merge_mode, masked, emulated_cudnn):
    model = _merged_stack(kind, merge_mode, masked=masked)
    (group,) = rnnfuse.analyze(model).groups
    assert group.layers == ("b0", "b1", "b2") and group.bidirectional
    assert rnnfuse.analyze(model).skipped == {}
    fast = _check(model, emulated_cudnn, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    assert fused.last_path == "fused"
    # One call of all three bidirectional levels.
    assert {int(c["input_h"].shape[0]) for c in emulated_cudnn} == {6}
    assert {c["direction"] for c in emulated_cudnn} == {"bidirectional"}


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_merged_levels_with_a_merged_top_returning_states(kind, emulated_cudnn):
    # ave inside, sum on top (FusedRNN's own merge), states returned.
    model = _merged_stack(kind, "ave", masked=True, top_merge="sum", return_sequences=False, return_state=True)
    fast = _check(model, emulated_cudnn, plan=rnnfuse.FUSED)
    assert fused_layers(fast)[0].stack.input_merges == (None, "ave", "ave")


def test_assigning_the_original_kernel_changes_the_fused_output(emulated_cudnn):
    model = _merged_stack("gru", "ave", masked=False)
    randomize(model, 3)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = np.random.default_rng(3).standard_normal((2, 7, 3)).astype("float32")
    before = np.asarray(fast(x))
    kernel = model.get_layer("b1").forward_layer.cell.kernel
    kernel.assign(kernel.numpy() * 0.5)
    after = np.asarray(fast(x))
    assert np.max(np.abs(after - before)) > 1e-3
    assert max_abs_diff(after, model(x)) <= 2e-5


def test_a_saved_merged_stack_loads_with_the_same_packing(emulated_cudnn, tmp_path):
    model = _merged_stack("lstm", "sum", masked=True)
    randomize(model, 5)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 3, np.random.default_rng(5))
    fast.save(tmp_path / "fast.keras", fused=True)
    loaded = keras.models.load_model(tmp_path / "fast.keras")
    (fused,) = fused_layers(loaded)
    assert fused.stack.input_merges == (None, "sum", "sum")
    emulated_cudnn.clear()
    assert max_abs_diff(loaded(x), model(x)) <= 2e-5
    assert emulated_cudnn and fused.last_path == "fused"


@pytest.mark.parametrize("pieces", [(), (1, 2), (2, 1), (1, 1, 1)])
def test_pieces_split_between_a_summing_level_and_the_next(pieces, emulated_cudnn):
    """A split after a "sum" level: the piece below ends with that layer (its
    own merge), the piece above starts with plain input, so nothing is packed
    doubled at the split."""
    model = _merged_stack("lstm", "sum", masked=True)
    randomize(model, 4)
    layers = [model.get_layer(f"b{i}") for i in range(3)]
    fused = rnnfuse.FusedRNN(layers, plan=rnnfuse.Plan(pieces))
    x = random_inputs(model, 3, np.random.default_rng(4))
    embedded = model.layers[1](x)
    mask = model.layers[1].compute_mask(x)
    emulated_cudnn.clear()
    with tf.GradientTape(persistent=True) as tape:
        got = fused(embedded, mask=mask)
        want = model(x)
        losses = [tf.reduce_sum(t**2) for t in (got, want)]
    assert max_abs_diff(got, want) <= 2e-5
    variables = [v for l in layers for v in l.trainable_variables]
    for a, b in zip(tape.gradient(losses[0], variables), tape.gradient(losses[1], variables)):
        assert float(tf.reduce_max(tf.abs(a - b))) <= 2e-4
    # One call per piece, each with its own levels; () runs the layers.
    assert [int(c["input_h"].shape[0]) // 2 for c in emulated_cudnn] == list(pieces)
    for start, size in zip(np.cumsum((0,) + pieces[:-1]), pieces):
        piece = fused._piece(fused.plan, int(start), int(start) + size)
        expected = tuple(None if i == 0 else "sum" for i in range(size))
        assert piece.stack.input_merges == expected


def test_a_summing_bidirectional_then_a_unidirectional_run_is_two_calls(emulated_cudnn):
    """A unidirectional layer cannot sit inside a bidirectional cuDNN call
    (the `direction` rule, not `merge_mode`): the summed output starts a
    second run, which reads it as its plain input."""
    inp = keras.Input((7, 3))
    x = L.Bidirectional(L.GRU(4, return_sequences=True), merge_mode="sum", name="b0")(inp)
    x = L.Bidirectional(L.GRU(4, return_sequences=True), merge_mode="sum", name="b1")(x)
    x = L.GRU(4, return_sequences=True, name="u0")(x)
    out = L.GRU(4, name="u1")(x)
    model = keras.Model(inp, out)
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == [("b0", "b1"), ("u0", "u1")]
    from rnnfuse.recurrent import describe
    from rnnfuse.rules import stack_link_reason

    reason = stack_link_reason(describe(model.get_layer("b1")), describe(model.get_layer("u0")))
    assert reason.rule == "direction"
    fast = _check(model, emulated_cudnn, plan=rnnfuse.FUSED, num_fused=2)
    assert [f.stack.input_merges for f in fused_layers(fast)] == [(None, "sum"), (None, None)]
    assert len(emulated_cudnn) == 2


@pytest.mark.parametrize("merge_mode", ["mul", None])
def test_mul_and_none_below_the_top_still_end_the_run(merge_mode):
    inp = keras.Input((7, 3))
    x = L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode=merge_mode, name="a")(inp)
    if merge_mode is None:
        x = x[0]  # the forward half, read as the next layer's sequence
    x = L.Bidirectional(L.LSTM(4, return_sequences=True), name="b")(x)
    out = L.Bidirectional(L.LSTM(4), name="c")(x)
    report = rnnfuse.analyze(keras.Model(inp, out))
    assert [g.layers for g in report.groups] == [("a",), ("b", "c")]
    assert report.breaks[("a", "b")].rule == "merge_mode"
    assert f"merge_mode={merge_mode!r}" in report.breaks[("a", "b")]
    stacks = rnnfuse.analyze(keras.Model(inp, out), min_layers=2)
    assert stacks.skipped["a"].rule == "merge_mode"
    with pytest.raises(ValueError, match="merge_mode"):
        rnnfuse.FusedRNN([keras.Model(inp, out).get_layer(n) for n in ("a", "b")])


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
    model = _dropout_stack([0.3, 0.3])
    report = rnnfuse.analyze(model, absorb_dropout=False)
    # Each LSTM is a group of one; a Dropout between them is no link.
    assert [g.layers for g in report.groups] == [("l0",), ("l1",), ("l2",)]
    assert not report.breaks and not report.absorbed
    report = rnnfuse.analyze(model, absorb_dropout=False, min_layers=2)
    assert report.groups == ()
    assert "'d1' (Dropout)" in report.skipped["l0"]


def test_mixed_dropout_rates_split_the_run():
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.3, None, None]))
    assert [g.layers for g in report.groups] == [("l0", "l1", "l2"), ("l3", "l4")]
    assert report.skipped == {}
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.5]))
    assert [g.layers for g in report.groups] == [("l0", "l1"), ("l2",)]
    assert report.breaks[("l1", "l2")].rule == "dropout_between"
    report = rnnfuse.analyze(_dropout_stack([0.3, 0.5]), min_layers=2)
    assert report.skipped["l2"].rule == "dropout_between"


def test_dropout_with_noise_shape_is_not_absorbed():
    inp = keras.Input((6, 3))
    x = L.LSTM(4, return_sequences=True, name="a")(inp)
    x = L.Dropout(0.2, noise_shape=(None, 1, 4), name="d")(x)
    out = L.LSTM(4, name="b")(x)
    report = rnnfuse.analyze(keras.Model(inp, out))
    assert [g.layers for g in report.groups] == [("a",), ("b",)]
    assert report.absorbed == {}
    report = rnnfuse.analyze(keras.Model(inp, out), min_layers=2)
    assert report.groups == ()
    assert "'d' (Dropout)" in report.skipped["a"]


# -- loop kinds fuse from one layer ---------------------------------------------


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
def test_a_single_cudnn_layer_is_a_group_of_one(kind):
    """Its plan decides whether the fused call runs (tests/test_single_layers.py);
    with min_layers=2 it is left alone."""
    model = stack_model(kind, 1, head=True)
    (group,) = rnnfuse.analyze(model).groups
    assert (group.layers, group.num_layers, group.cell) == ((f"{kind}_0",), 1, kind)
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.groups == ()
    assert "min_layers=2" in report.skipped[f"{kind}_0"]
