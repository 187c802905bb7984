"""`rnnfuse bench` and `check` under JAX: timing and gradients come from
the JAX backend object."""

from __future__ import annotations

import json

import keras

from builders import saved_stack
from rnnfuse import cli


def test_check_runs_under_jax(tmp_path, capsys):
    code = cli.main(["check", str(saved_stack(tmp_path)), "--batch", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"]
    assert "JAX" in out["device"]


def test_bench_runs_under_jax(tmp_path, capsys):
    code = cli.main(
        ["bench", str(saved_stack(tmp_path)), "--batch", "2", "--repeats", "2", "--warmup", "1", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["optimized_ms"]) == 2


def test_check_of_a_model_with_nothing_to_fuse_says_what_pass_means(tmp_path, capsys):
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.Dense(2)])
    path = tmp_path / "dense.keras"
    model.save(path)
    code = cli.main(["check", str(path), "--batch", "2"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "0 fusion group(s)" in out
    assert "note: nothing fuses in this model, so this compared the model against itself" in out
    assert out.endswith("PASS: both within the tolerance 0.0001 (original layers against themselves)")
