"""Training through the fused cuDNN kernel on a GPU.

Run on a GPU (see tests/gpu/conftest.py); about a minute. With
RNNFUSE_REPORT_DIR set, each test writes its numbers there as JSON (loss
curves, epoch times) for the closing note.

- fit: an optimized 3-layer stack and a copy of the original with identical
  initial weights train 4 epochs on the same synthetic batches (float32, no
  TF32); the loss curves agree within float tolerance, and the fused
  CudnnRNNV3 provably ran (the backend's one call site is spied on, and the
  traced train step holds exactly one CudnnRNNV3 op per fused group).

Exports and saved files: test_gpu_export.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from gpu_report import report
from gpu_timing import EpochTimes

import rnnfuse
from rnnfuse.backends import tensorflow as tf_backend

STEPS, FEATURES, UNITS, LAYERS = 64, 32, 128, 3
BATCH, SAMPLES, EPOCHS = 64, 512, 4


def _stack(kind: str) -> keras.Model:
    layer = {
        "lstm": keras.layers.LSTM,
        "gru": keras.layers.GRU,
        "rnn_tanh": keras.layers.SimpleRNN,
    }[kind]
    inp = keras.Input((STEPS, FEATURES))
    x = inp
    for i in range(LAYERS):
        x = layer(UNITS, return_sequences=i < LAYERS - 1, name=f"{kind}_{i}")(x)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x))


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((SAMPLES, 4)).astype("float32")
    return x, y


def _cudnn_ops(graph) -> int:
    """CudnnRNNV3 ops in `graph` and in every function it calls."""
    count = sum(op.type == "CudnnRNNV3" for op in graph.get_operations())
    for fdef in graph.as_graph_def().library.function:
        count += sum(node.op == "CudnnRNNV3" for node in fdef.node_def)
    return count


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_fit_through_the_fused_kernel_tracks_the_original(kind, monkeypatch):
    import tensorflow as tf

    calls = []
    real = tf_backend.cudnn_rnn
    monkeypatch.setattr(tf_backend, "cudnn_rnn", lambda **kw: calls.append(1) or real(**kw))
    keras.utils.set_random_seed(0)
    model = _stack(kind)
    reference = _stack(kind)
    reference.set_weights(model.get_weights())
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)  # whatever the table says
    (fused,) = [l for l in fast.layers if isinstance(l, rnnfuse.FusedRNN)]
    assert fused.uses_fused_kernel and not fused.supports_jit
    for m in (fast, reference):
        m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
    x, y = _data()
    timers = {"fused": EpochTimes(), "original": EpochTimes()}
    got = fast.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                   callbacks=[timers["fused"]])
    want = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                         callbacks=[timers["original"]])
    assert calls, "the fused CudnnRNNV3 call site never ran (silent fallback)"
    assert fused.last_path == "fused"
    step = tf.function(lambda t: fast(t, training=True))
    graph = step.get_concrete_function(tf.TensorSpec((BATCH, STEPS, FEATURES))).graph
    assert _cudnn_ops(graph) == 1, "expected one CudnnRNNV3 op for the one fused group"
    weight_diff = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights())
    )
    report(f"fit_{kind}", {
        "loss_fused": got.history["loss"],
        "loss_original": want.history["loss"],
        "epoch_s_fused": timers["fused"].times,
        "epoch_s_original": timers["original"].times,
        "max_weight_diff": weight_diff,
    })
    assert got.history["loss"][-1] < got.history["loss"][0]  # it learned
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-3)
    assert weight_diff <= 1e-3


def test_jit_compile_on_a_gpu():
    model = _stack("rnn_tanh")
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)  # whatever the table says
    fast.compile(optimizer="adam", loss="mse", jit_compile="auto")
    assert fast.jit_compile is False  # Keras keeps the cuDNN model out of XLA
    with pytest.raises(ValueError, match="XLA cannot compile cuDNN"):
        fast.compile(optimizer="adam", loss="mse", jit_compile=True)
