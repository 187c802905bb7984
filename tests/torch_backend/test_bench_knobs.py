"""The knobs benchmark's own logic (bench/bench_knobs.py) on the CPU with a
tiny shape and a fake clock: every setting is recorded per model, a
setting Keras refuses is recorded as not available (the optimized model
then not built), and the table reads the optimized model's best setting
against the PyTorch loop, with what was not available or failed below."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_knobs  # noqa: E402
from fake_clock import FakeClock, FakeTimer  # noqa: E402


def test_a_run_records_each_setting_and_the_table_reads_it(tmp_path, monkeypatch):
    import rnnfuse

    monkeypatch.setattr(bench_knobs, "clock", FakeClock(tick=0.008))  # 2 steps: 4 ms a step
    optimized = []
    real_optimize = rnnfuse.optimize
    monkeypatch.setattr(rnnfuse, "optimize",
                        lambda *a, **k: optimized.append(1) or real_optimize(*a, **k))
    out = tmp_path / "knobs.json"
    assert bench_knobs.main(["--quick", "--shapes", "gru3x64", "--spe", "1,2", "--jit", "auto",
                             "--steps", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["meta"]["backend"] == "torch"
    (row,) = run["results"]
    one, two = row["settings"]
    assert (one["spe"], one["jit"], two["spe"]) == (1, "auto", 2)
    assert one["ms"] == {"original": pytest.approx(4.0), "optimized": pytest.approx(4.0)}
    # Keras' torch trainer takes one step an execution: not available, the
    # optimized model not built for it.
    refused = {"not_available": "not available on torch: `steps_per_execution` must be 1 with "
                                "the PyTorch backend. Received: steps_per_execution=2"}
    assert two["ms"] == {"original": refused, "optimized": refused}
    assert len(optimized) == 1
    peer = tmp_path / "pt.json"
    peer.write_text(json.dumps({"meta": {"backend": "pytorch"},
                                "results": [{"shape_name": "gru3x64", "fit_ms": {"pytorch": 2.0}}]}))
    lines = bench_knobs.table([str(out)], str(peer)).splitlines()
    assert lines[0] == "| shape | torch | PyTorch loop |"
    assert lines[2] == ("| gru3x64 | 4.00 ms (steps_per_execution=1, jit_compile=auto, "
                        "2.00x the loop; Keras' model at best 4.00) | 2.00 ms |")
    assert lines[3:] == ["", "- torch, both models, on every shape: steps_per_execution=2, "
                             "jit_compile=auto: not available on torch: `steps_per_execution` "
                             "must be 1 with the PyTorch backend."]


def test_tuned_times_the_candidates_first_and_records_the_plans_run(tmp_path, monkeypatch,
                                                                    fake_clock):
    import rnnfuse
    from rnnfuse.tuning import tuner

    monkeypatch.setattr(bench_knobs, "clock", FakeClock(tick=0.008))  # 2 steps: 4 ms a step
    # The tuner times real CPU steps: pinned medians (and `fake_clock` for
    # the first calls), else a noisy run keeps Keras' layers and nothing fuses.
    timer = FakeTimer({"fused": 0.5})
    monkeypatch.setattr(tuner, "interleaved_medians", lambda steps, **kw: timer(steps))
    tunes = []
    real_optimize = rnnfuse.optimize
    monkeypatch.setattr(rnnfuse, "optimize",
                        lambda model, **k: tunes.append(k["tune"]) or real_optimize(model, **k))
    out = tmp_path / "knobs.json"
    assert bench_knobs.main(["--quick", "--tuned", "--shapes", "gru3x64", "--spe", "1",
                             "--jit", "auto", "--steps", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    (setting,) = run["results"][0]["settings"]
    assert run["meta"]["tuned"] is True and not isinstance(tunes[0], str)  # a batch, not "auto"
    assert timer.names == [["fused", "per-layer", "split 1+1"]]
    assert setting["plans"] == ["fused"]
    assert set(setting["ms"]) == {"original", "optimized"}


def test_the_table_lists_refusals_and_failures_apart_from_the_times(tmp_path):
    xla = "ValueError: jit_compile=True: model 'm' runs ... and XLA cannot compile cuDNN ops (nor"
    settings = [
        {"spe": 1, "jit": "auto", "ms": {"original": 5.0, "optimized": 3.0}},
        # An earlier run's error text for rnnfuse's refusal; a fit that failed.
        {"spe": 1, "jit": True, "ms": {"original": 4.0, "optimized": xla}},
        {"spe": 8, "jit": True, "ms": {"original": "RuntimeError: out of memory",
                                       "optimized": {"not_available": bench_knobs.XLA_REFUSAL}}},
    ]
    run = tmp_path / "tf.json"
    run.write_text(json.dumps({"meta": {"backend": "tensorflow"},
                               "results": [{"shape_name": "gru3x64", "settings": settings}]}))
    lines = bench_knobs.table([str(run)], None).splitlines()
    assert lines[2] == ("| gru3x64 | 3.00 ms (steps_per_execution=1, jit_compile=auto; "
                        "Keras' model at best 4.00) | - |")
    assert lines[4:] == [
        "- tensorflow, the optimized model, on every shape: steps_per_execution=1, "
        "jit_compile=True; steps_per_execution=8, jit_compile=True: "
        "not available (cuDNN ops do not compile under XLA)",
        "- tensorflow, Keras' model, on every shape: steps_per_execution=8, jit_compile=True: "
        "failed: RuntimeError: out of memory",
    ]


def test_a_bad_setting_is_named_with_the_fix(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_knobs.main(["--jit", "maybe", "--out", "x.json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--jit auto, true or false" in err and "--jit 'maybe'" in err


def test_the_examples_hold():
    import doctest

    result = doctest.testmod(bench_knobs)
    assert result.attempted > 0 and result.failed == 0
