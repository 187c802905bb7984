"""The examples: `make demo`'s script runs, and every example's model fuses.

`examples/text_classifier.py --quick` runs as a subprocess (what a user
sees); the three example models are also built here and compared, original
against optimized, through the emulated cuDNN op (see conftest.py), so the
fused path runs for them on the CPU.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import rnnfuse

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture(scope="module")
def examples_path():
    sys.path.insert(0, EXAMPLES)
    yield
    sys.path.remove(EXAMPLES)


def _example(name):
    return importlib.import_module(name)


def test_text_classifier_script_runs(examples_path):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "text_classifier.py"), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = rnnfuse.analyze(_example("text_classifier").build_model())
    assert report.groups
    flat = " ".join(run.stdout.split())
    for group in report.groups:
        assert " -> ".join(group.layers) in flat
    assert "PASS" in run.stdout and "FAIL" not in run.stdout
    assert "speedup" in run.stdout


@pytest.mark.parametrize(
    "name, cell, levels, bidirectional",
    [
        ("text_classifier", "lstm", 3, False),
        ("speech_encoder", "lstm", 3, True),
        ("forecaster", "gru", 3, False),
    ],
)
def test_example_models_fuse_and_match(examples_path, emulated_cudnn, name, cell, levels, bidirectional):
    module = _example(name)
    model = module.build_model()
    report = rnnfuse.analyze(model)
    assert not report.skipped, dict(report.skipped)
    (group,) = report.groups
    assert (group.cell, group.num_layers, group.bidirectional) == (cell, levels, bidirectional)
    fast = rnnfuse.optimize(model)
    rng = np.random.default_rng(0)
    if name == "text_classifier":
        x = module.padded_batch(rng)
    elif name == "speech_encoder":
        x = rng.standard_normal((2, 16, module.MELS)).astype("float32")
    else:
        x = module.sine_windows(rng)[0]
    expected = keras.ops.convert_to_numpy(model(x))
    actual = keras.ops.convert_to_numpy(fast(x))
    assert emulated_cudnn, "the fused path did not run"
    np.testing.assert_allclose(actual, expected, atol=1e-5)
