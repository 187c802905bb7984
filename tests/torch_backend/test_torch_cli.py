"""`rnnfuse check` under torch: outputs and gradients from the torch
backend object, not a second backend split in the CLI."""

from __future__ import annotations

import json

import keras

from rnnfuse import cli


def test_check_runs_under_torch(tmp_path, capsys):
    model = keras.Sequential(
        [keras.Input((6, 3)), keras.layers.GRU(4, return_sequences=True), keras.layers.GRU(4)]
    )
    path = tmp_path / "m.keras"
    model.save(path)
    code = cli.main(["check", str(path), "--batch", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] and "PyTorch" in out["device"]
    assert len(out["groups"]) == 1 and all(p == "fused" for p in out["fused_paths"].values())
