"""The backend-matrix benchmark's own logic (bench/bench_matrix.py) on the
CPU with tiny shapes: the peer PyTorch model matches the Keras model's
shape for every kind, and the table reads what the runs wrote."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_matrix  # noqa: E402


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
