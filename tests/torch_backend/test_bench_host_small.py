"""bench/diag_host_small.py on the CPU: it runs the fused path's host code
with the kernel calls faked, reports rnnfuse's own share and op count, and
puts the real kernel functions back afterwards."""

from __future__ import annotations

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import diag_host_small  # noqa: E402


def test_the_host_diagnostic_measures_the_fused_path_and_restores_the_kernels(tmp_path):
    from rnnfuse.backends import torch as torch_backend
    from rnnfuse.backends.torch import cudnn_core

    before = (cudnn_core.core_forward, cudnn_core.core_backward, torch_backend.core_applies)
    out = tmp_path / "host.json"
    assert diag_host_small.main(["--shapes", "lstm2x40", "--steps", "2", "--rounds", "1",
                                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert "error" not in row, row
    assert row["path"] == "fused" and row["ops"] > 0 and row["kernel_us"] > 0
    assert row["rnnfuse_us"] == row["own_us"] - row["keras_layer_us"]
    assert (cudnn_core.core_forward, cudnn_core.core_backward,
            torch_backend.core_applies) == before
