"""Online tuning's algorithm-only candidates on a real GPU (TensorFlow with
rnnfuse's op): one traced train step serves every cuDNN algorithm the race
tries, the op receives each step's algorithm at run time, and each
algorithm's outputs and gradients match the original layers.

Run on the GPU machine:

    python -m pytest -q -s tests/gpu/test_gpu_online_algorithm.py
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, max_abs_diff, stack_model
from rnnfuse.backends import get_backend
from rnnfuse.backends import tensorflow as tf_backend
from rnnfuse.backends.tensorflow import cudnn_op
from rnnfuse.plan import Algorithm, Plan
from rnnfuse.tuning import first_batch

pytestmark = [pytest.mark.gpu, pytest.mark.cudnn_op]  # the race's algorithms are the op's

if os.environ.get("RNNFUSE_GPU_DRYRUN"):
    pytest.skip("rnnfuse's op needs a real GPU", allow_module_level=True)

ALGORITHMS = [None, "persistent_static+tc", "persistent_dynamic+tc"]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _codes_at_run_time(monkeypatch) -> list:
    """The `algorithm` input each op call received when its step ran."""
    seen, real = [], cudnn_op.call_op

    def spy(module, **kw):
        tf.py_function(lambda code: seen.append(int(code)) or 0, [kw["algorithm"]], tf.int32)
        return real(module, **kw)

    monkeypatch.setattr(cudnn_op, "call_op", spy)
    return seen


def test_the_online_race_runs_every_algorithm_on_one_traced_step(monkeypatch):
    assert tf_backend.op_loaded(), "rnnfuse's op is not loaded"
    model = stack_model("lstm", 3, units=64, input_size=16, steps=30, last_return_sequences=True)
    fast = rnnfuse.optimize(model, cache=False)
    state = fast._rnnfuse_autotune
    state.online = True
    winner = "fused @persistent_dynamic+tc"
    ran, made = [], []
    # Ranked seconds (not this GPU's): the test is about traces, not speed.
    state.measure_step = lambda name, run: (ran.append(name) or run(),
                                            0.5 if name == winner else 1.0 + len(name) / 100)
    state.check_gradients = lambda *args: 0.0
    make = fast._train_function_now
    monkeypatch.setattr(fast, "_train_function_now", lambda: made.append(1) or make())
    seen = _codes_at_run_time(monkeypatch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 30, 16)).astype("float32")
    y = rng.standard_normal((256, 30, 64)).astype("float32")
    fast.compile(optimizer="adam", loss="mse")
    fast.fit(x, y, batch_size=16, epochs=3, verbose=0)  # 48 steps
    by_name = {f"fused @{a}" if a else "fused": a for a in ALGORITHMS}
    assert set(by_name) <= set(ran), ran
    # The original layers' step and one step for every cuDNN plan of the run.
    assert len(made) == 2, (len(made), sorted(set(ran)))
    code = {n: cudnn_op.algorithm_code(None if a is None else Algorithm.parse(a), "float32")
            for n, a in by_name.items()}
    raced = [code[n] for n in ran if n in code]
    # Each race step's algorithm reached the op; then the winner's, to the fit's end.
    assert seen[: len(raced)] == raced and len(set(raced)) == 3
    assert set(seen[len(raced):]) == {code[winner]}
    (layer,) = fused_layers(fast)
    assert layer.plan.name == winner and layer.algorithm_input is None
    print("online race", len(ran), "race steps,", len(made), "traced steps, codes", sorted(set(raced)))
    assert max_abs_diff(fast.predict(x[:32], verbose=0), model.predict(x[:32], verbose=0)) <= 1e-4


@pytest.mark.parametrize("policy,tol", [("float32", 1e-5), ("mixed_float16", 2e-2)])
def test_each_algorithm_through_the_runtime_input_matches_the_original_layers(policy, tol):
    keras.config.set_dtype_policy(policy)
    try:
        model = stack_model("gru", 3, units=64, input_size=16, steps=30, last_return_sequences=True)
    finally:
        keras.config.set_dtype_policy("float32")
    fast = rnnfuse.optimize(model, plan=Plan((3,)), tune=False)
    (layer,) = fused_layers(fast)
    chosen = get_backend().algorithm_input()
    assert chosen is not None, "the TensorFlow backend takes no runtime algorithm"
    object.__setattr__(layer, "algorithm_input", chosen)
    x = tf.random.stateless_normal((16, 30, 16), seed=(3, 4))
    variables = model.trainable_variables

    def outputs_and_grads(run):
        with tf.GradientTape() as tape:
            y = tf.cast(run(x), tf.float32)
            loss = tf.reduce_sum(y * y) + tf.reduce_sum(y)
        return [y] + tape.gradient(loss, variables)

    shared = tf.function(lambda: outputs_and_grads(lambda t: fast(t, training=True)))
    original = tf.function(lambda: outputs_and_grads(lambda t: model(t, training=True)))
    want = [np.asarray(t) for t in original()]
    errors = {}
    for a in ALGORITHMS:
        chosen.set(None if a is None else Algorithm.parse(a), layer.compute_dtype)
        got = [np.asarray(t) for t in shared()]
        assert (layer.last_path.kernel.name, layer.last_path.kernel.algorithm) == (
            "RnnfuseCudnnRnn", "runtime")
        errors[str(a)] = (_rel(got[0], want[0]), max(_rel(g, w) for g, w in zip(got[1:], want[1:])))
    print("runtime algorithm vs original layers", policy, errors)
    assert shared.experimental_get_tracing_count() == 1
    assert all(e <= tol and ge <= 10 * tol for e, ge in errors.values()), errors
