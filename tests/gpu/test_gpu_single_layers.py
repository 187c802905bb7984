"""Lone LSTM/GRU layers and encoder-decoder links on rnnfuse's cuDNN op
(TensorFlow, a real GPU).

- every model of tests/single_layer_checks.py (a lone LSTM/GRU, uni- and
  bidirectional, with returned states; a seq2seq whose decoder starts from
  the encoder's states, LSTM and GRU; a forecaster of three unstacked
  LSTMs; a lone GRU under a right-padded mask), each group of one forced
  fused: float32 outputs, states and the gradient of every variable
  against Keras' own per-layer cuDNN path (TF32 off: tests/gpu/conftest.py);
- a lone LSTM/GRU in mixed_float16 on cuDNN's persistent algorithm, which
  rnnfuse's op runs in both passes, against a float64 twin;
- `fit` with first-batch tuning on a single LSTM: it keeps the fastest
  candidate (or Keras' layer within the tuner's margin), and when a fused
  plan wins the op runs;
- proof that the op ran, for every group: the traced train step holds one
  RnnfuseCudnnRnn (and RnnfuseCudnnRnnBackprop) per group and no
  CudnnRNNV3, every FusedRNN's last path is "fused", and its `kernel`
  names the op, so a silent fallback to CudnnRNNV3 or to the original
  layers fails.

Run on the GPU machine (TensorFlow staged):

    python -m pytest -q -s tests/gpu/test_gpu_single_layers.py

With RNNFUSE_REPORT_DIR set, the errors and the tuner's decisions are
written to single_layers_gpu.json there.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

import rnnfuse
from builders import fused_layers
from single_layer_checks import MODELS, _loss, assert_fused_matches, build, inputs
from rnnfuse.plan import FUSED, Plan
from rnnfuse.reasons import KernelRun

pytestmark = [pytest.mark.gpu, pytest.mark.cudnn_op]

if os.environ.get("RNNFUSE_GPU_DRYRUN"):
    pytest.skip("rnnfuse's op needs a real GPU", allow_module_level=True)
if keras.backend.backend() != "tensorflow":
    pytest.skip("rnnfuse's cuDNN op is TensorFlow's", allow_module_level=True)

import tensorflow as tf  # noqa: E402


L = keras.layers
REPORT: dict = {}


def teardown_module(module):
    out = os.environ.get("RNNFUSE_REPORT_DIR")
    if out:
        with open(os.path.join(out, "single_layers_gpu.json"), "w") as f:
            json.dump(REPORT, f, indent=1, sort_keys=True, default=str)


def _op_counts(fast, x) -> dict[str, int]:
    """How many nodes of each cuDNN op the traced train step of `fast`
    holds (its cond branches and gradient functions included)."""

    def step(*xs):
        with tf.GradientTape() as tape:
            loss = _loss(fast(list(xs) if len(xs) > 1 else xs[0], training=True))
        return tape.gradient(loss, fast.trainable_variables)

    xs = x if isinstance(x, list) else [x]
    graph = tf.function(step).get_concrete_function(*[tf.convert_to_tensor(t) for t in xs]).graph
    types = [op.type for op in graph.get_operations()]
    for f in graph.as_graph_def().library.function:
        types += [n.op for n in f.node_def]
    names = ("RnnfuseCudnnRnn", "RnnfuseCudnnRnnBackprop", "CudnnRNNV3")
    return {name: types.count(name) for name in names}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_groups_of_one_run_the_op_and_match_keras(name):
    model = build(name)
    fast = rnnfuse.optimize(model, plan=FUSED)
    groups = len(MODELS[name][1])
    assert len(fused_layers(fast)) == groups
    assert_fused_matches(model, fast, tol=1e-5, grad_tol=1e-4, rtol=1e-5, batch=8)
    counts = _op_counts(fast, inputs(model, 8))
    REPORT[f"ops {name}"] = counts
    assert counts["RnnfuseCudnnRnn"] >= groups and counts["RnnfuseCudnnRnnBackprop"] >= groups, counts
    assert counts["CudnnRNNV3"] == 0, counts
    assert all(f.last_path.kernel.name == "RnnfuseCudnnRnn" for f in fused_layers(fast))


def _twin_models(kind: str, policy: str):
    def make(dtype_policy):
        keras.config.set_dtype_policy(dtype_policy)
        keras.utils.set_random_seed(3)
        inp = keras.Input((40, 32))
        out, *states = (L.LSTM if kind == "lstm" else L.GRU)(128, return_sequences=True, return_state=True)(inp)
        model = keras.Model(inp, [out, *states])
        keras.config.set_dtype_policy("float32")
        return model

    model, twin = make(policy), make("float64")
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    return model, twin


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_single_layer_runs_the_persistent_algorithm_in_both_passes(kind):
    from single_layer_checks import outputs_and_gradients

    model, twin = _twin_models(kind, "mixed_float16")
    name = "persistent_static+tc"
    fast = rnnfuse.optimize(model, plan=Plan((1,), name))
    x = np.random.default_rng(4).standard_normal((16, 40, 32)).astype("float32")
    try:
        got, ggot = outputs_and_gradients(fast, x, model.trainable_variables)
    except tf.errors.OpError as err:  # cuDNN refused: an op error, not an abort
        pytest.fail(f"cuDNN refused {name} for one {kind} layer: {err.message[:300]}")
    (layer,) = fused_layers(fast)
    assert layer.last_path == "fused"
    assert layer.last_path.kernel == KernelRun("RnnfuseCudnnRnn", name, None)
    want, gwant = outputs_and_gradients(twin, x.astype("float64"), twin.trainable_variables)
    err = max(_rel(g, w) for g, w in zip(got, want))
    gerr = max(_rel(g, w) for g, w in zip(ggot, gwant))
    REPORT[f"{name} {kind} fp16 vs f64"] = [err, gerr]
    assert err <= 2e-2 and gerr <= 2e-1, (err, gerr)
    counts = _op_counts(fast, x)
    assert counts["RnnfuseCudnnRnnBackprop"] >= 1 and counts["CudnnRNNV3"] == 0, counts


def test_fit_tunes_a_single_lstm_on_its_first_batch(tmp_path):
    """Through `fit`, as a user runs it: the tuner times Keras' layer
    against the fused call on each algorithm and keeps the fastest, or
    Keras' layer where nothing beats it by the tuner's margin."""
    from rnnfuse.tuning.cache import PlanCache
    from rnnfuse.tuning.tuner import KEEP_ORIGINAL_MARGIN

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((200, 64)), L.LSTM(256), L.Dense(1, dtype="float32")])
    keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, cache=PlanCache(tmp_path / "plans.json"))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((128, 200, 64)).astype("float32")
    y = rng.standard_normal((128, 1)).astype("float32")
    fast.compile(optimizer="adam", loss="mse")
    history = fast.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    (record,) = rnnfuse.tuning.first_batch.decisions(fast)
    REPORT["fit decision"] = record
    print(json.dumps(record, indent=1))
    timings = record["timings_ms"]
    assert set(timings) >= {"per-layer", "fused"}
    best = min(timings.values())
    if record["chosen"] == "per-layer":
        assert best >= (1 - KEEP_ORIGINAL_MARGIN) * timings["per-layer"], timings
    else:
        assert timings[record["chosen"]] == best, timings
        (layer,) = fused_layers(fast)
        assert layer.last_path == "fused"
        assert layer.last_path.kernel.name == "RnnfuseCudnnRnn"
