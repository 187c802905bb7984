"""One test per rule that breaks a run: the layer is left alone, with the
rule's name and a reason a user can read. Negative tests assert zero groups
or a shorter group; the positive control shows the same model fuses once
the offending argument is removed.

A link rule keeps two layers out of one call; by default each of them is
still a group (a lone layer is a group of one), and the report's `breaks`
names the rule; with `min_layers=2` the lone layer is left alone with it.
"""

from __future__ import annotations

import keras
import pytest

import rnnfuse
from builders import fused_layers, rnn_layer

L = keras.layers


def _seq(*layers, shape=(6, 4), dtype=None):
    inp = keras.Input(shape, dtype=dtype) if dtype else keras.Input(shape)
    return keras.Sequential([inp, *layers])


def _lstm(name, units=8, **kw):
    kw.setdefault("return_sequences", True)
    return L.LSTM(units, name=name, **kw)


class MyLSTM(L.LSTM):
    pass


class Tiny(L.Layer):
    def __init__(self, units=8, **kw):
        super().__init__(**kw)
        self.units = units
        self.state_size = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units))

    def call(self, x, states):
        h = keras.ops.tanh(x @ self.w + states[0])
        return h, [h]


def _functional(build):
    inp = keras.Input((6, 4))
    out = build(inp)
    return keras.Model(inp, out)


def assert_apart(model, upper, lower, rule, groups, words=""):
    """`upper` -> `lower` fails `rule`: by default the model has `groups`
    and `report.breaks` says why the two are separate calls; with
    min_layers=2 the lone `upper` is left alone with that rule."""
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == groups
    assert report.breaks[(upper, lower)].rule == rule
    assert words in report.breaks[(upper, lower)]
    stacks = rnnfuse.analyze(model, min_layers=2)
    assert [g.layers for g in stacks.groups] == [g for g in groups if len(g) > 1]
    assert stacks.skipped[upper].rule == rule
    assert words in stacks.skipped[upper]
    assert not stacks.breaks


# (case id, model factory, layer to check, rule, words in the reason)
LAYER_RULE_CASES = [
    ("recurrent_dropout", lambda: _seq(_lstm("a", recurrent_dropout=0.2), _lstm("b")), "a", "recurrent_dropout", "recurrent_dropout=0.2"),
    ("activation_lstm", lambda: _seq(_lstm("a", activation="relu"), _lstm("b")), "a", "activation", "relu"),
    ("recurrent_activation", lambda: _seq(_lstm("a", recurrent_activation="hard_sigmoid"), _lstm("b")), "a", "activation", "hard_sigmoid"),
    ("activation_simple_rnn", lambda: _seq(L.SimpleRNN(8, activation="sigmoid", return_sequences=True, name="a"), L.SimpleRNN(8, name="b")), "a", "activation", "tanh and relu"),
    ("reset_after", lambda: _seq(L.GRU(8, reset_after=False, return_sequences=True, name="a"), L.GRU(8, name="b")), "a", "reset_after", "reset_after=False"),
    ("unroll", lambda: _seq(_lstm("a", unroll=True), _lstm("b")), "a", "unroll", "unroll=True"),
    ("stateful", lambda: keras.Sequential([keras.Input(batch_shape=(2, 6, 4)), _lstm("a", stateful=True), _lstm("b")]), "a", "stateful", "stateful=True"),
    ("use_cudnn", lambda: _seq(_lstm("a", use_cudnn=False), _lstm("b")), "a", "use_cudnn", "use_cudnn=False"),
    ("layer_type", lambda: _seq(MyLSTM(8, return_sequences=True, name="a"), _lstm("b")), "a", "layer_type", "subclass of LSTM"),
    ("cell_type", lambda: _seq(L.RNN(Tiny(), return_sequences=True, name="a"), _lstm("b")), "a", "cell_type", "Tiny"),
    ("cell_activity_regularizer", lambda: _seq(L.RNN(L.LSTMCell(8, activity_regularizer="l2"), return_sequences=True, name="a"), _lstm("b")), "a", "cell_activity_regularizer", "every time step"),
    ("bidirectional_activity_regularizer", lambda: _seq(L.Bidirectional(_lstm("a0", activity_regularizer="l2"), name="a"), L.Bidirectional(_lstm("b0"), name="b")), "a", "bidirectional_activity_regularizer", "a0' has an activity_regularizer"),
]


@pytest.mark.parametrize("case", LAYER_RULE_CASES, ids=[c[0] for c in LAYER_RULE_CASES])
def test_layer_rule_leaves_layer_alone_with_reason(case):
    _, make, name, rule, words = case
    # min_layers=2: 'b' alone would fuse by itself where it is a loop kind
    # (SimpleRNN); these cases are about the pair.
    model = make()
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.groups == ()
    assert report.skipped[name].rule == rule
    assert words in report.skipped[name]
    # The layer it would have stacked with says why it stayed alone too.
    assert "b" in report.skipped
    # Zero rewrites, not only zero groups.
    assert fused_layers(rnnfuse.optimize(model, min_layers=2)) == []


# Link rules: a -> b can not be one call. Each factory builds [a, b, c]
# where b -> c is fine, so the group is (b, c) and a is left alone.
def _three(a, b, c, *, functional):
    if not functional:
        return _seq(a, b, c)
    return _functional(lambda x: c(b(a(x))))


LINK_CASES = [
    ("cell_kind", lambda: (L.GRU(8, return_sequences=True, name="a"), _lstm("b"), _lstm("c")), "cell_kind", "one kind of cell"),
    ("units", lambda: (_lstm("a", units=4), _lstm("b"), _lstm("c")), "units", "'a' has 4"),
    ("direction", lambda: (_lstm("a"), L.Bidirectional(_lstm("b0"), name="b"), L.Bidirectional(_lstm("c0"), name="c")), "direction", "bidirectional"),
    ("merge_mode", lambda: (L.Bidirectional(_lstm("a0"), merge_mode="mul", name="a"), L.Bidirectional(_lstm("b0"), name="b"), L.Bidirectional(_lstm("c0"), name="c")), "merge_mode", "merge_mode='mul'"),
    ("go_backwards", lambda: (_lstm("a"), _lstm("b", go_backwards=True), _lstm("c")), "go_backwards", "alternates direction"),
    ("dropout", lambda: (_lstm("a"), _lstm("b", dropout=0.3), _lstm("c")), "dropout", "dropout=0.3"),
    ("dtype_policy", lambda: (_lstm("a", dtype="mixed_float16"), _lstm("b"), _lstm("c")), "dtype_policy", "mixed_float16"),
    ("activity_regularizer", lambda: (_lstm("a", activity_regularizer="l2"), _lstm("b"), _lstm("c")), "activity_regularizer", "only the last layer of a run"),
]


@pytest.mark.parametrize("functional", [False, True], ids=["sequential", "functional"])
@pytest.mark.parametrize("case", LINK_CASES, ids=[c[0] for c in LINK_CASES])
def test_link_rule_breaks_run_with_reason(case, functional):
    _, make, rule, words = case
    a, b, c = make()
    model = _three(a, b, c, functional=functional)
    assert_apart(model, "a", "b", rule, [("a",), ("b", "c")], words)
    # One fused call of (b, c), and `a` a fused layer of its own.
    fused = fused_layers(rnnfuse.optimize(model, plan=rnnfuse.FUSED))
    assert [[l.name for l in f.fused_layers] for f in fused] == [["a"], ["b", "c"]]


@pytest.mark.parametrize("functional", [False, True], ids=["sequential", "functional"])
def test_return_sequences_false_ends_a_run(functional):
    a, b, c = _lstm("a"), _lstm("b", return_sequences=False), _lstm("c", return_sequences=False)
    if functional:
        model = _functional(lambda x: c(L.RepeatVector(6)(b(a(x)))))
    else:
        model = _seq(a, b, L.RepeatVector(6), c)
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == [("a", "b"), ("c",)]
    # RepeatVector between them: no link, so no break to explain.
    assert not report.breaks
    assert rnnfuse.analyze(model, min_layers=2).skipped["c"].rule == "not_stacked"


def test_return_sequences_false_between_two_rnn_layers_is_a_reason():
    # Keras accepts a 2-D input to an RNN only through another op, so check
    # the rule directly on the views.
    from rnnfuse.rules import stack_link_reason
    from rnnfuse.recurrent import describe

    a, b = _lstm("a", return_sequences=False), _lstm("b")
    b(L.RepeatVector(3)(a(keras.ops.zeros((1, 6, 4)))))
    reason = stack_link_reason(describe(a), describe(b))
    assert reason.rule == "return_sequences"
    assert "return_sequences=False" in reason


def test_return_state_only_on_last_layer():
    inp = keras.Input((6, 4))
    a = _lstm("a", return_state=True)
    seq, h, c = a(inp)
    out = _lstm("c", return_sequences=False)(_lstm("b")(seq))
    assert_apart(keras.Model(inp, [out, h]), "a", "b", "return_state", [("a",), ("b", "c")])


def test_shared_layer_is_not_fused():
    shared = _lstm("shared")
    inp = keras.Input((6, 4))
    x = shared(inp)
    y = shared(_lstm("other")(x))
    report = rnnfuse.analyze(keras.Model(inp, y))
    assert report.skipped["shared"].rule == "shared_layer"
    assert "called 2 times" in report.skipped["shared"]


def test_output_that_is_also_a_model_output_ends_the_run():
    inp = keras.Input((6, 4))
    a = _lstm("a")(inp)
    b = _lstm("b")(a)
    c = _lstm("c")(b)
    assert_apart(keras.Model(inp, [a, c]), "a", "b", "model_output", [("a",), ("b", "c")])


def test_output_read_by_another_layer_ends_the_run():
    inp = keras.Input((6, 4))
    a = _lstm("a")(inp)
    b = _lstm("b")(a)
    c = _lstm("c")(b)
    side = L.Dense(2, name="side")(a)
    model = keras.Model(inp, [c, side])
    assert_apart(model, "a", "b", "other_consumer", [("a",), ("b", "c")], "'side'")


def test_initial_state_only_on_first_layer():
    inp = keras.Input((6, 4))
    h, c = keras.Input((8,)), keras.Input((8,))
    a = _lstm("a")(inp)
    b = _lstm("b")(a, initial_state=[h, c])
    out = _lstm("c")(b)
    model = keras.Model([inp, h, c], out)
    assert_apart(model, "a", "b", "initial_state", [("a",), ("b", "c")])


def test_layer_reading_a_state_is_not_stacked():
    inp = keras.Input((6, 4))
    _, h, _ = _lstm("a", return_state=True, return_sequences=False)(inp)
    out = _lstm("b")(L.RepeatVector(6)(h))
    model = keras.Model(inp, out)
    report = rnnfuse.analyze(model)
    # Two groups of one; no link between them (b reads a RepeatVector).
    assert [g.layers for g in report.groups] == [("a",), ("b",)]
    assert not report.breaks
    stacks = rnnfuse.analyze(model, min_layers=2)
    assert stacks.groups == ()
    assert {r.rule for r in stacks.skipped.values()} == {"not_stacked"}


def test_masked_first_layer_with_initial_state_is_not_stacked():
    """Keras gives no mask to a layer called with initial_state, but does
    give one to the next layer; fusing them would change the numbers."""
    inp = keras.Input((6,), dtype="int32")
    x = L.Embedding(9, 4, mask_zero=True)(inp)
    h, c = keras.Input((8,)), keras.Input((8,))
    out = _lstm("b", return_sequences=False)(_lstm("a")(x, initial_state=[h, c]))
    model = keras.Model([inp, h, c], out)
    assert_apart(model, "a", "b", "mask", [("a",), ("b",)], "initial_state")


def test_min_layers_reason():
    model = _seq(_lstm("a"), _lstm("b"))
    report = rnnfuse.analyze(model, min_layers=3)
    assert report.groups == ()
    assert report.skipped["a"].rule == "min_layers"
    assert "min_layers=3" in report.skipped["a"]


def test_lone_layer_is_a_group_of_one():
    model = _seq(_lstm("a", return_sequences=False), L.Dense(2, name="head"))
    report = rnnfuse.analyze(model)
    (group,) = report.groups
    assert (group.layers, group.num_layers) == (("a",), 1)
    assert dict(report.skipped) == {}


def test_lone_layer_under_min_layers_2_names_what_it_feeds():
    model = _seq(_lstm("a", return_sequences=False), L.Dense(2, name="head"))
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.groups == ()
    assert report.skipped["a"].rule == "not_stacked"
    assert "'head' (Dense)" in report.skipped["a"]
    assert "min_layers=2" in report.skipped["a"]


def test_subclassed_model_is_reported_not_fused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = _lstm("a"), _lstm("b")

        def call(self, x):
            return self.b(self.a(x))

    net = Net()
    net(keras.ops.zeros((1, 6, 4)))
    report = rnnfuse.analyze(net)
    assert report.groups == ()
    assert report.skipped["a"].rule == "subclassed_model"
    assert "cannot see inside its call()" in report.notes[0]
    with pytest.warns(rnnfuse.FusionWarning, match="subclassed"):
        assert rnnfuse.optimize(net) is net


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_positive_control_every_kind_fuses(kind):
    model = _seq(
        rnn_layer(kind, 8, return_sequences=True, name="a"),
        rnn_layer(kind, 8, return_sequences=True, name="b"),
        rnn_layer(kind, 8, name="c"),
    )
    report = rnnfuse.analyze(model)
    (group,) = report.groups
    assert (group.layers, group.cell, group.units, group.num_layers, group.input_size, group.bidirectional) == (
        ("a", "b", "c"), kind, 8, 3, 4, False,
    )
    assert dict(report.skipped) == {}


def test_use_bias_false_still_fuses():
    model = _seq(_lstm("a", use_bias=False), _lstm("b", use_bias=False))
    assert len(rnnfuse.analyze(model).groups) == 1


def test_first_layer_may_read_backwards():
    model = _seq(_lstm("a", go_backwards=True), _lstm("b"))
    assert [g.layers for g in rnnfuse.analyze(model).groups] == [("a", "b")]


def test_runs_inside_nested_models_are_found():
    inner = keras.Sequential([keras.Input((6, 8)), _lstm("i1"), _lstm("i2")], name="enc")
    inp = keras.Input((6, 4))
    x = _lstm("top")(inp)
    y = inner(x)
    model = keras.Model(inp, L.Dense(2)(y))
    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == [("top",), ("enc/i1", "enc/i2")]
    assert [g.scope for g in report.groups] == ["", "enc/"]
    # The outer LSTM feeds the nested model's input: a boundary, not a link.
    assert not report.breaks
    assert rnnfuse.analyze(model, min_layers=2).skipped["top"].rule == "not_stacked"


def test_report_table_lists_groups_and_reasons():
    model = _seq(_lstm("a", units=4), _lstm("b"), _lstm("c", return_sequences=False))
    text = str(rnnfuse.analyze(model))
    assert "b -> c" in text and "lstm" in text
    assert "separate groups: 'a' -> 'b' (units)" in text
    text = str(rnnfuse.analyze(model, min_layers=2))
    assert "not stacked with its neighbour" in text and "units" in text


def test_backend_without_a_fused_kernel_leaves_every_run_with_a_reason(monkeypatch):
    """Under a Keras backend rnnfuse has no kernel for (OpenVINO), analyze
    says so and optimize wraps nothing."""
    from rnnfuse.backends.base import NoFusedKernel
    from rnnfuse.passes import planning

    monkeypatch.setattr(planning, "get_backend", lambda: NoFusedKernel("openvino"))
    model = _seq(_lstm("a"), _lstm("b"), _lstm("c", return_sequences=False))
    report = rnnfuse.analyze(model)
    assert report.groups == ()
    assert {r.rule for r in report.skipped.values()} == {"backend"}
    assert "openvino" in report.skipped["a"]
    fast = rnnfuse.optimize(model)
    assert not any(isinstance(l, rnnfuse.FusedRNN) for l in fast.layers)
