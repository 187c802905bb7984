"""FusedRNN on a real GPU against Keras' own per-layer path.

Every test pins `plan=rnnfuse.FUSED` (the whole run, TensorFlow's default
algorithm) to test fusion itself; test_gpu_plans.py covers the other plans.
Tests marked `cudnn_op` run rnnfuse's own op (the others CudnnRNNV3, with
the op turned off: tests/gpu/conftest.py).
Every test proves the fused CudnnRNNV3 call ran (a spy on the backend's
single call site, and in graph mode the op count in the traced graph), so a
silent fallback to the original layers fails the test.

Tolerances: float32 outputs relative error <= 1e-5, gradients
<= 1e-4; mixed_float16 <= 1e-2. TF32 is off (tests/gpu/conftest.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import KINDS, fused_layers, kernels_ran, lstm_dropout_lstm, random_inputs, rnn_layer, stack_model, traced_op_types
from gpu_compare import worst_within
from rnnfuse.backends import tensorflow as tf_backend

L = keras.layers


@pytest.fixture
def cudnn_calls(monkeypatch):
    """Records every fused CudnnRNNV3 call (python-level, eager or trace)."""
    calls = []
    real = tf_backend.cudnn_rnn

    def spy(**kwargs):
        calls.append(
            {
                "levels_x_dirs": int(kwargs["input_h"].shape[0]),
                "dtype": kwargs["input"].dtype.name,
                "direction": kwargs["direction"],
                "dropout": kwargs["dropout"],
            }
        )
        return real(**kwargs)

    monkeypatch.setattr(tf_backend, "cudnn_rnn", spy)
    return calls


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _compare(model, fast, inputs, *, out_tol, grad_tol, training=False):
    results = []
    for m in (model, fast):
        with tf.GradientTape() as tape:
            out = m(inputs, training=training)
            flat = [tf.cast(t, tf.float32) for t in keras.tree.flatten(out)]
            loss = sum(tf.reduce_sum(t * _weights(t) + t**2) for t in flat)
        grads = tape.gradient(loss, model.trainable_variables)
        results.append((flat, [tf.convert_to_tensor(g) for g in grads]))
    return worst_within(results, _rel, out_tol=out_tol, grad_tol=grad_tol)


def _weights(t):
    """A fixed, non-symmetric weighting over the last axis for the loss."""
    return tf.sin(tf.range(t.shape[-1], dtype=tf.float32) + 1.0)


def _cudnn_ops_in_graph(fn, *args) -> int:
    """CudnnRNNV3 ops in the traced forward graph, branches included."""
    graph_def = tf.function(fn).get_concrete_function(*args).graph.as_graph_def()
    nodes = list(graph_def.node)
    nodes += [n for f in graph_def.library.function for n in f.node_def]
    return sum(n.op == "CudnnRNNV3" for n in nodes)


SHAPES = [
    dict(num_layers=3, units=16, input_size=8, steps=12, batch=4),
    dict(num_layers=2, units=64, input_size=32, steps=50, batch=16),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "medium"])
def test_fused_matches_keras_float32(kind, shape, cudnn_calls):
    shape = dict(shape)
    batch = shape.pop("batch")
    model = stack_model(kind, last_return_sequences=True, head=True, **shape)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, batch, np.random.default_rng(0))
    out_err, grad_err = _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert cudnn_calls and cudnn_calls[-1]["levels_x_dirs"] == shape["num_layers"]
    assert fused_layers(fast)[0].last_path == "fused"
    print(f"{kind} {shape}: rel out {out_err:.2e} grad {grad_err:.2e}")


# rnn_relu in float16 is compared against float64 instead (test_gpu_plans.py):
# unbounded activations let two float16 computations drift apart (1.7e-2).
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_fused_matches_keras_mixed_float16(kind, cudnn_calls):
    keras.config.set_dtype_policy("mixed_float16")
    model = stack_model(kind, 3, units=32, input_size=16, steps=20, last_return_sequences=True)
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(1))
    _compare(model, fast, x, out_tol=1e-2, grad_tol=1e-2)
    assert cudnn_calls[-1]["dtype"] == "float16"


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("last_return_sequences", [True, False])
def test_masks_states_and_reversal(kind, last_return_sequences, cudnn_calls):
    # Right-padded mask -> sequence lengths, fused.
    model = stack_model(kind, 3, masked=True, last_return_sequences=last_return_sequences, last_return_state=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    rng = np.random.default_rng(2)
    x = random_inputs(model, 6, rng, padding="right")
    _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert cudnn_calls
    # Initial states and a reversed first layer.
    model = stack_model(kind, 3, initial_state=True, go_backwards_first=True, last_return_state=True,
                        last_return_sequences=last_return_sequences)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    cudnn_calls.clear()
    _compare(model, fast, random_inputs(model, 5, rng), out_tol=1e-5, grad_tol=1e-4)
    assert cudnn_calls


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_mask_that_is_not_right_padded_does_what_the_original_layers_do(kind, cudnn_calls):
    """Eagerly, Keras falls back to its generic loop on such a mask and so
    does the fused model. Traced, Keras' cuDNN LSTM/GRU fail on it with
    their own message, and so does the fused model (no branch for other
    masks in its step); a right-padded mask runs fused."""
    model = stack_model(kind, 2, masked=True, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    rng = np.random.default_rng(3)
    x = random_inputs(model, 4, rng, padding="middle")
    x[0, 1] = 0
    expected = model(x)  # eager: Keras itself falls back to its generic loop
    assert _rel(fast(x), expected) <= 1e-5
    with pytest.raises(tf.errors.InvalidArgumentError, match="right-padded"):
        tf.function(lambda t: model(t))(tf.constant(x))
    with pytest.raises(tf.errors.InvalidArgumentError, match="right-padded"):
        tf.function(lambda t: fast(t))(tf.constant(x))
    right = random_inputs(model, 4, rng, padding="right")
    cudnn_calls.clear()
    assert _rel(tf.function(lambda t: fast(t))(tf.constant(right)), model(right)) <= 1e-5
    assert cudnn_calls, "the right-padded batch did not run the fused kernel"


@pytest.mark.parametrize(
    "kind, merge_mode",
    [("lstm", m) for m in ("concat", "sum", "mul", "ave", None)]
    + [(k, m) for k in ("gru", "rnn_tanh", "rnn_relu") for m in ("concat", None)],
)
def test_bidirectional_stack(kind, merge_mode, cudnn_calls):
    inp = keras.Input((30,), dtype="int32")
    x = L.Embedding(11, 16, mask_zero=True)(inp)
    for _ in range(2):
        x = L.Bidirectional(rnn_layer(kind, 32, return_sequences=True))(x)
    out = L.Bidirectional(rnn_layer(kind, 32, return_sequences=True, return_state=True), merge_mode=merge_mode)(x)
    model = keras.Model(inp, out)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(4))
    _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert cudnn_calls[-1] == {"levels_x_dirs": 6, "dtype": "float32", "direction": "bidirectional", "dropout": 0.0}


def _merged_bidirectional(kind, merge_mode, *, levels=3, units=32):
    """Embedding (right-padded mask) -> `levels` Bidirectional layers; all
    but the top merge by `merge_mode`, the top concatenates and returns its
    states."""
    # Random biases: no pre-activation sits exactly at ReLU's kink, where
    # TensorFlow's and cuDNN's derivatives differ (test_gpu_cudnn_op.py).
    layer = lambda **kw: rnn_layer(kind, units, bias_initializer="random_normal", **kw)  # noqa: E731
    inp = keras.Input((30,), dtype="int32")
    x = L.Embedding(11, 16, mask_zero=True)(inp)
    for _ in range(levels - 1):
        x = L.Bidirectional(layer(return_sequences=True), merge_mode=merge_mode)(x)
    out = L.Bidirectional(layer(return_sequences=True, return_state=True))(x)
    return keras.Model(inp, out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_bidirectional_sum_and_ave_below_the_top(kind, merge_mode, cudnn_calls):
    """A sum/ave Bidirectional inside the run; the level above
    reads cuDNN's [fwd, bwd] through its input kernel packed doubled."""
    model = _merged_bidirectional(kind, merge_mode)
    assert len(rnnfuse.analyze(model).groups) == 1 and rnnfuse.analyze(model).skipped == {}
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode)
    x = random_inputs(model, 8, np.random.default_rng(14), padding="right")
    out_err, grad_err = _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert fused.last_path == "fused"
    assert cudnn_calls[-1] == {"levels_x_dirs": 6, "dtype": "float32", "direction": "bidirectional", "dropout": 0.0}
    print(f"{kind} {merge_mode} inside: rel out {out_err:.2e} grad {grad_err:.2e}")


@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_bidirectional_sum_and_ave_mixed_float16(merge_mode, cudnn_calls):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _merged_bidirectional("lstm", merge_mode)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(15), padding="right")
    _compare(model, fast, x, out_tol=1e-2, grad_tol=1e-2)
    assert cudnn_calls[-1]["dtype"] == "float16" and cudnn_calls[-1]["levels_x_dirs"] == 6


@pytest.mark.real_gpu_only  # rnnfuse's op needs a real GPU
@pytest.mark.cudnn_op
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_bidirectional_sum_and_ave_below_the_top_through_the_op(kind, merge_mode, cudnn_calls):
    """The same through rnnfuse's own op (RnnfuseCudnnRnn, its params check
    and its backward)."""
    from rnnfuse.backends.tensorflow import op_build

    assert op_build.load_op() is not None, op_build.load_failure()
    model = _merged_bidirectional(kind, merge_mode)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(16), padding="right")
    _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}
    assert cudnn_calls == []  # not the CudnnRNNV3 fallback

    def step(t):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(tf.cast(o, tf.float32) ** 2) for o in keras.tree.flatten(fast(t)))
        return tape.gradient(loss, fast.trainable_variables)

    types = traced_op_types(step, tf.constant(x))
    assert {"RnnfuseCudnnRnn", "RnnfuseCudnnRnnBackprop"} <= types and "CudnnRNNV3" not in types


@pytest.mark.real_gpu_only  # projections run on rnnfuse's op only
@pytest.mark.cudnn_op
@pytest.mark.parametrize("merge_mode", ["sum", "ave"])
def test_projected_bidirectional_sum_and_ave_through_the_op(merge_mode):
    """Bidirectional(ProjectedLSTM) levels merged by sum/ave: the level above
    reads [fwd, bwd] (2P wide) through its kernel packed [s*W; s*W]."""
    from rnnfuse.layers import ProjectedLSTM

    inp = keras.Input((25, 12))
    x = inp
    for mode in (merge_mode, merge_mode, "concat"):
        x = L.Bidirectional(ProjectedLSTM(32, 8, return_sequences=True), merge_mode=mode)(x)
    model = keras.Model(inp, x)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    (fused,) = fused_layers(fast)
    assert fused.stack.input_merges == (None, merge_mode, merge_mode) and fused.stack.proj_size == 8
    x = random_inputs(model, 6, np.random.default_rng(18))
    _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert fused.last_path == "fused", fused.last_path
    assert kernels_ran(fast) == {"RnnfuseCudnnRnn"}


def test_bidirectional_sum_then_a_unidirectional_run_is_two_calls(cudnn_calls):
    inp = keras.Input((40, 16))
    x = inp
    for _ in range(2):
        x = L.Bidirectional(L.GRU(32, return_sequences=True), merge_mode="sum")(x)
    for _ in range(2):
        x = L.GRU(32, return_sequences=True)(x)
    model = keras.Model(inp, x)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    assert [f.stack.input_merges for f in fused_layers(fast)] == [(None, "sum"), (None, None)]
    _compare(model, fast, random_inputs(model, 8, np.random.default_rng(17)), out_tol=1e-5, grad_tol=1e-4)
    assert [(c["levels_x_dirs"], c["direction"]) for c in cudnn_calls[-2:]] == [
        (4, "bidirectional"), (2, "unidirectional")
    ]


@pytest.mark.parametrize("cell", [L.LSTMCell, L.GRUCell, L.SimpleRNNCell])
def test_rnn_cell_and_stacked_cells(cell, cudnn_calls):
    inp = keras.Input((40, 8))
    x = L.RNN(cell(32), return_sequences=True)(inp)
    out = L.RNN(L.StackedRNNCells([cell(32), cell(32)]), return_sequences=True)(x)
    model = keras.Model(inp, out)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(5))
    _compare(model, fast, x, out_tol=1e-5, grad_tol=1e-4)
    assert cudnn_calls[-1]["levels_x_dirs"] == 3


@pytest.mark.real_gpu_only  # the CPU emulator applies no dropout
def test_absorbed_dropout_is_cudnn_dropout_in_training(cudnn_calls):
    model = lstm_dropout_lstm(32, 0.5, 20, 8)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = random_inputs(model, 8, np.random.default_rng(6))
    assert _rel(fast(x), model(x)) <= 1e-5  # inference: exact
    trained = np.asarray(fast(x, training=True))
    assert cudnn_calls[-1]["dropout"] == 0.5
    assert _rel(trained, model(x)) > 1e-2  # dropout really applied


@pytest.mark.real_gpu_only
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_graph_has_one_cudnn_op_per_group(kind):
    model = stack_model(kind, 4, units=32, input_size=8, steps=16, last_return_sequences=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    x = tf.constant(random_inputs(model, 4, np.random.default_rng(7)))
    assert _cudnn_ops_in_graph(lambda t: model(t), x) == 4  # Keras: one per layer
    assert _cudnn_ops_in_graph(lambda t: fast(t), x) == 1  # fused: one call


def test_fit_with_fused_path(cudnn_calls):
    model = stack_model("lstm", 3, units=32, input_size=8, steps=20, head=True)
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    fast.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(8)
    x, y = random_inputs(model, 64, rng), rng.standard_normal((64, 3)).astype("float32")
    history = fast.fit(x, y, epochs=3, batch_size=16, verbose=0)
    assert cudnn_calls, "fit did not trace the fused op"
    assert history.history["loss"][-1] < history.history["loss"][0]
