"""torch DistributedDataParallel: the optimized model trains like the original.

Runs examples/ddp_train.py under torchrun with two CPU processes (gloo): the
same recipe as on several GPUs (NCCL), minus the GPUs. Each replica must run
the fused call, and the losses and final weights must match the original
model's DDP run.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_the_original_and_every_replica_fuses(tmp_path):
    out = tmp_path / "ddp.json"
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_WAIT_POLICY="PASSIVE", CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(ROOT / "examples" / "ddp_train.py"), "--out", str(out),
        "--samples", "32", "--epochs", "1",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["backend"] == "gloo"
    assert report["devices"] == ["cpu", "cpu"]
    assert report["optimized"]["replica_paths"] == [["fused"], ["fused"]]
    assert report["original"]["replica_paths"] == [[], []]
    assert report["max_loss_diff"] <= 1e-5
    assert report["max_weight_diff"] <= 1e-5
