"""bench/diag_core_small.py on the CPU: its variants compute one step (a
layer a `torch._VF` call, the stack in one, the core's torch binding on the
emulated core, with TF32 as torch allows it and off), and without CUDA it
says what it needs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import diag_core_small  # noqa: E402
from core_emulation import install  # noqa: E402

TINY = {kind: dict(kind=kind, layers=2, units=5, batch=3, steps=4, features=3)
        for kind in ("lstm", "gru")}


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_variants_compute_the_same_step(kind, monkeypatch):
    calls = install(monkeypatch)
    names = ["vf_multi", "vf_per_layer", "core", "core_fma", "core_small_h"]
    steps = diag_core_small.make_steps(TINY[kind], names, device="cpu")
    assert list(steps) == names
    reference = steps["vf_multi"][0]()
    assert reference[1].shape == (sum(w.numel() for w in diag_core_small.weights(TINY[kind], "cpu")),)
    for name in names[1:]:
        diff = diag_core_small.max_diff(reference, steps[name][0]())
        assert diff["y"] < 1e-5 and diff["weight_grad"] < 1e-4, (name, diff)
    forwards = [c for c in calls if c["pass_"] == "forward"]
    assert [(c["kind"], c["layers"], c["training"]) for c in forwards] == [(kind, 2, True)] * 3
    tf32 = bool(torch.backends.cudnn.allow_tf32)
    assert [c["tf32"] for c in forwards] == [tf32, False, tf32]
    assert forwards[2]["algorithm"] // 4 == 3  # persistent static small-h


def test_without_cuda_it_says_what_it_needs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert diag_core_small.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()
