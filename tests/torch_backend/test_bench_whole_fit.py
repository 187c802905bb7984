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
    assert [(r["epochs"], r["model"]) for r in rows] == [
        (1, "original"), (1, "optimized"), (2, "optimized"), (2, "original")]
    assert all("error" not in r and r["fit_s"] > 0 and r["process_s"] >= r["fit_s"] for r in rows)
    # Each child saw its own epochs end, and a fresh, empty plan cache.
    assert [len(r["epoch_end_s"]) for r in rows] == [1, 1, 2, 2]
    assert all(d["source"] != "cache" for r in rows for d in r.get("decisions", []))
    assert {(s["shape_name"], s["epochs"], s["pairs"]) for s in run["summary"]} == {
        ("lstm2x40", 1, 1), ("lstm2x40", 2, 1)}


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
