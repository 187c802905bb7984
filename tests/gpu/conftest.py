"""GPU-only tests: skipped unless the Keras backend sees a GPU.

Run on the lent H200 as ../shared/gpu/README.md says, for example:

    bash .gpu/bin/tf-setup.sh && source .gpu/bin/tf-env.sh && python3 -m pytest -q tests/gpu
"""

from __future__ import annotations

import keras
import pytest


def _gpu_visible() -> bool:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_logical_devices("GPU"))
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    return False


def pytest_collection_modifyitems(config, items):
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason="needs a GPU visible to the Keras backend")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


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
    yield
