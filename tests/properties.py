"""Random model topologies and the properties every optimized model must keep.

Shared by tests/test_properties.py (TensorFlow, emulated CudnnRNNV3) and
tests/torch_backend/test_torch_properties.py (torch's real CPU kernels).
The topologies cover the classes of failure found on keras-io models and
by fuzzing: masks (right-padded, holes, none), the last
layer's `zero_output_for_mask`, `return_sequences` and `return_state`,
`Bidirectional` with every merge mode, layers between recurrent layers
(so each side is its own group), single layers (groups of one), activity
regularizers on any layer (or inside a Bidirectional, which is refused),
an encoder whose states are the first layer's `initial_state`,
Sequential and Functional models, the default plans and every group
forced fused, and a save/load of the optimized model and of its weights
file.

Properties checked on each model:

1. Every recurrent layer is accounted for: in exactly one group, or in
   `skipped` with a reason.
2. The optimized model computes what the original computes (outputs and
   their structure) within `tol`, and adds the same losses (activity
   regularizers) in number and value.
3. A model in which nothing was rewritten is the original graph (same
   layers).
4. `fast.save` -> `load_model` gives the same outputs; `fast.save_weights`
   loads into a fresh original model with the same values and optimizer
   state.
5. A sub-model cut from the optimized model's layers builds and matches.

Example:

    >>> from hypothesis import strategies as st
    >>> isinstance(topologies(), st.SearchStrategy)
    True
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np
from hypothesis import strategies as st

import rnnfuse
from builders import KINDS, flat_numpy, max_abs_diff, sequence_input

L = keras.layers
KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
MERGE_MODES = ("concat", "sum", "ave", "mul", None)


@st.composite
def topologies(draw):
    """A dict describing one random model (see `build`)."""
    kind = draw(st.sampled_from(KINDS))
    num_layers = draw(st.integers(1, 3))
    bidirectional = draw(st.booleans())
    functional = draw(st.booleans())
    masked = draw(st.booleans())
    last_return_sequences = draw(st.booleans())
    # An encoder (same kind and width, return_state) whose states are the
    # first layer's initial_state: a Functional model with two inputs.
    encoder = functional and draw(st.integers(0, 2)) == 0
    return dict(
        kind=kind,
        num_layers=num_layers,
        units=draw(st.integers(1, 5)),
        input_size=draw(st.integers(1, 4)),
        steps=draw(st.integers(2, 6)),
        cells=draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers)),
        bidirectional=bidirectional,
        # Between levels concat, sum and ave fuse (sum/ave through the next
        # level's doubled kernel); the last layer takes any mode.
        inner_merge=draw(st.sampled_from(("concat", "concat", "sum", "ave"))),
        # A Sequential model takes one output per layer: no merge_mode=None.
        last_merge=draw(st.sampled_from(MERGE_MODES if functional else MERGE_MODES[:-1])),
        functional=functional,
        masked=masked,
        padding=draw(st.sampled_from(("right", "right", "middle", "none"))),
        last_return_sequences=last_return_sequences,
        last_return_state=functional and draw(st.booleans()),
        zero_output_for_mask=(not bidirectional) and draw(st.booleans()),
        # Keras 3.15 cannot load a Bidirectional of a go_backwards layer
        # (its config round trip makes both halves go backwards).
        go_backwards_first=(not bidirectional) and draw(st.booleans()),
        encoder=encoder,
        # Per layer: an activity_regularizer on the layer (the Bidirectional
        # wrapper), or on the forward layer inside it ("inner": refused).
        activity=draw(
            st.lists(
                st.sampled_from((None, None, "layer", "inner" if bidirectional else "layer")),
                min_size=num_layers,
                max_size=num_layers,
            )
        ),
        # optimize()'s default plans, or every group fused (plan=FUSED): the
        # fused call of groups whose static plan keeps Keras' layers.
        force_fused=draw(st.booleans()),
        # A Dense between two recurrent layers breaks the run.
        dense_between=num_layers > 1 and draw(st.integers(0, 3)) == 0,
        head=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _recurrent(case, i):
    last = i == case["num_layers"] - 1
    kind, units = case["kind"], case["units"]
    kwargs = dict(
        return_sequences=True if not last else case["last_return_sequences"],
        return_state=last and case["last_return_state"],
        go_backwards=case["go_backwards_first"] and i == 0,
    )
    if last and case["zero_output_for_mask"]:
        kwargs["zero_output_for_mask"] = True
    activity = case["activity"][i]
    if activity == "inner" or (activity == "layer" and not case["bidirectional"]):
        kwargs["activity_regularizer"] = "l2"
    if case["cells"][i]:
        cell = {
            "lstm": lambda: L.LSTMCell(units),
            "gru": lambda: L.GRUCell(units),
            "rnn_tanh": lambda: L.SimpleRNNCell(units),
            "rnn_relu": lambda: L.SimpleRNNCell(units, activation="relu"),
        }[kind]()
        layer = L.RNN(cell, **kwargs)
    elif kind == "lstm":
        layer = L.LSTM(units, **kwargs)
    elif kind == "gru":
        layer = L.GRU(units, **kwargs)
    else:
        layer = L.SimpleRNN(units, activation=kind[4:], **kwargs)
    if case["bidirectional"]:
        mode = case["last_merge"] if last else case["inner_merge"]
        regularizer = "l2" if activity == "layer" else None
        layer = L.Bidirectional(layer, merge_mode=mode, activity_regularizer=regularizer)
    return layer


def _encoder_states(case, encoder_input):
    """The encoder's states, shaped as the first layer's initial_state."""
    kind, units = case["kind"], case["units"]
    layer = {
        "lstm": lambda: L.LSTM(units, return_state=True),
        "gru": lambda: L.GRU(units, return_state=True),
    }.get(kind, lambda: L.SimpleRNN(units, activation=kind[4:], return_state=True))()
    if case["bidirectional"]:
        layer = L.Bidirectional(layer)
    return layer(encoder_input)[1:]


def build(case) -> keras.Model:
    """The model `case` describes."""
    layers = []
    for i in range(case["num_layers"]):
        layers.append(_recurrent(case, i))
        if case["dense_between"] and i == 0:
            layers.append(L.Dense(case["units"]))
    steps, features = case["steps"], case["input_size"]
    if not case["functional"]:
        first = [keras.Input((steps,), dtype="int32"), L.Embedding(9, features, mask_zero=True)] if case["masked"] else [keras.Input((steps, features))]
        tail = [L.Dense(2)] if case["head"] else []
        return keras.Sequential(first + layers + tail)
    inp, x = sequence_input(case["masked"], steps, features, vocab=9)
    model_inputs = [inp]
    for i, layer in enumerate(layers):
        if i == 0 and case["encoder"]:
            model_inputs.append(keras.Input((steps + 1, features)))
            x = layer(x, initial_state=_encoder_states(case, model_inputs[-1]))
        else:
            x = layer(x)
    if case["head"]:
        first = x[0] if isinstance(x, (list, tuple)) else x
        x = [L.Dense(2)(first)] + (list(x[1:]) if isinstance(x, (list, tuple)) else [])
        x = x[0] if len(x) == 1 else x
    return keras.Model(model_inputs if case["encoder"] else inp, x)


def inputs(case, model, rng):
    """A batch for `model`: floats, or tokens padded as `case` says (and
    the encoder's input sequence, for a model with an encoder)."""
    batch, steps = 3, case["steps"]
    if case["encoder"]:
        first = inputs(dict(case, encoder=False), model, rng)
        return [first, rng.standard_normal((batch, steps + 1, case["input_size"])).astype("float32")]
    if not case["masked"]:
        return rng.standard_normal((batch, steps, case["input_size"])).astype("float32")
    tokens = rng.integers(1, 9, (batch, steps))
    for b in range(batch):
        if case["padding"] == "right":
            tokens[b, int(rng.integers(1, steps + 1)) :] = 0
        elif case["padding"] == "middle" and steps > 2:
            tokens[b, int(rng.integers(1, steps - 1))] = 0
    return tokens.astype("int32")


def _recurrent_names(model) -> set[str]:
    from rnnfuse.recurrent import is_recurrent

    return {
        l.name
        for l in model._flatten_layers(include_self=False)
        if is_recurrent(l) and not isinstance(l, rnnfuse.FusedRNN)
    }


def _top_level(model) -> set[str]:
    """Names of recurrent layers the report speaks of (the outermost ones:
    a Bidirectional, not its two halves)."""
    from rnnfuse.recurrent import is_recurrent

    names = set()
    for layer in model.layers:
        if is_recurrent(layer):
            names.add(layer.name)
    return names


def assert_same_losses(model, fast, x, tol: float) -> None:
    """The activity-regularization losses of a training-mode call: as many,
    and the same values (sorted: the order of layers may differ)."""
    values = []
    for m in (model, fast):
        m(x, training=True)
        values.append(sorted(float(keras.ops.convert_to_numpy(v)) for v in m.losses))
    assert len(values[0]) == len(values[1]), values
    np.testing.assert_allclose(values[1], values[0], rtol=1e-4, atol=tol)


def check_properties(case, *, tol: float, on_fused=None) -> None:
    """Builds `case`, optimizes it, and checks properties 1-4 (module doc)."""
    rng = np.random.default_rng(case["seed"])
    model = build(case)
    x = inputs(case, model, rng)

    # 1. every recurrent layer is accounted for.
    report = rnnfuse.analyze(model)
    grouped = [name for g in report.groups for name in g.layers]
    assert len(grouped) == len(set(grouped)), grouped
    assert not set(grouped) & set(report.skipped)
    assert _top_level(model) <= set(grouped) | set(report.skipped), (
        _top_level(model), grouped, report.skipped)
    for name, reason in report.skipped.items():
        assert str(reason), name

    # 2. same numbers, same structure, same losses.
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED if case["force_fused"] else None)
    expected = model(x)
    got = fast(x)
    assert keras.tree.map_structure(lambda t: tuple(t.shape), got) == keras.tree.map_structure(
        lambda t: tuple(t.shape), expected
    )
    assert max_abs_diff(got, expected) <= tol, case
    assert_same_losses(model, fast, x, tol)
    if on_fused is not None:
        on_fused(fast)

    # 3. nothing rewritten -> the original graph; a sub-model cut from the
    # optimized model's layers builds (one input of each name).
    if not any(isinstance(l, rnnfuse.FusedRNN) for l in fast._flatten_layers(include_self=False)):
        assert fast.layers == model.layers
    name = model.layers[-1].name
    one = lambda m: m.inputs[0] if len(m.inputs) == 1 else m.inputs  # noqa: E731
    sub = keras.Model(one(fast), fast.get_layer(name).output)
    reference = keras.Model(one(model), model.get_layer(name).output)
    assert max_abs_diff(sub(x), reference(x)) <= tol

    # 4. save/load of the optimized model and of its weights file.
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "fast.keras")
        fast.save(path)
        loaded = keras.models.load_model(path)
        assert max_abs_diff(loaded(x), got) <= 1e-6
        weights = os.path.join(folder, "w.weights.h5")
        for v in model.weights:
            v.assign(v.numpy() + 0.01)  # "trained"
        fast.compile(optimizer="adam")
        fast.optimizer.build(fast.trainable_variables)
        for v in fast.optimizer.variables:  # a "trained" Adam state
            v.assign(rng.standard_normal(v.shape).astype(v.dtype))
        fast.save_weights(weights)
        again = build(case)
        again.compile(optimizer="adam")
        again.optimizer.build(again.trainable_variables)
        again.load_weights(weights)
        for a, b in zip(model.weights, again.weights):
            np.testing.assert_array_equal(flat_numpy(a)[0], flat_numpy(b)[0])
        for a, b in zip(fast.optimizer.variables, again.optimizer.variables):
            np.testing.assert_array_equal(flat_numpy(a)[0], flat_numpy(b)[0])
        assert max_abs_diff(again(x), model(x)) <= 1e-6
