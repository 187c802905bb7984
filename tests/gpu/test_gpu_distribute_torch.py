"""torch DDP: the optimized model trains like the original, one GPU or two.

Runs examples/ddp_train.py under torchrun:

- two processes on the one GPU (`--one-gpu`: both on cuda:0, gloo all-reduce
  of CUDA tensors, since NCCL refuses two ranks on one device): every
  replica runs the fused call and the losses and weights match the
  original's. It checks the multi-process recipe, not scaling (both
  processes share the GPU). Needs one CUDA GPU.
- two processes on two GPUs (NCCL), and one process for the scaling
  baseline: needs two GPUs (nvidia-h200-x2).

The torch backend only; skipped otherwise. With RNNFUSE_REPORT_DIR set, the
reports land there (ddp_one_gpu.json, ddp_1gpu.json, ddp_2gpu.json).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import keras
import pytest
from gpu_report import report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch" or _gpu_count() < 1,
    reason="needs the torch backend and a GPU",
)


def _run(nproc: int, out: pathlib.Path, *extra: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KERAS_BACKEND="torch", NCCL_NVLS_ENABLE="0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={port}",
        str(ROOT / "examples" / "ddp_train.py"), "--out", str(out),
        "--steps", "200", "--features", "64", "--units", "512", "--layers", "4",
        "--batch", "64", "--samples", "1024", "--epochs", "2", *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_ddp_two_processes_on_one_gpu_match_the_original(tmp_path):
    got = _run(2, tmp_path / "ddp_one_gpu.json", "--one-gpu", "--samples", "256")
    report("ddp_one_gpu", got)
    assert got["world"] == 2 and got["devices"] == ["cuda:0", "cuda:0"]
    assert got["backend"] == "gloo"
    assert got["optimized"]["replica_paths"] == [["fused"], ["fused"]]
    assert got["original"]["replica_paths"] == [[], []]
    assert got["max_loss_diff"] <= 1e-4
    assert got["max_weight_diff"] <= 1e-4


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs")
def test_ddp_on_two_gpus_matches_the_original_and_scales(tmp_path):
    two = _run(2, tmp_path / "ddp_2gpu.json")
    one = _run(1, tmp_path / "ddp_1gpu.json")
    report("ddp_2gpu", two)
    report("ddp_1gpu", one)
    report("ddp_scaling", {
        n: {k: r[k]["samples_per_s"] for k in ("original", "optimized")}
        for n, r in (("1gpu", one), ("2gpu", two))
    })
    assert two["optimized"]["replica_paths"] == [["fused"], ["fused"]]
    assert two["max_loss_diff"] <= 1e-4
    assert two["max_weight_diff"] <= 1e-4
