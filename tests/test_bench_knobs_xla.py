"""bench/bench_knobs.py on TensorFlow: `jit_compile=True` refused by an
optimized model that runs a cuDNN kernel (emulated on the CPU) is recorded
as not available for that reason; Keras' own model takes it."""

from __future__ import annotations

import os
import sys

import rnnfuse
from builders import stack_model

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_knobs  # noqa: E402


def test_xla_refused_for_a_cudnn_plan_is_not_available_and_keras_model_takes_it(emulated_cudnn):
    model = stack_model("rnn_tanh", 2, head=True)
    fast = rnnfuse.optimize(model)
    assert bench_knobs.refusal(fast, (1, True)) == {
        "not_available": "not available (cuDNN ops do not compile under XLA)"}
    assert bench_knobs.refusal(model, (1, True)) is None
    assert bench_knobs.refusal(fast, (1, "auto")) is None
