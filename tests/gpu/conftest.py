"""GPU-only tests: skipped unless the Keras backend sees a GPU.

Run on a GPU machine as ../shared/gpu/README.md says, for example:

    bash .gpu/bin/tf-setup.sh && source .gpu/bin/tf-env.sh && python3 -m pytest -q tests/gpu

RNNFUSE_GPU_DRYRUN=1 runs them on the CPU with the emulated CudnnRNNV3
(tests/cudnn_reference.py), to check the tests themselves before spending
GPU time; tests marked `real_gpu_only` (they inspect real kernels) are
deselected then. A dry run proves nothing about cuDNN.
"""

from __future__ import annotations

import os

import keras
import pytest

DRYRUN = bool(os.environ.get("RNNFUSE_GPU_DRYRUN"))


def _gpu_visible() -> bool:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_logical_devices("GPU"))
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    if backend == "jax":
        import jax

        return jax.default_backend() == "gpu"
    return False


def pytest_collection_modifyitems(config, items):
    if DRYRUN:
        items[:] = [i for i in items if "real_gpu_only" not in i.keywords]
        return
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason="needs a GPU visible to the Keras backend")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _kernel_variants(request):
    """`--kernel-variants F,B`: the wavefront kernels' default variants for
    the session (tests/conftest.py), e.g. `--kernel-variants 1,1`."""
    value = request.config.getoption("--kernel-variants")
    if value is None:
        yield
        return
    from rnnfuse.backends.cuda import library

    try:
        forward, backward = (int(v) for v in value.split(","))
    except ValueError:
        raise pytest.UsageError(
            f"--kernel-variants: expected two integers F,B (e.g. 1,1); received {value!r}"
        ) from None
    saved = library.FORWARD_VARIANT, library.STACK_BACKWARD_VARIANT
    library.FORWARD_VARIANT, library.STACK_BACKWARD_VARIANT = forward, backward
    print(f"GPU_REPORT kernel variants: forward {forward}, stack backward {backward}")
    try:
        yield
    finally:
        library.FORWARD_VARIANT, library.STACK_BACKWARD_VARIANT = saved


@pytest.fixture(autouse=True)
def _dryrun_emulation(monkeypatch):
    if DRYRUN and keras.backend.backend() == "tensorflow":
        from cudnn_reference import emulated_cudnn_rnn

        from rnnfuse.backends import tensorflow as tf_backend

        monkeypatch.setattr(tf_backend, "cudnn_rnn", emulated_cudnn_rnn)
        monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    yield


@pytest.fixture(autouse=True)
def _cudnnrnnv3_outside_the_op_tests(request, monkeypatch):
    """The older GPU tests prove the CudnnRNNV3 path (their spies sit on its
    call site): they run with rnnfuse's own op turned off;
    test_gpu_cudnn_op.py and tests marked `cudnn_op` test the op."""
    if "cudnn_op" not in request.module.__name__ and not request.node.get_closest_marker("cudnn_op"):
        monkeypatch.setenv("RNNFUSE_DISABLE_OP", "1")
    yield


@pytest.fixture(autouse=True)
def _exact_float32():
    """No TF32 in float32 matmuls, so Keras' loop and cuDNN compare tightly."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
    elif keras.backend.backend() == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    yield


@pytest.fixture(autouse=True)
def _no_call_budget(request, monkeypatch):
    """These tests time plans on fits and predicts of a few steps, which a
    call's budget (`rnnfuse.tuning.budget`) would leave to the static
    table: every optimized model here times every call's candidates, but
    in a test marked `call_budget` (it checks what a short call runs)."""
    from rnnfuse.tuning import first_batch

    if request.node.get_closest_marker("call_budget") is not None:
        return

    attach = first_batch.attach

    def attach_without_budget(model, groups, state):
        state.fit_share = None
        return attach(model, groups, state)

    monkeypatch.setattr(first_batch, "attach", attach_without_budget)
