"""The command line on a GPU: `check` passes through the real fused kernel,
`bench` reports the GPU and times the fused call (skipped without a GPU).

Run with the rest of tests/gpu (see conftest.py). What to look for: every
test passes; `fused_paths` are all "fused" (a silent fallback to the
original layers fails the tests); the printed diffs are small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import pytest

from rnnfuse import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stack(path, *, masked=False, kind="lstm", bidirectional=False):
    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[kind]
    if masked:
        inp = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(50, 16, mask_zero=True)(inp)
    else:
        inp = keras.Input((None, 16), name="x")
        x = inp
    for i in range(3):
        rnn = layer(32, return_sequences=i < 2)
        x = (keras.layers.Bidirectional(rnn) if bidirectional else rnn)(x)
    model = keras.Model(inp, keras.layers.Dense(4)(x))
    model.save(path)
    return str(path)


def _json(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else out), err


@pytest.mark.parametrize(
    "options",
    [
        dict(kind="lstm"),
        dict(kind="gru"),
        dict(kind="lstm", bidirectional=True),
        dict(kind="gru", masked=True),
    ],
    ids=["lstm", "gru", "bilstm", "gru-masked"],
)
def test_check_passes_through_the_fused_kernel(tmp_path, capsys, options):
    path = _stack(tmp_path / "m.keras", **options)
    code, result, err = _json(capsys, "check", path, "--plan", "fused", "--steps", "20", "--batch", "8", "--json")
    assert code == 0, (result, err)
    assert result["device"].startswith("GPU")
    assert set(result["fused_paths"].values()) == {"fused"}, result["fused_paths"]
    assert result["caveat"] is None
    assert result["passed"], result


def test_check_mixed_precision(tmp_path, capsys):
    path = _stack(tmp_path / "m.keras")
    code, result, err = _json(
        capsys, "check", path, "--plan", "fused", "--mixed-precision", "--steps", "20", "--json"
    )
    assert code == 0, (result, err)
    assert result["compute_dtype"] == "float16"
    assert set(result["fused_paths"].values()) == {"fused"}
    assert result["tolerance"] == cli.check.DEFAULT_TOLERANCE["float16"]


def test_bench_times_the_fused_call(tmp_path, capsys):
    path = _stack(tmp_path / "m.keras")
    code, result, err = _json(
        capsys, "bench", path, "--plan", "fused", "--batch", "16", "--steps", "50",
        "--repeats", "5", "--train", "--json",
    )
    assert code == 0, err
    assert result["gpu"] is True and result["device"].startswith("GPU")
    assert set(result["fused_paths"].values()) == {"fused"}
    assert result["caveat"] is None
    assert result["speedup"] > 0
    print(result["device"], f"speedup {result['speedup']:.2f}x")


def test_demo_example_on_gpu():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "text_classifier.py"), "--quick"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout
    assert "timing on GPU" in run.stdout
    # Where optimize() fused the run, the fused kernel ran: the only
    # per-layer path allowed is the tuner's recorded choice, never a fallback.
    per_layer = [line for line in run.stdout.splitlines() if "layers: " in line]
    assert all(line.endswith("layers: the plan keeps the original layers") for line in per_layer), run.stdout
