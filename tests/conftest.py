"""Shared test setup: hypothesis profiles, seeds, backend and `slow`
markers, and the emulated cuDNN op.

Hypothesis profiles (HYPOTHESIS_PROFILE): "dev" (the default, so `make
test`: a few random examples per property, for the fast loop), "ci"
(`.ci/run`: 12 derandomized examples, the same on every run), "thorough"
(`make test-thorough`: 200).

The `slow` marker (tests/markers_slow.py lists the tests): `make test`
leaves them out, `make test-slow` runs only them, `.ci/run` and `make
test-thorough` run everything.

Markers by directory (`backend_markers`; setup.cfg lists them): tests/*.py
are the TensorFlow-backend suite (`tensorflow`), tests/torch_backend/ get
`torch`, tests/jax_backend/ `jax`, and every test in tests/gpu/ gets `gpu`
plus the backend its file is for (`test_gpu_*torch*.py`: torch,
`test_gpu_*jax*.py`: jax, the others: tensorflow). So `-m "not gpu"` or
`-m torch` select; the backend itself is still KERAS_BACKEND's (a torch
test is not even collected under another backend).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=False,
)
settings.register_profile("ci", max_examples=12, derandomize=True, **{k: v for k, v in _common.items() if k != "derandomize"})
settings.register_profile("dev", max_examples=3, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


from markers_by_directory import backend_markers  # noqa: E402
from markers_slow import slow_reason  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-variants", default=None, metavar="F,B",
        help="run rnnfuse's wavefront kernels with forward variant F and stack-backward "
             "variant B as the bindings' defaults (library.FORWARD_VARIANT, "
             "STACK_BACKWARD_VARIANT) for the whole session: the GPU tests of a variant "
             "before it becomes the default (tests/gpu/conftest.py)",
    )


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        relpath = os.path.relpath(str(item.fspath), here).replace(os.sep, "/")
        if relpath.startswith(".."):
            continue
        for name in backend_markers(relpath):
            if item.get_closest_marker(name) is None:
                item.add_marker(getattr(pytest.mark, name))
        test = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
        if slow_reason(f"{relpath}::{test}") and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fresh_keras_state(request):
    """Each test starts with a float32 policy and a fixed seed: 1234, or its
    module's `KERAS_SEED`."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(getattr(getattr(request, "module", None), "KERAS_SEED", 1234))
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def half():
    """The test runs under the mixed_float16 policy (`_fresh_keras_state`
    puts float32 back)."""
    keras.config.set_dtype_policy("mixed_float16")
    yield


@pytest.fixture
def fake_clock():
    """The tuner's clock for this test: a FakeClock (tests/fake_clock.py)
    that only the test's fake steps advance."""
    from fake_clock import FakeClock

    from rnnfuse.tuning.clock import using_clock

    with using_clock(FakeClock()) as clock:
        yield clock


@pytest.fixture
def plans_run(monkeypatch):
    """The plan name of each call of a FusedRNN's own `_run` (not a split
    plan's pieces, which run inside it), or "original" for each call that
    runs the original layers instead; the calls still run."""
    from rnnfuse.fused import FusedRNN

    ran, depth = [], [0]
    real_run, real_original = FusedRNN._run, FusedRNN._original_call

    def run(self, plan, *args, **kwargs):
        if not depth[0]:
            ran.append(plan.name)
        depth[0] += 1
        try:
            return real_run(self, plan, *args, **kwargs)
        finally:
            depth[0] -= 1

    def original(self, *args, **kwargs):
        ran.append("original")
        return real_original(self, *args, **kwargs)

    monkeypatch.setattr(FusedRNN, "_run", run)
    monkeypatch.setattr(FusedRNN, "_original_call", original)
    return ran


@pytest.fixture
def emulated_cudnn(monkeypatch):
    """Runs FusedRNN's fused path on the CPU with a reference CudnnRNNV3.

    The TensorFlow backend's `cudnn_rnn` (the one place that calls the op)
    becomes the differentiable reference in cudnn_reference.py, and
    `is_available()` says yes, so every fused-path step except the cuDNN
    kernel itself runs in CI. Yields a list that records each emulated call.
    """
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the emulated CudnnRNNV3 is for the TensorFlow backend")
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend

    calls = []

    def spy(**kwargs):
        calls.append(kwargs)
        return emulated_cudnn_rnn(**kwargs)

    monkeypatch.setattr(tf_backend, "cudnn_rnn", spy)
    monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    yield calls


class _OpModule:
    """Stands in for rnnfuse's loaded op library (`emulated_op`)."""


@pytest.fixture
def emulated_op(monkeypatch):
    """The fused path goes to rnnfuse's op, emulated on the CPU: the op call
    (`cudnn_op.call_op`) becomes the CudnnRNNV3 reference of
    cudnn_reference.py, the op counts as loaded (so the tuner's candidates
    include the persistent algorithms), and each call's attributes and
    inputs (its `algorithm` tensor too) are recorded in the list yielded."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the emulated op is for the TensorFlow backend")
    import tensorflow as tf
    from cudnn_reference import emulated_cudnn_rnn

    from rnnfuse.backends import tensorflow as tf_backend
    from rnnfuse.backends.tensorflow import cudnn_op

    calls = []

    def fake(module, **kw):
        calls.append(kw)
        y, h, c = emulated_cudnn_rnn(
            input=kw["input"], input_h=kw["input_h"],
            input_c=kw["input_c"] if kw["rnn_mode"] == "lstm" else tf.zeros_like(kw["input_h"]),
            params=kw["params"], sequence_lengths=kw["sequence_lengths"], rnn_mode=kw["rnn_mode"],
            direction=kw["direction"], time_major=True,
        )[:3]
        if kw["rnn_mode"] != "lstm":
            c = tf.zeros([0], y.dtype)
        return y, h, c, tf.zeros([0], tf.uint8)

    monkeypatch.setattr(cudnn_op, "call_op", fake)
    monkeypatch.setattr(tf_backend, "is_available", lambda: True)
    monkeypatch.setattr(tf_backend, "op_loaded", lambda: True)
    monkeypatch.setattr(tf_backend, "_op_for", lambda dtype, dropout: (
        (_OpModule(), None) if cudnn_op.op_unsupported_reason(dtype, dropout) is None
        else (None, cudnn_op.op_unsupported_reason(dtype, dropout))))
    return calls


@pytest.fixture(scope="session")
def built_wavefront(tmp_path_factory):
    """(path, cache dir) of rnnfuse's wavefront library, built (nvcc sm_90a
    cubin + g++ launcher, about 30 s of a core) once a run into a fresh
    cache, for every test module that needs the real library.

    Under pytest-xdist the workers share the cache (in the run's base temp
    folder, above each worker's): the build's file lock makes the second
    worker wait and reuse the first one's library, not build it again."""
    from rnnfuse.backends.cuda import build

    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "wavefront-cache"
    else:
        cache = tmp_path_factory.mktemp("wavefront-cache")
    with pytest.MonkeyPatch.context() as mp:  # the cache dir for the build only
        mp.setenv("RNNFUSE_CACHE_DIR", str(cache))
        path = build.build_library()
    return path, cache


@pytest.fixture(scope="session")
def wavefront_host(tmp_path_factory):
    """Path of rnnfuse's wavefront library built around a stand-in cubin
    (g++ only, about a second): for the tests of the host's plans and
    argument checks, which never load the kernels. Tests of the kernels'
    build itself use `built_wavefront`."""
    from rnnfuse.backends.cuda import build

    folder = tmp_path_factory.mktemp("wavefront-host")
    cubin = folder / "stand_in.cubin"
    cubin.write_bytes(b"not a cubin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RNNFUSE_CACHE_DIR", str(folder))
        return build.build_library(cubin=cubin)
