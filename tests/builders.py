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


def layers_model(layers, functional: bool = True, shape=(6, 3)) -> keras.Model:
    """`layers` applied in turn to one input of `shape`: a functional model,
    or a Sequential one."""
    if not functional:
        return keras.Sequential([keras.Input(shape), *layers])
    x = inp = keras.Input(shape)
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


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
    """A measured TuneResult chose the fastest candidate it could train on,
    or the original layers where that one beat them by less than the tuner's
    margin (`rnnfuse.tuning.tuner.KEEP_ORIGINAL_MARGIN`). A timed candidate
    is out only where its gradient check rejected it."""
    from rnnfuse.tuning.tuner import KEEP_ORIGINAL_MARGIN

    out = {n: result.rejected[n] for n in result.timings if n in result.rejected}
    assert all(r.startswith(("gradient error", "not checked")) for r in out.values()), out
    timings = {n: t for n, t in result.timings.items() if n not in out}
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


def spy_each(monkeypatch, owner, attrs) -> list:
    """`spy_on` each of `owner`'s `attrs`: the list of the names called, in order."""
    ran = []
    for attr in attrs:
        spy_on(monkeypatch, owner, attr, ran)
    return ran


def answering(answer, asked: list):
    """A stand-in function that records its arguments in `asked` and returns `answer`.

    >>> asked = []; answering("no", asked)(1, 2), asked
    ('no', [(1, 2)])
    """

    def stand_in(*args):
        asked.append(args)
        return answer

    return stand_in


def wavefront_stack(kind: str = "lstm", layers: int = 2, units: int = 8, steps: int = 7,
                    **kwargs) -> keras.Model:
    """The wavefront tests' stack: `stack_model` with 5 input features and
    every layer returning sequences."""
    return stack_model(kind, layers, units=units, input_size=5, steps=steps,
                       last_return_sequences=True, **kwargs)


def bidirectional_stack(kind: str = "lstm", merge_mode: str = "concat", layers: int = 2,
                        units: int = 8, steps: int = 7, *, features: int = 5,
                        masked: bool = False, initial_state: bool = False) -> keras.Model:
    """Keras Bidirectional LSTM or GRU layers, each returning sequences, over
    [steps, features]: a Masking layer first where `masked`; where
    `initial_state`, the first layer's states are model inputs."""
    rnn = keras.layers.LSTM if kind == "lstm" else keras.layers.GRU
    inp = keras.Input((steps, features))
    states = [keras.Input((units,)) for _ in range(4 if kind == "lstm" else 2)]
    x = keras.layers.Masking(0.0)(inp) if masked else inp
    for i in range(layers):
        wrapped = keras.layers.Bidirectional(rnn(units, return_sequences=True),
                                             merge_mode=merge_mode)
        x = wrapped(x, initial_state=states) if initial_state and i == 0 else wrapped(x)
    return keras.Model([inp, *states] if initial_state else inp, x)


def wavefront_inputs(batch: int = 4, steps: int = 7, seed: int = 0) -> np.ndarray:
    """float32 [batch, steps, 5] standard-normal inputs for `wavefront_stack`."""
    return np.random.default_rng(seed).standard_normal((batch, steps, 5)).astype("float32")


def wavefront_mask(masked: bool = True):
    """The right-padded [4, 7] mask (lengths 7, 5, 3, 6) of `wavefront_inputs`, or None."""
    return np.arange(7)[None, :] < np.array([7, 5, 3, 6])[:, None] if masked else None


def fused_with_plan(model: keras.Model, plan):
    """The one FusedRNN of `rnnfuse.optimize(model, tune=False)`, set to
    `plan` (a `FusedPlan`, sized to the run)."""
    (layer,) = fused_layers(rnnfuse.optimize(model, tune=False))
    layer.set_plan(plan.for_length(len(layer.fused_layers)))
    return layer


def built_stack(kind: str, layers: int, units: int, inputs: int, **cell_kwargs):
    """A `StackSpec` of `layers` built Keras LSTM or GRU cells, one a level,
    the first reading `inputs` features.

    >>> built_stack("gru", 2, 4, 3).cells[1][0].kernel.shape
    (4, 12)
    """
    from rnnfuse.backends.base import StackSpec

    cell_type = {"lstm": keras.layers.LSTMCell, "gru": keras.layers.GRUCell}[kind]
    cells = []
    for i in range(layers):
        cell = cell_type(units, **cell_kwargs)
        cell.build((None, inputs if i == 0 else units))
        cells.append((cell,))
    return StackSpec(kind, units, tuple(cells))


def randomize(model: keras.Model, seed: int = 0, scale: float = 0.5) -> None:
    """Every weight of `model` drawn uniform in [-scale, scale) from `seed`."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(-scale, scale, v.shape).astype(v.dtype))


def fused_stack(kind: str, num_layers: int, seed: int, **stack_kwargs):
    """(model, fast): a `stack_model` with `randomize`d weights, and its
    optimization that runs every group fused (plan FUSED)."""
    model = stack_model(kind, num_layers, **stack_kwargs)
    randomize(model, seed)
    return model, rnnfuse.optimize(model, plan=rnnfuse.FUSED)


def stack_case(kind: str, num_layers: int, *, batch: int, seeds, **stack_kwargs):
    """(model, fast, inputs): a `fused_stack` (weights from seeds[0]) and
    `random_inputs` of `batch` rows from seeds[1]."""
    model, fast = fused_stack(kind, num_layers, seeds[0], **stack_kwargs)
    return model, fast, random_inputs(model, batch, np.random.default_rng(seeds[1]))


def masked_stack_case(kind: str, num_layers: int = 3, *, units: int = 32, input_size: int = 16,
                      steps: int = 40, batch: int = 8, seeds=(2, 3), first_row: int = 5,
                      **stack_kwargs):
    """(model, fast, tokens): a `fused_stack` behind an Embedding mask (its
    last layer returning sequences), weights from seeds[0], and right-padded
    tokens from seeds[1] whose first row keeps `first_row` tokens."""
    model, fast = fused_stack(kind, num_layers, seeds[0], units=units, input_size=input_size,
                              steps=steps, masked=True, last_return_sequences=True,
                              **stack_kwargs)
    tokens = random_inputs(model, batch, np.random.default_rng(seeds[1]), padding="right")
    tokens[0, first_row:] = 0
    return model, fast, tokens


def initial_state_case(kind: str, num_layers: int = 3, *, units: int = 32, input_size: int = 16,
                       steps: int = 40, batch: int = 8, seeds=(4, 5)):
    """(model, fast, inputs): a `stack_case` whose first layer takes initial
    states and runs backwards, and whose last returns its states."""
    return stack_case(kind, num_layers, batch=batch, seeds=seeds, units=units,
                      input_size=input_size, steps=steps, initial_state=True,
                      go_backwards_first=True, last_return_state=True)


def sequence_input(masked: bool, steps, features: int, vocab: int = 11):
    """(model input, what the first layer reads): int tokens through
    Embedding(vocab, features, mask_zero=True) where `masked`, else
    float [steps, features] inputs themselves."""
    if masked:
        inp = keras.Input((steps,), dtype="int32")
        return inp, keras.layers.Embedding(vocab, features, mask_zero=True)(inp)
    inp = keras.Input((steps, features))
    return inp, inp


def lstm_dropout_lstm(units: int, rate: float, steps: int, features: int,
                      **dropout_kwargs) -> keras.Model:
    """LSTM, Dropout(rate), LSTM, both returning sequences: a Dropout that
    a fused run absorbs."""
    inp = keras.Input((steps, features))
    x = keras.layers.LSTM(units, return_sequences=True)(inp)
    x = keras.layers.Dropout(rate, **dropout_kwargs)(x)
    return keras.Model(inp, keras.layers.LSTM(units, return_sequences=True)(x))


def projected_stack(levels: int, units: int, proj: int, steps: int, features: int, *,
                    bidirectional: bool = False) -> keras.Model:
    """`levels` ProjectedLSTM layers returning sequences (each wrapped in
    Bidirectional where `bidirectional`)."""
    from rnnfuse.layers import ProjectedLSTM

    inp = keras.Input((steps, features))
    x = inp
    for _ in range(levels):
        layer = ProjectedLSTM(units, proj, return_sequences=True)
        x = (keras.layers.Bidirectional(layer) if bidirectional else layer)(x)
    return keras.Model(inp, x)


def saved_stack(tmp_path, layer_type=keras.layers.LSTM):
    """The path of a saved Sequential of two `layer_type` layers of 4 units
    over [6, 3] inputs (one group that fuses), for the CLI tests."""
    model = keras.Sequential(
        [keras.Input((6, 3)), layer_type(4, return_sequences=True), layer_type(4)]
    )
    path = tmp_path / "m.keras"
    model.save(path)
    return path


def stack_spec(layers):
    """The `StackSpec` of consecutive recurrent `layers` (as FusedRNN
    describes them, but for the Keras-loop flag)."""
    from rnnfuse.backends.base import StackSpec
    from rnnfuse.recurrent import describe, input_merges

    views = [describe(layer) for layer in layers]
    return StackSpec(
        kind=views[0].kind,
        units=views[0].units,
        cells=tuple(level for v in views for level in v.levels),
        proj_size=views[0].proj_size,
        input_merges=input_merges(views),
    )


def failing_to_build(monkeypatch, first_layer: str, error: Exception) -> None:
    """The rewrite's FusedRNN raises `error` for the group whose first layer
    is named `first_layer`, and builds every other group."""
    from rnnfuse.passes import rewrite

    real = rewrite.FusedRNN

    def flaky(layers, **kwargs):
        if layers[0].name == first_layer:
            raise error
        return real(layers, **kwargs)

    monkeypatch.setattr(rewrite, "FusedRNN", flaky)


def race_online(fast, medians: dict, ran: list):
    """Turns online tuning on for `fast` with each candidate's step timed at
    `medians[name]` and the gradient check passing; `ran` collects the
    candidate of each step; the whole fit its budget (a short test fit races).
    Returns the model's tuning state."""
    state = fast._rnnfuse_autotune
    state.online, state.fit_share = True, 1.0
    state.measure_step = lambda name, run: (ran.append(name) or run(), medians[name])
    state.check_gradients = lambda *args: 1e-6
    return state
