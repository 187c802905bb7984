"""ProjectedLSTM: the fast path against Keras' generic loop and a float64
NumPy reference (outputs, states, and finite-difference gradients), masks,
go_backwards, initial states, dropout, mixed precision, Bidirectional,
serialization, and stacks through rnnfuse.analyze / optimize."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import keras
import tensorflow as tf

import rnnfuse
from lstmp_reference import lstmp
from rnnfuse.layers import ProjectedLSTM, ProjectedLSTMCell
from rnnfuse.backends.tensorflow import projected_lstm as tf_plstm
from rnnfuse.layers import projected_lstm as plstm
from rnnfuse.recurrent import describe
from rnnfuse.rules import layer_reason

# One set of shapes everywhere, so the traced (and XLA-compiled) loops are
# reused between tests.
B, T, F, U, P = 3, 6, 4, 5, 3
VARIANTS = ("off", "while", "custom", "while_xla", "custom_xla")


# -- float64 NumPy reference ---------------------------------------------------------


def reference(x, weights, h0, c0, mask=None, go_backwards=False, zero_output_for_mask=False):
    """Keras' generic loop over the LSTMP step, in float64 (tests/lstmp_reference.py).

    Returns (outputs [B, T, P] in processing order, h, c).
    """
    return lstmp(x, weights, h0, c0, mask, go_backwards, zero_output_for_mask)


def reference_grads(loss, params, eps=1e-6):
    """Central finite differences of `loss(params)` (float64) for each array."""
    grads = []
    for p in params:
        g = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + eps
            up = loss(params)
            p[idx] = old - eps
            down = loss(params)
            p[idx] = old
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def _weights64(cell):
    return [
        np.array(v.numpy(), np.float64)
        for v in (cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel)
    ]


def _data(seed=0, features=F):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, features)).astype("float32")
    h0 = rng.normal(size=(B, P)).astype("float32")
    c0 = rng.normal(size=(B, U)).astype("float32")
    loss_w = [rng.normal(size=s) for s in ((B, T, P), (B, P), (B, U))]
    return x, h0, c0, loss_w


MASKS = {
    "none": None,
    # Right-padded, one sequence full length.
    "right": np.array([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], bool),
    # Holes and leading padding (Keras' loop keeps the state there too).
    "holes": np.array([[0, 0, 1, 1, 0, 1], [1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0]], bool),
}


def _run(layer, x, path, *, h0=None, c0=None, mask=None, training=False, loss_w=None):
    """Outputs, states and gradients (weights, then h0, c0) of `layer`."""
    h0v = tf.Variable(h0) if h0 is not None else None
    c0v = tf.Variable(c0) if c0 is not None else None
    kwargs = {"training": training}
    if mask is not None:
        kwargs["mask"] = tf.constant(mask)
    if h0 is not None:
        kwargs["initial_state"] = [h0v, c0v]
    name, _, unroll = path.partition("/u")
    with plstm.fast_path(name, int(unroll or 1)):
        with tf.GradientTape() as tape:
            y, h, c = layer(x, **kwargs)
            w = loss_w or [np.ones(y.shape), np.ones(h.shape), np.ones(c.shape)]
            loss = sum(
                tf.reduce_sum(tf.cast(a, tf.float32) * tf.constant(b, tf.float32))
                for a, b in zip((y, h, c), w)
            )
        cell = layer.cell
        wrt = [cell.kernel, cell.recurrent_kernel, cell.bias, cell.projection_kernel]
        if h0 is not None:
            wrt += [h0v, c0v]
        grads = tape.gradient(loss, wrt)
    return [np.asarray(t, np.float64) for t in (y, h, c)], [np.asarray(g, np.float64) for g in grads]


def _close(a, b, atol, rtol=1e-4):
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


# -- the fast path against the float64 reference -------------------------------------------


# XLA compiles are slow on the CPU: the XLA variants run the general case
# only (the unmasked loop is XLA-compiled in the jit_compile test below, and
# every case in tests/gpu).
@pytest.mark.parametrize(
    "variant, case",
    [(v, "holes_backwards_state") for v in VARIANTS]
    + [(v, "plain") for v in VARIANTS if not v.endswith("_xla")]
    # Unrolled loops: 2 or 3 time steps per iteration (T = 6).
    + [("custom/u2", "holes_backwards_state"), ("custom/u3", "plain")],
)
def test_every_variant_matches_float64_reference(variant, case):
    x, h0, c0, loss_w = _data()
    general = case != "plain"
    mask = MASKS["holes"] if general else None
    layer = ProjectedLSTM(U, P, return_sequences=True, return_state=True, go_backwards=general)
    layer.build((B, T, F))
    weights = _weights64(layer.cell)
    init = (h0, c0) if general else (np.zeros((B, P), "float32"), np.zeros((B, U), "float32"))
    outs, grads = _run(
        layer, x, variant, h0=init[0], c0=init[1], mask=mask, loss_w=loss_w
    )
    assert layer.last_path == variant if variant != "off" else layer.last_path.startswith("keras_loop")

    x64 = x.astype(np.float64)

    def loss(params):
        y, h, c = reference(x64, params[:4], params[4], params[5], mask, general)
        return sum(np.sum(a * w) for a, w in zip((y, h, c), loss_w))

    params = weights + [init[0].astype(np.float64), init[1].astype(np.float64)]
    ref = reference(x64, weights, params[4], params[5], mask, general)
    for got, want in zip(outs, ref):
        _close(got, want, atol=2e-6)
    for got, want in zip(grads, reference_grads(loss, params)):
        _close(got, want, atol=2e-5, rtol=2e-4)


# -- fast path == Keras' generic loop, feature by feature -------------------------------


@pytest.mark.parametrize(
    "mask_kind, go_backwards, zero_output, return_sequences",
    [
        ("right", False, False, True),
        ("right", True, True, True),
        ("holes", False, True, True),
        ("holes", True, False, False),
        ("none", True, False, False),
    ],
)
def test_fast_path_equals_keras_loop(mask_kind, go_backwards, zero_output, return_sequences):
    x, h0, c0, _ = _data(1)
    layer = ProjectedLSTM(
        U,
        P,
        return_sequences=return_sequences,
        return_state=True,
        go_backwards=go_backwards,
        zero_output_for_mask=zero_output,
    )
    mask = MASKS[mask_kind]
    ref_outs, ref_grads = _run(layer, x, "off", h0=h0, c0=c0, mask=mask)
    outs, grads = _run(layer, x, "custom", h0=h0, c0=c0, mask=mask)
    assert layer.last_path == "custom"
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        _close(a, b, atol=1e-5)
    # And the Keras loop itself follows the reference (output at padding).
    y, h, c = reference(
        x.astype(np.float64), _weights64(layer.cell), h0, c0, mask, go_backwards, zero_output
    )
    _close(ref_outs[0], y if return_sequences else y[:, -1], atol=2e-6)
    _close(ref_outs[1], h, atol=2e-6)


def test_last_path_names_the_path_and_keras_loop_reasons():
    x = _data()[0]
    custom = ProjectedLSTM(U, P)
    with plstm.fast_path("custom"):
        custom(x)
    assert custom.last_path.split("/")[0] == "custom", custom.last_path
    layer = ProjectedLSTM(U, P, recurrent_dropout=0.2)
    layer(x)
    assert layer.last_path.startswith("keras_loop: recurrent_dropout")
    layer = ProjectedLSTM(U, P, use_cudnn=False)
    layer(x)
    assert layer.last_path == "keras_loop: use_cudnn=False"
    layer = ProjectedLSTM(U, P, activation="relu")
    with plstm.fast_path("custom"):
        layer(x)
    # The hand-written gradient is tanh/sigmoid only: autodiff loop instead.
    assert layer.last_path == "while"


def test_relu_activation_uses_autodiff_loop_and_matches():
    x, h0, c0, _ = _data(2)
    layer = ProjectedLSTM(U, P, activation="relu", return_sequences=True, return_state=True)
    ref = _run(layer, x, "off", h0=h0, c0=c0, mask=MASKS["holes"])
    got = _run(layer, x, "custom", h0=h0, c0=c0, mask=MASKS["holes"])
    assert layer.last_path == "while"
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        _close(a, b, atol=1e-5)


def test_input_dropout_matches_keras_loop():
    x = _data(3)[0]
    make = lambda: ProjectedLSTM(U, P, dropout=0.4, seed=7, return_sequences=True)
    fast, slow = make(), make()
    fast.build((B, T, F))
    slow.build((B, T, F))
    slow.set_weights(fast.get_weights())
    with plstm.fast_path("custom"):
        y_fast = fast(x, training=True)
    with plstm.fast_path("off"):
        y_slow = slow(x, training=True)
    assert fast.last_path == "custom"
    _close(y_fast.numpy(), y_slow.numpy(), atol=1e-5)
    # Training dropout changed the result; inference does not drop.
    with plstm.fast_path("custom"):
        y_eval = fast(x, training=False)
    assert not np.allclose(y_fast.numpy(), y_eval.numpy(), atol=1e-3)


def test_stateful_carries_state_between_calls():
    x = _data(4)[0]
    full = ProjectedLSTM(U, P)
    stateful = ProjectedLSTM(U, P, stateful=True)
    full.build((B, T, F))
    stateful.build((B, T // 2, F))
    stateful.set_weights(full.get_weights())
    with plstm.fast_path("custom"):
        stateful(x[:, : T // 2])
        y = stateful(x[:, T // 2 :])
        want = full(x)
    _close(y.numpy(), want.numpy(), atol=1e-6)


def test_mixed_float16_matches_float64_reference():
    keras.config.set_dtype_policy("mixed_float16")
    x, h0, c0, loss_w = _data(5)
    layer = ProjectedLSTM(U, P, return_sequences=True, return_state=True)
    layer.build((B, T, F))
    assert layer.cell.kernel.dtype == "float32"
    weights = _weights64(layer.cell)
    mask = MASKS["holes"]
    for path in ("custom", "off"):
        outs, grads = _run(layer, x, path, h0=h0, c0=c0, mask=mask, loss_w=loss_w)
        ref = reference(x.astype(np.float64), weights, h0, c0, mask)
        for got, want in zip(outs, ref):
            _close(got, want, atol=1e-2, rtol=1e-2)

        def loss(params):
            y, h, c = reference(x.astype(np.float64), params[:4], params[4], params[5], mask)
            return sum(np.sum(a * w) for a, w in zip((y, h, c), loss_w))

        params = weights + [h0.astype(np.float64), c0.astype(np.float64)]
        for got, want in zip(grads, reference_grads(loss, params)):
            scale = max(1.0, float(np.abs(want).max()))
            _close(got, want, atol=1e-2 * scale, rtol=1e-2)
    y, _, _ = layer(x)
    assert y.dtype == "float16"


# -- Bidirectional -------------------------------------------------------------------------


@pytest.mark.parametrize("merge_mode", ["concat", None])
def test_bidirectional_matches_reference_and_keras_loop(merge_mode):
    x, h0, c0, _ = _data(6)
    mask = MASKS["right"]
    bi = keras.layers.Bidirectional(
        ProjectedLSTM(U, P, return_sequences=True, return_state=True), merge_mode=merge_mode
    )
    bi.build((B, T, F))
    results = {}
    for path in ("off", "custom"):
        with plstm.fast_path(path):
            with tf.GradientTape() as tape:
                out = bi(x, mask=tf.constant(mask))
                flat = keras.tree.flatten(out)
                loss = sum(tf.reduce_sum(t * (k + 1.0)) for k, t in enumerate(flat))
            grads = tape.gradient(loss, bi.trainable_weights)
        results[path] = [t.numpy() for t in flat] + [g.numpy() for g in grads]
    assert bi.forward_layer.last_path == bi.backward_layer.last_path == "custom"
    for a, b in zip(results["custom"], results["off"]):
        _close(a, b, atol=1e-5)
    # Bidirectional forces zero_output_for_mask=return_sequences on both sides.
    fy, fh, fc = reference(
        x.astype(np.float64), _weights64(bi.forward_layer.cell), 0 * h0, 0 * c0, mask,
        zero_output_for_mask=True,
    )
    by, bh, bc = reference(
        x.astype(np.float64), _weights64(bi.backward_layer.cell), 0 * h0, 0 * c0, mask,
        go_backwards=True, zero_output_for_mask=True,
    )
    by = by[:, ::-1]
    want = [np.concatenate([fy, by], -1)] if merge_mode == "concat" else [fy, by]
    want += [fh, fc, bh, bc]
    for got, w in zip(results["custom"], want):
        _close(got, w, atol=2e-6)


# -- arguments, config, serialization -------------------------------------------------------


def test_weights_names_shapes_and_forget_bias():
    layer = ProjectedLSTM(U, P)
    layer.build((B, T, F))
    names = [w.path.split("/")[-1] for w in layer.weights]
    assert names == ["kernel", "recurrent_kernel", "bias", "projection_kernel"]
    assert [tuple(w.shape) for w in layer.weights] == [(F, 4 * U), (P, 4 * U), (4 * U,), (U, P)]
    bias = layer.cell.bias.numpy()
    np.testing.assert_array_equal(bias[U : 2 * U], 1.0)
    np.testing.assert_array_equal(np.delete(bias, np.s_[U : 2 * U]), 0.0)
    no_bias = ProjectedLSTM(U, P, use_bias=False)
    no_bias.build((B, T, F))
    assert [w.path.split("/")[-1] for w in no_bias.weights] == [
        "kernel", "recurrent_kernel", "projection_kernel",
    ]
    with plstm.fast_path("custom"):
        y = no_bias(_data()[0], training=False)
    assert tuple(y.shape) == (B, P)
    cell = ProjectedLSTMCell(U, P)
    assert (cell.state_size, cell.output_size) == ([P, U], P)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"units": 0, "proj_size": 3}, "units=0"),
        ({"units": 4, "proj_size": -1}, "proj_size=-1"),
        ({"units": 4, "proj_size": 2.5}, "proj_size=2.5"),
        ({"units": 4, "proj_size": 2, "use_cudnn": "yes"}, "use_cudnn='yes'"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ProjectedLSTM(**kwargs)


def test_use_cudnn_true_raises_where_fast_path_cannot_run():
    layer = ProjectedLSTM(U, P, recurrent_dropout=0.1, use_cudnn=True)
    with pytest.raises(ValueError, match="use_cudnn='auto'"):
        layer(_data()[0])
    with pytest.raises(ValueError, match="unknown fast path 'fast'"):
        plstm.set_fast_path("fast")
    with pytest.raises(ValueError, match="unroll=0"):
        plstm.set_fast_path("custom", unroll=0)
    assert (plstm.get_fast_path(), plstm.get_unroll()) == ("auto", 4)


def test_config_round_trip_and_saved_model(tmp_path):
    layer = ProjectedLSTM(
        U, P, return_sequences=True, go_backwards=True, dropout=0.1,
        projection_regularizer="l2", unit_forget_bias=False, name="plstm",
    )
    clone = ProjectedLSTM.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert layer.get_config()["proj_size"] == P
    inp = keras.Input((T, F))
    x = keras.layers.Bidirectional(ProjectedLSTM(U, P, return_sequences=True))(inp)
    x = layer(x)
    out = keras.layers.RNN(ProjectedLSTMCell(U, P), name="rnn_cell")(x)
    model = keras.Model(inp, out)
    data = _data()[0]
    path = tmp_path / "plstm.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("plstm")) is ProjectedLSTM
    assert type(loaded.layers[1].forward_layer) is ProjectedLSTM
    assert type(loaded.get_layer("rnn_cell").cell) is ProjectedLSTMCell
    _close(loaded.predict(data, verbose=0), model.predict(data, verbose=0), atol=1e-6)


def test_a_config_without_the_fast_path_arguments_still_loads():
    """Files saved before `fast_path`/`fast_path_unroll` existed load, with
    the process-wide choice (None)."""
    config = ProjectedLSTM(U, P, name="old").get_config()
    assert (config["fast_path"], config["fast_path_unroll"]) == (None, None)
    del config["fast_path"], config["fast_path_unroll"]
    layer = ProjectedLSTM.from_config(config)
    assert (layer.fast_path, layer.fast_path_unroll) == (None, None)


def test_the_layers_fast_path_argument_wins_and_is_saved(tmp_path):
    x = _data()[0]
    layer = ProjectedLSTM(U, P, fast_path="while", fast_path_unroll=2, name="own")
    model = keras.Sequential([keras.Input((T, F)), layer])
    with plstm.fast_path("custom"):
        model(x)
    assert layer.last_path == "while/u2"
    off = ProjectedLSTM(U, P, fast_path="off")
    off(x)
    assert off.last_path == "keras_loop: the fast path is switched off (fast_path='off')"
    path = tmp_path / "own.keras"
    model.save(path)
    loaded = keras.models.load_model(path).get_layer("own")
    assert (loaded.fast_path, loaded.fast_path_unroll) == ("while", 2)
    with pytest.raises(ValueError, match="ProjectedLSTM\\(fast_path\\): unknown fast path 'fast'"):
        ProjectedLSTM(U, P, fast_path="fast")
    with pytest.raises(ValueError, match="fast_path_unroll.*unroll=0"):
        ProjectedLSTM(U, P, fast_path_unroll=0)


def test_the_environment_variables_are_read_at_call_time(monkeypatch):
    x = _data()[0]
    monkeypatch.setenv("RNNFUSE_PROJECTED_LSTM_PATH", "while")
    monkeypatch.setenv("RNNFUSE_PROJECTED_LSTM_UNROLL", "3")
    assert (plstm.get_fast_path(), plstm.get_unroll()) == ("while", 3)
    layer = ProjectedLSTM(U, P)
    layer(x)
    assert layer.last_path == "while/u3"
    with plstm.fast_path("custom", unroll=1):  # set_fast_path wins
        assert (plstm.get_fast_path(), plstm.get_unroll()) == ("custom", 1)
    assert (plstm.get_fast_path(), plstm.get_unroll()) == ("while", 3)
    monkeypatch.setenv("RNNFUSE_PROJECTED_LSTM_PATH", "fast")
    with pytest.raises(ValueError, match="environment variable RNNFUSE_PROJECTED_LSTM_PATH"):
        plstm.get_fast_path()


def test_a_fast_path_block_holds_in_its_own_thread_only():
    import threading

    seen, entered, checked = {}, threading.Event(), threading.Event()

    def other():
        entered.wait(10)
        seen["other"] = plstm.get_fast_path()
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with plstm.fast_path("while", unroll=2):
        entered.set()
        checked.wait(10)
        seen["here"] = (plstm.get_fast_path(), plstm.get_unroll())
    thread.join()
    assert seen == {"other": "auto", "here": ("while", 2)}
    assert (plstm.get_fast_path(), plstm.get_unroll()) == ("auto", 4)


def test_jit_compiled_train_step_equals_plain_train_step():
    x, _, _, _ = _data(7)
    target = np.random.default_rng(7).normal(size=(B, P)).astype("float32")

    def make():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((T, F)), ProjectedLSTM(U, P)])
        return m

    results = []
    for jit in (False, True):
        model = make()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit)
        with plstm.fast_path("custom"):
            model.fit(x, target, epochs=1, batch_size=B, verbose=0)
        results.append([w.numpy() for w in model.weights])
    for a, b in zip(*results):
        _close(a, b, atol=1e-5)


# -- rnnfuse integration ---------------------------------------------------------------------


def test_describe_projected_lstm():
    layer = ProjectedLSTM(U, P, return_sequences=True)
    layer.build((B, T, F))
    view = describe(layer)
    assert (view.kind, view.units, view.proj_size, view.output_size) == ("lstm", U, P, P)
    assert view.input_size == F
    bi = keras.layers.Bidirectional(ProjectedLSTM(U, P, return_sequences=True))
    bi.build((B, T, F))
    view = describe(bi)
    assert (view.kind, view.proj_size, view.num_directions) == ("lstm", P, 2)
    rd = ProjectedLSTM(U, P, recurrent_dropout=0.3)
    rd.build((B, T, F))
    assert layer_reason(rd).rule == "recurrent_dropout"
    # cuDNN (the torch backend runs projected stacks) computes tanh/sigmoid only.
    relu = ProjectedLSTM(U, P, activation="relu")
    relu.build((B, T, F))
    assert layer_reason(relu).rule == "activation"
    assert "activation=relu" in layer_reason(relu)
    # The same maths as a custom cell under keras.layers.RNN is described alike.
    rnn = keras.layers.RNN(ProjectedLSTMCell(U, P))
    rnn.build((B, T, F))
    assert (describe(rnn).kind, describe(rnn).proj_size) == ("lstm", P)


def _stack(layers, masking=False):
    inp = keras.Input((T, F))
    x = keras.layers.Masking()(inp) if masking else inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


def test_analyze_groups_projected_stacks_and_explains_the_rest():
    model = _stack(
        [
            ProjectedLSTM(U, P, return_sequences=True, name="p1"),
            ProjectedLSTM(U, P, return_sequences=True, name="p2"),
            ProjectedLSTM(U, P, return_sequences=True, name="p3"),
            ProjectedLSTM(U, P + 1, return_sequences=True, name="p4"),
            keras.layers.LSTM(U, name="lstm"),
        ]
    )
    report = rnnfuse.analyze(model)
    # A lone ProjectedLSTM is no group (it needs 2 levels); the plain LSTM
    # after it is a group of one.
    group, lone = report.groups
    assert group.layers == ("p1", "p2", "p3") and lone.layers == ("lstm",)
    assert (group.cell, group.units, group.proj_size, group.num_layers) == ("lstm", U, P, 3)
    assert report.skipped["p4"].rule == "proj_size"
    assert set(report.skipped) == {"p4"}
    text = str(report)
    assert f"lstm (proj {P})" in text
    assert "proj_size=4" in text
    report = rnnfuse.analyze(model, min_layers=2)
    assert report.skipped["lstm"].rule == "proj_size"
    assert "proj_size=0" in str(report)

    bi = _stack(
        [
            keras.layers.Bidirectional(ProjectedLSTM(U, P, return_sequences=True), name="b1"),
            keras.layers.Bidirectional(ProjectedLSTM(U, P, return_sequences=True), name="b2"),
        ]
    )
    (group,) = rnnfuse.analyze(bi).groups
    assert group.layers == ("b1", "b2") and group.bidirectional and group.proj_size == P


@pytest.mark.parametrize("bidirectional", [False, True])
def test_optimize_projected_stack_equals_original(bidirectional, emulated_cudnn):
    wrap = (lambda l: keras.layers.Bidirectional(l)) if bidirectional else (lambda l: l)
    model = _stack(
        [wrap(ProjectedLSTM(U, P, return_sequences=True)) for _ in range(2)]
        + [wrap(ProjectedLSTM(U, P))],
        masking=True,
    )
    x = _data(8)[0]
    x[1, 4:] = 0.0  # right padding, seen by Masking
    x[2, 2:] = 0.0
    fast = rnnfuse.optimize(model)
    fused = [l for l in fast.layers if isinstance(l, rnnfuse.FusedRNN)]
    assert len(fused) == 1 and len(fused[0].fused_layers) == 3
    with plstm.fast_path("custom"):
        want = model(x)
        got = fast(x)
    _close(got.numpy(), want.numpy(), atol=1e-6)
    # The TF backend refuses projections, so FusedRNN ran the original
    # layers, each on its fast path; the cuDNN op never ran.
    assert fused[0].last_path.startswith("layers:") and "projection" in fused[0].last_path
    assert emulated_cudnn == []
    inner = fused[0].fused_layers[0]
    parts = (inner.forward_layer, inner.backward_layer) if bidirectional else (inner,)
    assert all(p.last_path == "custom" for p in parts)


def test_auto_picks_xla_only_with_a_gpu_where_xla_compiles(monkeypatch, caplog, request):
    assert plstm.get_fast_path(resolve=True) == "custom"  # no GPU here
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])
    probe = tf_plstm._xla_works
    monkeypatch.setattr(tf_plstm, "_xla_works", lambda: True)
    assert plstm.get_fast_path(resolve=True) == "custom_xla"

    def broken(jit):
        raise tf.errors.InternalError(None, None, "libdevice not found")

    monkeypatch.setattr(tf_plstm, "_xla_works", probe)
    monkeypatch.setattr(tf_plstm, "_custom_functions", broken)
    probe.cache_clear()
    request.addfinalizer(probe.cache_clear)  # no probe answer leaks out
    with caplog.at_level(logging.WARNING, logger="rnnfuse"):
        assert plstm.get_fast_path(resolve=True) == "custom"
    # The layer recovers by itself: a notice on the rnnfuse logger, not a warning.
    assert any("libdevice not found" in r.getMessage() for r in caplog.records)
    assert plstm.get_fast_path(resolve=True) == "custom"  # checked once


def test_output_keeps_its_static_time_dimension_for_an_unrolled_layer_after_it():
    """ProjectedLSTM -> LSTM(unroll=True) trains under
    TensorFlow's graph mode (the fast path's loop lost the time dimension)."""
    inp = keras.Input((6, 3))
    seq = ProjectedLSTM(8, 4, return_sequences=True)
    x = seq(inp)
    assert tuple(x.shape) == (None, 6, 4)
    x = keras.layers.LSTM(5, unroll=True)(x)
    model = keras.Model(inp, x)
    model.compile("adam", "mse", jit_compile=False)
    hist = model.fit(np.zeros((4, 6, 3), "float32"), np.zeros((4, 5), "float32"), verbose=0, epochs=1)
    assert np.isfinite(hist.history["loss"][0])
    graph = tf.function(lambda t: seq(t)).get_concrete_function(tf.TensorSpec([None, 6, 3])).graph
    assert graph.outputs[0].shape.as_list() == [None, 6, 4]
