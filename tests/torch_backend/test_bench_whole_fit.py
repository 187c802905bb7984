"""The whole-fit and small-profile benchmarks' own logic on the CPU with
tiny shapes (bench/bench_whole_fit.py, bench/profile_small.py): a quick
run writes one row per fresh process and a summary per shape and epoch
count; their helpers' examples hold."""

from __future__ import annotations

import doctest
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_whole_fit  # noqa: E402
import profile_small  # noqa: E402


def test_the_examples_hold():
    for module in (bench_whole_fit, profile_small):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_a_quick_run_times_each_model_in_its_own_process_with_an_empty_cache(tmp_path):
    out = tmp_path / "whole.json"
    assert bench_whole_fit.main(["--quick", "--shapes", "lstm2x40", "--epochs", "1,2", "--pairs", "1",
                                 "--epoch-steps", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    rows = run["results"]
    # Forked from the fork server, though this test session has run torch's
    # OpenMP pool (a child forked from it would hang).
    assert run["meta"]["start"] == "fork"
    assert [(r["epochs"], r["model"]) for r in rows] == [
        (1, "original"), (1, "optimized"), (2, "optimized"), (2, "original")]
    assert all("error" not in r and r["fit_s"] > 0 and r["process_s"] >= r["fit_s"] for r in rows)
    # Each child saw its own epochs end, and a fresh, empty plan cache.
    assert [len(r["epoch_end_s"]) for r in rows] == [1, 1, 2, 2]
    assert all(d["source"] != "cache" for r in rows for d in r.get("decisions", []))
    assert {(s["shape_name"], s["epochs"], s["pairs"]) for s in run["summary"]} == {
        ("lstm2x40", 1, 1), ("lstm2x40", 2, 1)}
    # ... and the parent's built libraries, shared, not a compiler run each.
    from rnnfuse.backends.cuda import build

    assert {r["libraries"] for r in rows} == {str(build.cache_dir().resolve())}


def test_a_budget_spent_leaves_the_rest_unrun(tmp_path):
    out = tmp_path / "whole.json"
    assert bench_whole_fit.main(["--quick", "--shapes", "lstm2x40", "--epochs", "1", "--pairs", "2",
                                 "--epoch-steps", "1", "--budget", "0", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["results"] == [] and run["skipped"] == 4


def test_host_timers_count_the_outermost_call_and_restore_the_methods():
    import keras
    import numpy as np

    from rnnfuse.fused import FusedRNN

    before = keras.layers.RNN.__call__, FusedRNN.__call__
    layer = keras.layers.LSTM(3)
    x = np.zeros((2, 4, 5), "float32")
    with profile_small.HostTimers().on() as timers:
        layer(x)
        layer(x)
    assert timers.calls["rnn_calls"] == 2 and timers.seconds["rnn_calls"] > 0
    assert (keras.layers.RNN.__call__, FusedRNN.__call__) == before
    # A fused call's kernel call counts inside it (on the CPU: torch._VF);
    # one made outside a fused call (a backward pass's) does not.
    import torch

    import rnnfuse
    import rnnfuse.backends.torch as torch_kernels

    inp = keras.Input((4, 5))
    model = keras.Model(inp, keras.layers.LSTM(3)(keras.layers.LSTM(3, return_sequences=True)(inp)))
    fast = rnnfuse.optimize(model, plan=rnnfuse.FUSED)
    with profile_small.HostTimers().on() as timers:
        fast(x)
        torch_kernels.torch_rnn("relu", torch.zeros(1))  # any torch._VF call, outside
    assert timers.calls["fused_calls"] == 1 and timers.calls["kernel_calls_in_fused"] == 1
    assert timers.calls["kernel_calls"] == 2
    step = timers.per_step(1)
    assert step["rnnfuse_own_ms"] == step["fused_calls_ms"] - step["kernel_calls_in_fused_ms"]
    assert (keras.layers.RNN.__call__, FusedRNN.__call__) == before


def test_the_tuning_shares_of_two_backends_make_one_table(tmp_path, capsys):
    """`--shares`: each backend's median share at 10 epochs, the first over the second."""
    for backend, fits in (("jax", (20.0, 10.0)), ("tensorflow", (20.0, 40.0))):
        rows = [dict(shape_name="gru3x64", epochs=e, pair=0, model="optimized", fit_s=fit, tuning_s=2.0)
                for e, fit in zip((10, 1), fits)]
        run = dict(meta=dict(backend=backend), summary=bench_whole_fit.summarize(rows), results=rows)
        (tmp_path / f"{backend}.json").write_text(json.dumps(run))
    assert bench_whole_fit.main(["--shares", str(tmp_path / "jax.json"), str(tmp_path / "tensorflow.json")]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "| gru3x64 | 10.0% | 10.0% | 1.00 |"


def test_the_libraries_are_built_once_before_the_children(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def build_ops(cmd, **kwargs):
        calls.append(cmd[1:])
        return subprocess.CompletedProcess(cmd, 0, stdout="built\n", stderr="")

    monkeypatch.setattr(bench_whole_fit.subprocess, "run", build_ops)
    out = tmp_path / "whole.json"
    assert bench_whole_fit.main(["--shapes", "lstm2x40", "--epochs", "1", "--pairs", "1",
                                 "--budget", "0", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert calls == [["-m", "rnnfuse", "build-ops"]]
    assert run["meta"]["prebuild"]["rc"] == 0 and run["skipped"] == 2
    assert (tmp_path / "cache" / "ops").is_dir()
