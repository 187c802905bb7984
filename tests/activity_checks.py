"""Activity regularizers on fused runs, checked the same way on every backend.

Keras adds a layer's activity-regularization loss in `Layer.__call__` (the
regularizer of each output tensor, divided by the batch size). A fused call
runs no inner `__call__`, so `FusedRNN` adds the run's last layer's loss
itself, and the rules keep a regularized layer from sitting anywhere else in
a run (`activity_regularizer`, `bidirectional_activity_regularizer`,
`cell_activity_regularizer`). The backend test files parameterize over
`CASES` and call `check_case`.
"""

from __future__ import annotations

import keras
import numpy as np
from builders import fused_layers

import rnnfuse

L = keras.layers


def _lstm(units=4, **kw):
    kw.setdefault("return_sequences", True)
    return L.LSTM(units, **kw)


def _sequential(*layers, shape=(6, 3)):
    return keras.Sequential([keras.Input(shape), *layers, L.Dense(1)])


def _issue_repro():
    # The issue's model, with weight regularizers as well: both LSTMs carry an
    # activity regularizer, so they cannot be one run (the first is below the
    # top): two groups of one, each adding its own layer's loss.
    return _sequential(
        _lstm(activity_regularizer="l2", kernel_regularizer="l2"),
        _lstm(return_sequences=False, activity_regularizer="l2", recurrent_regularizer="l1"),
    )


def _last_layer():
    return _sequential(
        _lstm(kernel_regularizer="l2"),
        _lstm(return_sequences=False, activity_regularizer="l2", bias_regularizer="l1"),
    )


def _bidirectional():
    return _sequential(
        L.Bidirectional(_lstm()),
        L.Bidirectional(_lstm(return_sequences=False), activity_regularizer=keras.regularizers.L1L2(0.01, 0.01)),
    )


def _rnn_cell_middle():
    # The middle layer's regularizer ends the first run there: groups
    # (r0, r1) and (r2,) (a loop kind fuses alone), each adding its own
    # loss. (Keras' SimpleRNN layer drops its activity_regularizer argument,
    # so RNN(SimpleRNNCell) it is.)
    def rnn(**kw):
        return L.RNN(L.SimpleRNNCell(4), **kw)

    return _sequential(
        rnn(return_sequences=True),
        rnn(return_sequences=True, activity_regularizer="l2"),
        rnn(activity_regularizer="l1"),
    )


def _masked():
    inp = keras.Input((6, 3))
    x = L.Masking()(inp)
    x = _lstm()(x)
    x = _lstm(return_sequences=False, activity_regularizer="l2")(x)
    return keras.Model(inp, L.Dense(1)(x))


def _states():
    # return_state: Keras regularizes every output tensor (y, h and c).
    inp = keras.Input((6, 3))
    x = _lstm()(inp)
    y, h, c = _lstm(return_sequences=False, return_state=True, activity_regularizer="l2")(x)
    return keras.Model(inp, L.Dense(1)(L.Concatenate()([y, h, c])))


# name -> (model factory, groups the model fuses into under
# plan=rnnfuse.FUSED, as layer counts)
CASES = {
    "issue_repro": (_issue_repro, [1, 1]),
    "last_layer": (_last_layer, [2]),
    "bidirectional": (_bidirectional, [2]),
    "rnn_cell_middle": (_rnn_cell_middle, [2, 1]),
    "masked": (_masked, [2]),
    "states": (_states, [2]),
}


def twins(name: str):
    """(model, reference): two models of case `name` with equal weights."""
    make, _ = CASES[name]
    keras.utils.set_random_seed(7)
    model = make()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    return model, reference


def data(model, n: int = 8, seed: int = 0, *, padded: bool = False):
    """(x, y) for `model`; with `padded`, right-padded rows (zeros: Masking)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6, 3)).astype("float32")
    if padded:
        for row, length in enumerate(rng.integers(2, 7, n)):
            x[row, length:] = 0.0
    return x, rng.standard_normal((n, 1)).astype("float32")


def losses_of(model, x) -> list[float]:
    """`model.losses` after one training-mode call on `x`, as floats."""
    model(x, training=True)
    return [float(keras.ops.convert_to_numpy(v)) for v in model.losses]


def assert_losses_match(model, fast, x) -> None:
    """`fast.losses` equals `model.losses` in number and value, and there
    is an activity loss among them (the check could fail)."""
    expected = losses_of(model, x)
    got = losses_of(fast, x)
    assert len(got) == len(expected), (got, expected)
    np.testing.assert_allclose(sorted(got), sorted(expected), rtol=1e-5, atol=1e-7)
    weight_only = len([w for w in model.trainable_weights if w.regularizer is not None])
    assert len(expected) > weight_only, "the case has no activity loss to check"


def assert_training_matches(model, reference, fast, x, y) -> None:
    """`evaluate` and one `fit` epoch of `fast` (which trains `model`'s own
    variables) give what the same steps give on the untouched `reference`."""
    for m in (fast, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    np.testing.assert_allclose(
        fast.evaluate(x, y, batch_size=4, verbose=0),
        reference.evaluate(x, y, batch_size=4, verbose=0),
        rtol=1e-5,
    )
    got = fast.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history["loss"]
    want = reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def check_case(name: str, fused_calls) -> None:
    """Case `name` fused with `rnnfuse.FUSED`: the expected runs, the
    losses and training match the original, and where a run fuses, the
    backend's fused call ran (`fused_calls`: the fixture that records it)."""
    model, reference = twins(name)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert [len(f.fused_layers) for f in fused_layers(fast)] == CASES[name][1]
    x, y = data(model, padded=name == "masked")
    assert_losses_match(model, fast, x)
    assert_training_matches(model, reference, fast, x, y)
    if CASES[name][1]:
        assert fused_calls, "the fused call did not run"
