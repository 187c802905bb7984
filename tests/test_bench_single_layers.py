"""bench/bench_single_layers.py's own logic on the CPU, with its --quick
(tiny) models: the rows the lead reads the issue-28 targets from."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_single_layers  # noqa: E402


def test_a_seq2seq_cell_times_both_models_interleaved_as_groups_of_one():
    cell = dict(bench_single_layers.CELLS["seq2seq"], **bench_single_layers.QUICK)
    row = bench_single_layers.measure(cell, rounds=2, steps=3)
    assert len(row["groups"]) == 2 and all(len(g) == 1 for g in row["groups"])
    assert {k: len(v) for k, v in row["raw"].items()} == {"original": 2, "optimized": 2}
    assert row["fit_speedup"] == pytest.approx(row["fit_ms"]["original"] / row["fit_ms"]["optimized"])
    json.dumps(row)


def test_the_forecaster_has_three_unstacked_lstms_and_unknown_cells_are_refused(capsys):
    model = bench_single_layers.build(dict(bench_single_layers.CELLS["forecaster"], **bench_single_layers.QUICK))
    import rnnfuse

    assert [len(g.layers) for g in rnnfuse.analyze(model).groups] == [1, 1, 1]
    with pytest.raises(SystemExit):
        bench_single_layers.main(["--out", os.devnull, "--cells", "single_lstm,nope"])
    assert "unknown nope" in capsys.readouterr().err
