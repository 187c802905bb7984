"""Online tuning's algorithm-only candidates under TensorFlow on the CPU:
plans that differ only in cuDNN's algorithm share one traced train step,
whose op reads the algorithm at run time from a host variable the race
assigns. rnnfuse's op is emulated (conftest's `emulated_op`), the device
faked, and each step's seconds come from a fake clock."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import rnnfuse
from builders import fused_layers, max_abs_diff, race_online, stack_model
from rnnfuse.plan import PER_LAYER, Plan
from rnnfuse.backends.tensorflow import cudnn_op
from rnnfuse.tuning import first_batch, online, tuner

ENV = {"device": "FakeGPU", "tensorflow": "2.21.0", "cudnn": "9", "backend": "tensorflow",
       "rnnfuse": "0.1.0"}
STATIC, DYNAMIC = Plan((3,), "persistent_static"), Plan((3,), "persistent_dynamic")
CANDIDATES = [PER_LAYER, Plan((3,)), STATIC, DYNAMIC]
MEDIANS = {"per-layer": 3.0, "fused": 2.0, STATIC.name: 1.0, DYNAMIC.name: 1.5}


@pytest.fixture
def racing(monkeypatch, emulated_op):
    """(model, optimized model, the names each step ran, the algorithm codes
    the op received at run time, how many train functions were made)."""
    monkeypatch.setattr(first_batch, "device_environment", lambda: dict(ENV))
    monkeypatch.setattr(first_batch, "candidates_for",
                        lambda backend: lambda group: list(CANDIDATES))

    def no_offline_timing(*args, **kwargs):
        raise AssertionError("timed apart from the fit")

    monkeypatch.setattr(tuner, "_steps", no_offline_timing)
    seen = []
    emulated = cudnn_op.call_op

    def spy(module, **kw):
        # Runs with the step (a stateful op in the traced function): the value, not the trace's.
        tf.py_function(lambda code: seen.append(int(code)) or 0, [kw["algorithm"]], tf.int32)
        return emulated(module, **kw)

    monkeypatch.setattr(cudnn_op, "call_op", spy)
    model = stack_model("gru", 3, units=6, steps=3, last_return_sequences=True)
    fast = rnnfuse.optimize(model, cache=False)
    ran, made = [], []
    race_online(fast, MEDIANS, ran)
    make = fast._train_function_now
    monkeypatch.setattr(fast, "_train_function_now", lambda: made.append(1) or make())
    return model, fast, ran, seen, made


def _fit(fast, model, epochs=3):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 5)).astype("float32")
    y = rng.standard_normal((16, 3, 6)).astype("float32")
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=2, epochs=epochs, verbose=0)  # 8 steps an epoch
    return x


def code(plan):
    return cudnn_op.algorithm_code(plan.cudnn_algorithm, "float32")


def test_algorithm_only_candidates_share_one_traced_step(racing, emulated_op):
    model, fast, ran, seen, made = racing
    x = _fit(fast, model)
    assert set(ran) == set(MEDIANS), "every candidate ran real steps"
    # Two traced steps: the original layers', and one for the three cuDNN plans.
    assert len(made) == 2
    fused_traces = [c for c in emulated_op if c["rnn_mode"] == "gru"]
    assert len(fused_traces) == 1
    assert tf.get_static_value(fused_traces[0]["algorithm"]) is None, "a runtime input"
    (layer,) = fused_layers(fast)
    assert layer.plan == STATIC and layer.algorithm_input is None
    (record,) = first_batch.decisions(fast)
    assert record["chosen"] == STATIC.name
    assert max_abs_diff(fast.predict(x, verbose=0), model.predict(x, verbose=0)) <= 2e-5


def test_each_step_hands_its_candidates_algorithm_to_the_op(racing):
    model, fast, ran, seen, made = racing
    _fit(fast, model)
    by_name = {p.name: p for p in CANDIDATES}
    raced = [code(by_name[n]) for n in ran if n != "per-layer"]
    assert len(set(raced)) == 3, "the three algorithms ran"
    # The race's cuDNN steps, in order, then the committed algorithm for the rest of the fit.
    assert seen[: len(raced)] == raced
    later = seen[len(raced):]
    assert later and set(later) == {code(STATIC)}
    assert not isinstance(fast.train_function, online.OnlineFit)


def test_a_step_traced_after_the_race_takes_the_plan_as_a_constant(racing, emulated_op):
    model, fast, ran, seen, made = racing
    x = _fit(fast, model)
    fast.train_function = None  # as a retrace does
    before = len(emulated_op)
    fast.train_on_batch(x[:2], x[:2, :, :1].repeat(6, axis=-1))
    (call,) = emulated_op[before:]
    assert tf.get_static_value(call["algorithm"]) == code(STATIC)


def test_without_a_runtime_algorithm_each_candidate_traces_its_own_step(racing, monkeypatch):
    from rnnfuse.backends.tensorflow.backend import TensorFlowBackend

    monkeypatch.setattr(TensorFlowBackend, "algorithm_input", lambda self: None)
    model, fast, ran, seen, made = racing
    _fit(fast, model)
    assert len(made) == len(CANDIDATES)
    assert first_batch.decisions(fast)[0]["chosen"] == STATIC.name
