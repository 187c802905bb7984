"""Small model builders shared by the tests."""

from __future__ import annotations

import keras
import numpy as np

import rnnfuse

KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def rnn_layer(kind: str, units: int, **kwargs) -> keras.layers.Layer:
    """A Keras recurrent layer of cuDNN kind `kind`."""
    if kind == "lstm":
        return keras.layers.LSTM(units, **kwargs)
    if kind == "gru":
        return keras.layers.GRU(units, **kwargs)
    activation = {"rnn_tanh": "tanh", "rnn_relu": "relu"}[kind]
    return keras.layers.SimpleRNN(units, activation=activation, **kwargs)


def num_states(kind: str) -> int:
    return 2 if kind == "lstm" else 1


def stack_model(
    kind: str,
    num_layers: int,
    units: int = 6,
    input_size: int = 5,
    steps: int | None = 7,
    *,
    functional: bool = True,
    last_return_sequences: bool = False,
    last_return_state: bool = False,
    go_backwards_first: bool = False,
    initial_state: bool = False,
    masked: bool = False,
    dropout_first: float = 0.0,
    head: bool = False,
    dtype=None,
) -> keras.Model:
    """A stack of `num_layers` recurrent layers of one kind.

    masked: the input is int tokens through Embedding(mask_zero=True).
    initial_state: the first layer takes [h(, c)] model inputs.
    """
    layers = []
    for i in range(num_layers):
        last = i == num_layers - 1
        layers.append(
            rnn_layer(
                kind,
                units,
                return_sequences=True if not last else last_return_sequences,
                return_state=last and last_return_state,
                go_backwards=go_backwards_first and i == 0,
                dropout=dropout_first if i == 0 else 0.0,
                name=f"{kind}_{i}",
                dtype=dtype,
            )
        )
    if masked:
        inp = keras.Input((steps,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(11, input_size, mask_zero=True, name="embed")(inp)
    else:
        inp = keras.Input((steps, input_size), name="x")
        x = inp
    if not functional:
        if initial_state or last_return_state:
            raise ValueError("Sequential stacks take no states")
        seq = [keras.Input((steps,), dtype="int32")] if masked else [keras.Input((steps, input_size))]
        if masked:
            seq.append(keras.layers.Embedding(11, input_size, mask_zero=True))
        seq += layers
        if head:
            seq.append(keras.layers.Dense(3, name="head"))
        return keras.Sequential(seq)
    inputs = [inp]
    kwargs = {}
    if initial_state:
        states = [
            keras.Input((units,), name=f"s{j}") for j in range(num_states(kind))
        ]
        inputs += states
        kwargs["initial_state"] = states
    x = layers[0](x, **kwargs)
    for layer in layers[1:]:
        x = layer(x)
    if head:
        first = x[0] if isinstance(x, (list, tuple)) else x
        x = keras.layers.Dense(3, name="head")(first)
    return keras.Model(inputs if len(inputs) > 1 else inp, x)


def random_inputs(model: keras.Model, batch: int, rng, *, padding: str = "right"):
    """Inputs for `model`: floats, or tokens with padding 'right'/'middle'/'none'."""
    values = []
    for spec in model.inputs:
        shape = [batch if d is None else d for d in spec.shape]
        if "int" in str(spec.dtype):
            tokens = rng.integers(1, 11, shape)
            steps = shape[1]
            for b in range(batch):
                n = int(rng.integers(1, steps + 1))
                if padding == "right":
                    tokens[b, n:] = 0
                elif padding == "middle" and steps > 2:
                    tokens[b, int(rng.integers(1, steps - 1))] = 0
            values.append(tokens.astype("int32"))
        else:
            values.append(rng.standard_normal(shape).astype("float32"))
    return values if len(values) > 1 else values[0]


def flat_numpy(x):
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in keras.tree.flatten(x)]


def max_abs_diff(a, b) -> float:
    fa, fb = flat_numpy(a), flat_numpy(b)
    if len(fa) != len(fb):
        raise AssertionError(f"{len(fa)} outputs vs {len(fb)}")
    return max(float(np.max(np.abs(p.astype(np.float64) - q.astype(np.float64)))) for p, q in zip(fa, fb))


def kernels_ran(model: keras.Model) -> set:
    """The names of the kernels `model`'s fused layers ran in their last
    call ("RnnfuseCudnnRnn", "CudnnRNNV3", ...; `CallPath.kernel`)."""
    return {
        f.last_path.kernel.name
        for f in fused_layers(model)
        if f.last_path is not None and f.last_path.kernel is not None
    }


def fused_layers(model: keras.Model) -> list:
    """Every FusedRNN in `model`, nested models included (rnnfuse's own
    `rnnfuse.fused.fused_layers`)."""
    from rnnfuse.fused import fused_layers as listed

    return listed(model)


def fit_from_same_start(model: keras.Model, fast: keras.Model, x, y, *, batch_size: int, epochs: int = 2):
    """Fits `model`, then `fast` (which shares its variables), each from
    `model`'s current weights with SGD(0.1) and MSE, unshuffled.

    Returns:
        (start, trained_original, trained_fast): `model.weights` as NumPy
        arrays before, after the original's fit and after the fast one's.
    """
    start = [keras.ops.convert_to_numpy(v) for v in model.weights]
    trained = []
    for m in (model, fast):
        for v, s in zip(model.weights, start):
            v.assign(s)
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.fit(x, y, epochs=epochs, batch_size=batch_size, verbose=0, shuffle=False)
        trained.append([keras.ops.convert_to_numpy(v) for v in model.weights])
    return start, trained[0], trained[1]


def traced_op_types(fn, *args) -> set:
    """Op types in the graph `tf.function(fn)` traces for `args`, the bodies
    of the functions it calls (cond branches, gradients) included: how the
    GPU tests prove which kernel ran (TensorFlow only)."""
    import tensorflow as tf

    graph = tf.function(fn).get_concrete_function(*args).graph
    types = {op.type for op in graph.get_operations()}
    for f in graph.as_graph_def().library.function:
        types |= {n.op for n in f.node_def}
    return types


def assert_fastest_or_kept_original(result) -> None:
    """A measured TuneResult chose the fastest candidate, or the original
    layers where the fastest beat them by less than the tuner's margin
    (`rnnfuse.tuning.tuner.KEEP_ORIGINAL_MARGIN`)."""
    from rnnfuse.tuning.tuner import KEEP_ORIGINAL_MARGIN

    timings = result.timings
    best = min(timings.values())
    if result.plan.name == "per-layer":
        assert best >= (1 - KEEP_ORIGINAL_MARGIN) * timings["per-layer"], timings
    else:
        assert timings[result.plan.name] == best, timings


def spy_on(monkeypatch, owner, attr: str, ran: list, label: str | None = None) -> None:
    """Replace `owner.attr` for the test with a spy that appends `label`
    (default `attr`) to `ran`, then calls the real one.

    >>> import types
    >>> ns, ran = types.SimpleNamespace(f=lambda x: x + 1), []
    >>> mp = __import__("pytest").MonkeyPatch()
    >>> spy_on(mp, ns, "f", ran); (ns.f(1), ran)
    (2, ['f'])
    >>> mp.undo()
    """
    real = getattr(owner, attr)
    name = attr if label is None else label

    def spy(*args, **kwargs):
        ran.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, spy)


def wavefront_stack(kind: str = "lstm", layers: int = 2, units: int = 8, steps: int = 7,
                    **kwargs) -> keras.Model:
    """The wavefront tests' stack: `stack_model` with 5 input features and
    every layer returning sequences."""
    return stack_model(kind, layers, units=units, input_size=5, steps=steps,
                       last_return_sequences=True, **kwargs)


def wavefront_inputs(batch: int = 4, steps: int = 7, seed: int = 0) -> np.ndarray:
    """float32 [batch, steps, 5] standard-normal inputs for `wavefront_stack`."""
    return np.random.default_rng(seed).standard_normal((batch, steps, 5)).astype("float32")


def fused_with_plan(model: keras.Model, plan):
    """The one FusedRNN of `rnnfuse.optimize(model, tune=False)`, set to
    `plan` (a `FusedPlan`, sized to the run)."""
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    layer.set_plan(plan.for_length(len(layer.fused_layers)))
    return layer
