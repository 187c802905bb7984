"""`rnnfuse check` under torch: outputs and gradients from the torch
backend object, not a second backend split in the CLI."""

from __future__ import annotations

import json

import keras

from builders import saved_stack
from rnnfuse import cli


def test_check_runs_under_torch(tmp_path, capsys):
    code = cli.main(["check", str(saved_stack(tmp_path, keras.layers.GRU)), "--batch", "2",
                     "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] and "PyTorch" in out["device"]
    assert len(out["groups"]) == 1 and all(p == "fused" for p in out["fused_paths"].values())


def test_inspect_says_each_group_runs_fused_here(tmp_path, capsys):
    code = cli.main(["inspect", str(saved_stack(tmp_path, keras.layers.GRU)), "-q"])
    assert code == 0
    assert capsys.readouterr().out.strip() == (
        "1 group(s) of 2 layer(s) can fuse; here (torch) each runs fused; "
        "0 other recurrent layer(s) cannot fuse."
    )


def test_bench_on_a_cpu_says_how_to_steady_torchs_timings(tmp_path, capsys, monkeypatch):
    argv = ["bench", str(saved_stack(tmp_path, keras.layers.GRU)), "--batch", "2", "--repeats", "1", "--warmup", "1", "--json"]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main(argv) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("Set OMP_WAIT_POLICY=PASSIVE" in n for n in notes), notes
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cli.main(argv) == 0
    assert not any("OMP_WAIT_POLICY" in n for n in json.loads(capsys.readouterr().out)["notes"])


def test_the_omp_note_does_not_depend_on_tensorflow_being_loaded(monkeypatch):
    import sys

    from rnnfuse.backends.torch.backend import TorchTooling

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    (note,) = TorchTooling().timing_notes(on_gpu=False)
    assert "OMP_WAIT_POLICY=PASSIVE" in note
    assert TorchTooling().timing_notes(on_gpu=True) == []
