"""The backend-matrix benchmark's own logic (bench/bench_matrix.py) on the
CPU with tiny shapes: the peer PyTorch model matches the Keras model's
shape for every kind, and the table reads what the runs wrote; the
whole-fit benchmark's (bench/bench_whole_fit.py) baseline as the matrix's."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_matrix  # noqa: E402
import bench_whole_fit  # noqa: E402
from fake_clock import FakeClock  # noqa: E402


@pytest.mark.parametrize("name", ["lstm4x512", "bigru5x512", "plstm4x1024", "masked_lstm2x256", "rnn3x256"])
def test_the_peer_and_the_keras_model_have_the_same_weights_and_outputs_shape(name):
    import torch

    shape = bench_matrix.quick(bench_matrix.SHAPES[name])
    keras_model = bench_matrix.build_keras(shape)
    peer = bench_matrix.build_torch(shape)
    x, y, lengths = bench_matrix.data(shape)
    out = peer(torch.as_tensor(x), torch.as_tensor(lengths))
    assert tuple(out.shape) == (shape["batch"], *keras_model.output.shape[1:])
    # The same recurrent weights: PyTorch's two biases are one Keras bias
    # per gate (GRU: Keras' reset_after recurrent bias is PyTorch's b_hh).
    count = lambda params: sum(int(p.numel()) for p in params)
    keras_rnn = sum(int(w.numpy().size) for w in keras_model.weights
                    if "dense" not in w.path and "embedding" not in w.path)
    torch_rnn = count(peer.rnn.parameters())
    two_bias = shape["kind"] not in ("gru", "bi_gru")  # Keras GRU keeps both biases too
    if two_bias:
        units, gates = shape["units"], {"lstm": 4, "plstm": 4, "simple_rnn": 1}[shape["kind"].removeprefix("bi_")]
        dirs = 2 if shape["kind"].startswith("bi_") else 1
        torch_rnn -= shape["layers"] * dirs * gates * units
    assert keras_rnn == torch_rnn


def test_a_peer_run_and_a_keras_run_make_one_table(tmp_path):
    shapes = "lstm2x40,gru3x64"
    peer = tmp_path / "pt.json"
    assert bench_matrix.main(["--backend", "pytorch", "--quick", "--shapes", shapes, "--rounds", "1",
                              "--steps", "3", "--epoch-steps", "1", "--out", str(peer)]) == 0
    keras_run = dict(meta=dict(backend="torch"), results=[
        dict(shape_name="lstm2x40", fit_ms=dict(original=2.0, optimized=1.0), fit_speedup=2.0),
        dict(shape_name="gru3x64", error="RuntimeError: no"),
    ])
    (tmp_path / "k.json").write_text(json.dumps(keras_run))
    text = bench_matrix.table([str(tmp_path / "k.json"), str(peer)])
    lines = text.splitlines()
    assert lines[0] == "| shape | original torch | optimized torch | error torch | pytorch |"
    assert lines[2].startswith("| lstm2x40 | 2.0 | 1.0 (2.00x) | ")
    assert "RuntimeError: no" in lines[3]


def test_an_unknown_shape_is_named_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_matrix.main(["--shapes", "lstm9x9", "--out", "x.json"])
    assert exit_info.value.code == 2
    assert "unknown ['lstm9x9']; choose from lstm4x512" in capsys.readouterr().err


@pytest.mark.parametrize("tuned", [False, True], ids=["first batch", "in optimize"])
def test_the_tuning_share_is_the_tuners_seconds_over_the_fit_its_user_waits_for(tuned, monkeypatch):
    """First-batch tuning is inside the first fit (its seconds over the fit's);
    `--tuned` tuning runs in `optimize`, before the fit (over both)."""
    import bench_user_view

    import rnnfuse.api

    fake = FakeClock(start=100.0, tick=0.001)
    monkeypatch.setattr(bench_matrix, "clock", fake)
    real_choose = rnnfuse.api.choose_plans

    def slow_choose(*args, **kwargs):
        fake.advance(2.0)  # the tuner's candidates, on the fake clock
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(rnnfuse.api, "choose_plans", slow_choose)
    monkeypatch.setattr(bench_user_view, "_tuning_seconds", lambda model: 0.0 if tuned else 0.25)
    shape = bench_matrix.quick(bench_matrix.SHAPES["gru3x64"])
    row = bench_matrix.measure_keras(shape, epochs=2, epoch_steps=1, rounds=1, steps=1, tuned=tuned)
    share, fit = row["tuning_share"], row["first_call_s"]["optimized"]
    assert share["epochs"] == 2 and share["where"] == ("optimize" if tuned else "first batch")
    if tuned:
        assert share["tuning_s"] == pytest.approx(2.0, abs=0.01)
        assert share["fit_s"] == pytest.approx(fit + share["tuning_s"])
    else:
        assert share["tuning_s"] == 0.25 and share["fit_s"] == fit
    assert share["share"] == pytest.approx(share["tuning_s"] / share["fit_s"])
    line = bench_matrix.share_line("torch", "gru3x64", share)
    assert line.startswith(f"share torch gru3x64: tuning {share['tuning_s']:.2f} s of a 2-epoch fit")


@pytest.fixture
def failing_in_half_precision(monkeypatch):
    """Keras' own LSTM fails in mixed_float16 on JAX: a model built in any
    policy but float32 fails so; the dtypes built, in order."""
    built, real_build = [], bench_matrix.build_keras

    def build(shape):
        model = real_build(shape)
        built.append(shape["dtype"])
        if shape["dtype"] != "float32":
            def fail(*args, **kwargs):
                raise ValueError("Unknown output type float16")
            model.fit = fail
        return model

    monkeypatch.setattr(bench_matrix, "build_keras", build)
    return built


def test_an_original_that_fails_in_its_policy_is_timed_in_float32(failing_in_half_precision):
    """The baseline is the model its user can run, in float32, and the row
    keeps Keras' error."""
    built = failing_in_half_precision
    shape = bench_matrix.quick(bench_matrix.SHAPES["lstm4x512"])
    row = bench_matrix.measure_keras(shape, epochs=1, epoch_steps=1, rounds=1, steps=1)
    # The model optimized, Keras' model apart from it, then its float32 twin.
    assert built == ["mixed_float16", "mixed_float16", "float32"]
    assert row["original_failed"] == "ValueError: Unknown output type float16"
    assert set(row["fit_ms"]) == {"original", "optimized"} and row["fit_speedup"] > 0


def test_a_whole_fit_whose_original_fails_in_its_policy_times_it_in_float32(failing_in_half_precision):
    """The failed process says why and times nothing (it has traced); the
    float32 job, which `run_child` starts in a fresh process, times its fit."""
    job = dict(shape_name="lstm4x512", model="original", epochs=2, epoch_steps=1, quick=True, online=False)
    row = bench_whole_fit.measure(job)
    assert row["original_failed"] == "ValueError: Unknown output type float16" and "fit_s" not in row
    row = bench_whole_fit.measure(dict(job, dtype="float32"))
    assert failing_in_half_precision == ["mixed_float16", "float32"]
    assert row["fit_s"] > 0 and len(row["epoch_end_s"]) == 2


def test_the_shares_of_two_runs_make_one_table(tmp_path, capsys):
    for backend, share in (("jax", 0.04), ("tensorflow", 0.05)):
        run = dict(meta=dict(backend=backend), results=[
            dict(shape_name="gru3x64", tuning_share=dict(tuning_s=1.0, fit_s=1.0 / share, share=share)),
            dict(shape_name="lstm2x40", error="RuntimeError: no")])
        (tmp_path / f"{backend}.json").write_text(json.dumps(run))
    assert bench_matrix.main(["--shares", str(tmp_path / "jax.json"), str(tmp_path / "tensorflow.json")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| shape | jax | tensorflow | jax / tensorflow |", "|---|---|---|---|",
        "| gru3x64 | 4.0% | 5.0% | 0.80 |"]


def test_the_examples_hold():
    import doctest

    import common

    for module in (bench_matrix, common):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
