"""bench/diag_first_fit.py on the CPU: one process's phases, each with its
seconds and profile, the optimize phase only for the optimized model."""

from __future__ import annotations

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import diag_first_fit  # noqa: E402


def test_each_model_records_its_phases_and_appends_one_line(tmp_path, capsys):
    out = tmp_path / "first_fit.json"
    for model in ("optimized", "original"):
        diag_first_fit.main(["--quick", "--model", model, "--epoch-steps", "1", "--top", "3",
                             "--out", str(out)])
    optimized, original = (json.loads(line) for line in out.read_text().splitlines())
    assert list(optimized["phases"]) == ["build", "optimize", "first_fit", "second_fit"]
    assert list(original["phases"]) == ["build", "first_fit", "second_fit"]
    for phase in (*optimized["phases"].values(), *original["phases"].values()):
        assert phase["seconds"] > 0 and "cumulative" in phase["profile"]
    assert "first-fit optimized lstm4x512" in capsys.readouterr().out
