"""Lone LSTM/GRU layers and encoder-decoder links as groups of one, checked
the same way on every backend.

A recurrent layer that stacks with nothing is a group of one: a lone LSTM, a keras-io-style seq2seq (an encoder with
`return_state` whose states are the decoder's `initial_state`), a
forecaster whose LSTMs a `LayerNormalization` or a `Dense` keeps apart.
The backend test files parameterize over `MODELS` and call the checks
below: the groups are what `analyze` says, and the fused model computes
what the original computes (outputs, returned states and the gradients of
every variable), with the fused kernel really running.

Example:

    >>> sorted(MODELS)[:3]
    ['bidirectional_gru', 'bidirectional_lstm', 'forecaster']
"""

from __future__ import annotations

import keras
import numpy as np

from builders import fused_layers

L = keras.layers
STEPS, FEATURES = 7, 3


def _one(kind: str, bidirectional: bool = False) -> keras.Model:
    """One LSTM/GRU returning its sequence and states, and a head."""
    inp = keras.Input((STEPS, FEATURES), name="x")
    layer = (L.LSTM if kind == "lstm" else L.GRU)(5, return_sequences=True, return_state=True, name="rnn")
    if bidirectional:
        layer = L.Bidirectional(layer, name="rnn")
    out, *states = layer(inp)
    return keras.Model(inp, [L.Dense(2, name="head")(out), *states])


def _seq2seq(kind: str) -> keras.Model:
    """keras-io's lstm_seq2seq, small: the encoder's states start the decoder."""
    cls = L.LSTM if kind == "lstm" else L.GRU
    enc_in = keras.Input((STEPS, FEATURES), name="encoder_inputs")
    dec_in = keras.Input((STEPS - 2, FEATURES + 1), name="decoder_inputs")
    _, *states = cls(6, return_state=True, name="encoder")(enc_in)
    dec, *dec_states = cls(6, return_sequences=True, return_state=True, name="decoder")(
        dec_in, initial_state=states
    )
    out = L.Dense(FEATURES + 1, activation="softmax", name="head")(dec)
    return keras.Model([enc_in, dec_in], [out, *dec_states])


def _forecaster() -> keras.Model:
    """Three LSTMs that cannot be one run: a LayerNormalization and a Dense
    between them (each LSTM a group of one)."""
    inp = keras.Input((STEPS, FEATURES), name="series")
    x = L.LSTM(6, return_sequences=True, name="lstm_0")(inp)
    x = L.LayerNormalization(name="norm")(x)
    x = L.LSTM(6, return_sequences=True, name="lstm_1")(x)
    x = L.Dense(4, name="mix")(x)
    x = L.LSTM(6, name="lstm_2")(x)
    return keras.Model(inp, L.Dense(1, name="forecast")(x))


def _masked() -> keras.Model:
    """A lone LSTM under an Embedding's mask (right-padded tokens)."""
    inp = keras.Input((STEPS,), dtype="int32", name="tokens")
    x = L.Embedding(9, FEATURES, mask_zero=True, name="embed")(inp)
    return keras.Model(inp, L.Dense(2, name="head")(L.GRU(5, name="rnn")(x)))


# name -> (model factory, the groups `analyze` finds, as layer-name tuples)
MODELS = {
    "lstm": (lambda: _one("lstm"), [("rnn",)]),
    "gru": (lambda: _one("gru"), [("rnn",)]),
    "bidirectional_lstm": (lambda: _one("lstm", True), [("rnn",)]),
    "bidirectional_gru": (lambda: _one("gru", True), [("rnn",)]),
    "seq2seq": (lambda: _seq2seq("lstm"), [("encoder",), ("decoder",)]),
    "gru_seq2seq": (lambda: _seq2seq("gru"), [("encoder",), ("decoder",)]),
    "forecaster": (_forecaster, [("lstm_0",), ("lstm_1",), ("lstm_2",)]),
    "masked": (_masked, [("rnn",)]),
}


def build(name: str) -> keras.Model:
    """The model `name` of `MODELS`, with seeded weights."""
    keras.utils.set_random_seed(11)
    return MODELS[name][0]()


def inputs(model: keras.Model, batch: int = 4, seed: int = 0):
    """A batch for `model`: floats, or right-padded tokens (one row full)."""
    rng = np.random.default_rng(seed)
    out = []
    for tensor in model.inputs:
        shape = (batch,) + tuple(tensor.shape[1:])
        if "int" in str(tensor.dtype):
            tokens = rng.integers(1, 9, shape)
            for row, length in enumerate(rng.integers(1, shape[1] + 1, batch)):
                tokens[row, length if row else shape[1] :] = 0
            out.append(tokens.astype("int32"))
        else:
            out.append(rng.standard_normal(shape).astype("float32"))
    return out[0] if len(out) == 1 else out


def assert_groups_of_one(name: str, model: keras.Model) -> None:
    """`analyze` finds the case's groups; with min_layers=2 there is none."""
    import rnnfuse

    report = rnnfuse.analyze(model)
    assert [g.layers for g in report.groups] == MODELS[name][1]
    assert all(g.num_layers == 1 for g in report.groups)
    assert dict(report.skipped) == {}
    stacks = rnnfuse.analyze(model, min_layers=2)
    assert stacks.groups == ()
    assert set(stacks.skipped) == {k for g in MODELS[name][1] for k in g}


def _loss(outputs):
    """A scalar that weighs every output element differently."""
    total = 0.0
    for t in keras.tree.flatten(outputs):
        t = keras.ops.cast(t, "float32")
        ramp = 1.0 + 0.1 * keras.ops.arange(t.shape[-1], dtype="float32")
        total = total + keras.ops.sum(t * ramp) + keras.ops.sum(t * t)
    return total


def outputs_and_gradients(model: keras.Model, x, variables) -> tuple[list, list]:
    """`model`'s outputs on `x` in training mode, and the gradients of
    `_loss` with respect to `variables`, as NumPy arrays (TensorFlow or
    torch)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = _loss(out)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
    elif backend == "torch":
        import torch

        out = model(x, training=True)
        loss = _loss(out)
        grads = torch.autograd.grad(loss, [v.value for v in variables])
    else:
        raise NotImplementedError(f"no gradient helper for the {backend} backend")
    numpy = keras.ops.convert_to_numpy
    return [numpy(t) for t in keras.tree.flatten(out)], [numpy(g) for g in grads]


def assert_fused_matches(
    model: keras.Model, fast: keras.Model, *, tol: float, grad_tol: float, rtol: float = 0.0, batch: int = 4
) -> None:
    """`fast` computes what `model` computes on a batch: every output (the
    returned states too) within `tol`, the gradient of every variable of
    `model` (which `fast` shares) within `grad_tol` (both also `rtol`
    relative); every group ran its fused call."""
    x = inputs(model, batch)
    variables = model.trainable_variables
    want, gwant = outputs_and_gradients(model, x, variables)
    got, ggot = outputs_and_gradients(fast, x, variables)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=tol, rtol=rtol)
    assert len(ggot) == len(gwant) == len(variables)
    for v, a, b in zip(variables, ggot, gwant):
        assert np.abs(b).max() > 0, f"{v.path}: no gradient to compare"
        np.testing.assert_allclose(a, b, atol=grad_tol, rtol=rtol, err_msg=v.path)
    for layer in fused_layers(fast):
        assert layer.last_path == "fused", (layer.name, layer.last_path)
