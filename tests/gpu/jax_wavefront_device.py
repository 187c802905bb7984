"""What the JAX wavefront GPU tests share: the device they run on (a Hopper
GPU, or with RNNFUSE_GPU_DRYRUN=1 the CPU with the emulated FFI calls of
tests/jax_backend/wavefront_emulation.py, to check the tests themselves),
and a spy on the FFI targets traced into each step.

    >>> len(HOPPER), DRYRUN in (True, False)
    (4, True)
"""

from __future__ import annotations

import os
import sys

import jax
import pytest

from rnnfuse.backends.jax import wavefront

DRYRUN = bool(os.environ.get("RNNFUSE_GPU_DRYRUN"))
HOPPER = ("H100", "H200", "H800", "GH200")


def hopper_or_emulation(monkeypatch) -> None:
    """The binding on the emulation (DRYRUN), else skips the test unless
    JAX's first device is a Hopper GPU."""
    if DRYRUN:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "jax_backend"))
        from wavefront_emulation import install

        install(monkeypatch)
        return
    kind = jax.devices()[0].device_kind
    if not any(name in kind for name in HOPPER):
        pytest.skip(f"the wavefront kernel runs on Hopper; this GPU is {kind}")


def traced_targets(monkeypatch) -> list[str]:
    """The short names of the FFI targets traced into steps from now on, in
    order (the calls still run)."""
    targets = []
    real = wavefront.ffi_call

    def spy(target, *args, **kwargs):
        targets.append(target.removeprefix("rnnfuse_wf_ffi_"))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(wavefront, "ffi_call", spy)
    return targets
