"""tests/conftest.py's markers by directory (setup.cfg lists them)."""

from __future__ import annotations

import configparser
import os

import pytest

from markers_by_directory import backend_markers


@pytest.mark.parametrize(
    "relpath, markers",
    [
        ("test_api.py", ("tensorflow",)),
        ("torch_backend/test_torch_fused.py", ("torch",)),
        ("jax_backend/test_jax_fused.py", ("jax",)),
        ("gpu/test_gpu_fused.py", ("gpu", "tensorflow")),
        ("gpu/test_gpu_torch.py", ("gpu", "torch")),
        ("gpu/test_gpu_distribute_torch.py", ("gpu", "torch")),
        ("gpu/test_gpu_jax.py", ("gpu", "jax")),
    ],
)
def test_markers_follow_the_directory(relpath, markers):
    assert backend_markers(relpath) == markers


def test_this_test_is_marked_and_every_marker_is_declared(request):
    assert request.node.get_closest_marker("tensorflow") is not None
    assert request.node.get_closest_marker("gpu") is None
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"))
    declared = {line.split(":")[0].strip() for line in cfg["tool:pytest"]["markers"].splitlines() if line.strip()}
    assert {"gpu", "tensorflow", "torch", "jax"} <= declared
