"""pytest plugin: TensorFlow sees one physical GPU as several logical GPUs.

Load it with `-p` from the project root (tools/gpu/env.sh's
run_distribute_tests does):

    PYTHONPATH=tests/gpu python3 -m pytest -p logical_gpus tests/gpu/test_gpu_distribute.py
    # --logical-gpus N (default 2), --logical-gpu-memory MB (default 40000 each)

It splits the first physical GPU with
`tf.config.set_logical_device_configuration` in the
`pytest_load_initial_conftests` hook, which pytest calls for `-p` plugins
before it imports any conftest.py or test module (TensorFlow refuses the
split once its devices are initialized). The tests then see
`/device:GPU:0` and `/device:GPU:1` and place a MirroredStrategy replica on
each. Where TensorFlow already sees that many physical GPUs, or none, it
changes nothing; the report header says what it did.

What a run on logical GPUs shows: that each replica traces and runs the
fused kernel on its own device, that the replicas' variable copies stay
equal, and that losses and weights match single-GPU training (the
correctness of the multi-device path). What it does not show: scaling (both
replicas share one GPU's SMs and memory bandwidth), NCCL or NVLink traffic
(copies between logical devices stay inside one GPU), or per-GPU memory
limits of a real multi-GPU host.
"""

from __future__ import annotations

import os

import pytest

# What pytest_load_initial_conftests did, for the report header.
_DONE: list[str] = []


def pytest_addoption(parser):
    group = parser.getgroup("logical GPUs (tests/gpu/logical_gpus.py)")
    group.addoption("--logical-gpus", type=int, default=2, metavar="N",
                    help="split the first GPU into N logical GPUs (default 2)")
    group.addoption("--logical-gpu-memory", type=int, default=40000, metavar="MB",
                    help="memory of each logical GPU in MB (default 40000)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    _DONE.append(split_first_gpu(
        early_config.known_args_namespace.logical_gpus,
        early_config.known_args_namespace.logical_gpu_memory,
    ))


def pytest_report_header(config):
    return [f"logical GPUs: {line}" for line in _DONE]


def split_first_gpu(count: int, memory_mb: int) -> str:
    """Splits TensorFlow's first GPU into `count` logical GPUs of `memory_mb`
    each (unless there are `count` physical GPUs already); says what it did."""
    if count < 1 or memory_mb < 1:
        raise pytest.UsageError(
            f"--logical-gpus and --logical-gpu-memory must be positive; received "
            f"{count} and {memory_mb}"
        )
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        return "not split (KERAS_BACKEND is not tensorflow)"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "not split (no GPU visible to TensorFlow)"
    if len(gpus) >= count:
        return f"not split ({len(gpus)} physical GPUs)"
    config = tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)
    tf.config.set_logical_device_configuration(gpus[0], [config] * count)
    return f"{gpus[0].name} split into {count} logical GPUs of {memory_mb} MB"
