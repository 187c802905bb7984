"""torch DDP on two GPUs (NCCL): the optimized model trains like the original.

Runs examples/ddp_train.py under torchrun with one process per GPU, and with
one process for the scaling baseline. Needs two CUDA GPUs (nvidia-h200-x2)
and the torch backend; skipped otherwise. With RNNFUSE_REPORT_DIR set, the
reports land there (ddp_1gpu.json, ddp_2gpu.json).
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

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch" or _gpu_count() < 2,
    reason="needs the torch backend and two GPUs",
)


def _run(nproc: int, out: pathlib.Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KERAS_BACKEND="torch", NCCL_NVLS_ENABLE="0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={port}",
        str(ROOT / "examples" / "ddp_train.py"), "--out", str(out),
        "--steps", "200", "--features", "64", "--units", "512", "--layers", "4",
        "--batch", "64", "--samples", "1024", "--epochs", "2",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_ddp_on_two_gpus_matches_the_original_and_scales(tmp_path):
    two = _run(2, tmp_path / "ddp_2gpu.json")
    one = _run(1, tmp_path / "ddp_1gpu.json")
    folder = os.environ.get("RNNFUSE_REPORT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        for name, report in (("ddp_1gpu.json", one), ("ddp_2gpu.json", two)):
            (pathlib.Path(folder) / name).write_text(json.dumps(report, indent=1))
    print("\nGPU_REPORT ddp", json.dumps({
        n: {k: r[k]["samples_per_s"] for k in ("original", "optimized")}
        for n, r in (("1gpu", one), ("2gpu", two))
    }))
    assert two["optimized"]["replica_paths"] == [["fused"], ["fused"]]
    assert two["max_loss_diff"] <= 1e-4
    assert two["max_weight_diff"] <= 1e-4
