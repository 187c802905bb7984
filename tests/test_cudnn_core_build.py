"""Building rnnfuse's cuDNN RNN core on the CPU (no GPU needed).

- the real core compiles here (g++ against cuDNN 9's and the CUDA toolkit's
  headers) into a C-ABI library that links neither cuDNN nor CUDA (both
  dlopen'ed), exports only its own entry points, and loads;
- without a driver a call is a clear error (a code and a message), never an
  abort; a bad configuration is named before any GPU is asked;
- the ctypes struct matches the C header's;
- the build's command, cache and missing-cuDNN error, with a fake compiler.
The core's numbers are tested on a GPU (tests/gpu/test_gpu_core_torch.py).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from fake_compiler import fake_compiler
from rnnfuse.backends.cuda import build, cudnn_core

HEADER = Path(build.SOURCE_DIR) / "cudnn_rnn_core.h"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    cudnn_core.reset_for_tests()
    yield tmp_path
    cudnn_core.reset_for_tests()


def _fake_cudnn(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / "cudnn.h").write_text("")
    (root / "include" / "cudnn_version.h").write_text(
        "#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 1\n#define CUDNN_PATCHLEVEL 0\n")
    (root / "lib" / "libcudnn.so.9").write_text("")
    return root


def test_the_core_compiles_here_links_no_cuda_and_errs_cleanly_without_a_driver(fresh):
    """CI needs nvidia-cudnn-cu12 (the Makefile installs it for slow tests),
    g++ and nvcc's headers."""
    path = build.build_cudnn_core()
    assert path.name == "librnnfuse_cudnn_core.so" and fresh / "cache" in path.parents
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "libcudnn" not in dynamic and "libcuda" not in dynamic and "libcudart" not in dynamic
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                             text=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert exported == {
        "rnnfuse_cudnn_abi_version", "rnnfuse_cudnn_last_error", "rnnfuse_cudnn_load",
        "rnnfuse_cudnn_param_count", "rnnfuse_cudnn_sizes", "rnnfuse_cudnn_forward",
        "rnnfuse_cudnn_backward_data", "rnnfuse_cudnn_backward_weights"}
    assert build.build_cudnn_core() == path  # cached
    lib = cudnn_core.load(path)
    assert lib.cudnn_version() >= 90000  # the wheel's libcudnn.so.9 loads without a GPU
    config = cudnn_core.RnnConfig.of("lstm", 2, 8, 3, proj_size=4, directions=2)
    # Level 0: 4 gates x (8x3 + 8x4) + the 4x8 projection + 2 x 4 x 8 biases, twice;
    # level 1 reads both directions' 4 outputs: n = 8.
    assert lib.param_count(config) == 2 * (32 * 3 + 32 * 4 + 32 + 64) + 2 * (32 * 8 + 32 * 4 + 32 + 64)
    with pytest.raises(cudnn_core.CoreError, match="proj_size must be 0") as info:
        lib.param_count(cudnn_core.RnnConfig.of("gru", 1, 8, 3, proj_size=4))
    assert info.value.code == cudnn_core.E_ARGUMENT
    with pytest.raises(cudnn_core.CoreError, match=r"lengths\[1\] = 9 is outside \[1, 5\]"):
        lengths = (ctypes.c_int32 * 2)(5, 9)
        lib.sizes(config, 5, 2, ctypes.addressof(lengths), 0)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # CI: no driver, so every GPU call says so
        with pytest.raises(cudnn_core.CoreError, match=r"libcuda\.so\.1") as info:
            lib.sizes(config, 5, 2, None, 0)
        assert info.value.code == cudnn_core.E_UNAVAILABLE and info.value.unsupported
        with pytest.raises(cudnn_core.CoreError, match=r"libcuda\.so\.1"):
            lib.forward(config, True, 5, 2, host_lengths=None, dev_lengths=8, stream=0, x=8,
                        hx=0, cx=0, params=8, y=8, hy=0, cy=0, workspace=0, workspace_bytes=0,
                        reserve=0, reserve_bytes=0)
    with pytest.raises(cudnn_core.CoreError, match="dev_lengths is NULL with host_lengths"):
        lengths = (ctypes.c_int32 * 2)(5, 4)
        lib.backward_weights(config, 5, 2, host_lengths=ctypes.addressof(lengths),
                             dev_lengths=0, stream=0, x=8, hx=0, y=8, dparams=8,
                             workspace=0, workspace_bytes=0, reserve=0, reserve_bytes=0)


def test_the_ctypes_struct_is_the_headers():
    """Field names, order and types of `rnnfuse_cudnn_rnn` as the header
    declares them (ctypes does not check), and the ABI version."""
    text = HEADER.read_text()
    body = re.search(r"typedef struct rnnfuse_cudnn_rnn \{(.*?)\} rnnfuse_cudnn_rnn;", text,
                     re.S).group(1)
    fields = re.findall(r"^\s*(int32_t|float|uint64_t)\s+(\w+);", body, re.M)
    ctype = {"int32_t": ctypes.c_int32, "float": ctypes.c_float, "uint64_t": ctypes.c_uint64}
    assert [(n, ctype[t]) for t, n in fields] == list(cudnn_core.RnnConfig._fields_)
    assert ctypes.sizeof(cudnn_core.RnnConfig) == 48
    assert f"#define RNNFUSE_CUDNN_ABI_VERSION {cudnn_core.ABI_VERSION}" in text


def test_the_entries_take_as_many_arguments_as_the_header_declares():
    text = HEADER.read_text()
    source = Path(cudnn_core.__file__).read_text()
    for name in ("sizes", "forward", "backward_data", "backward_weights"):
        decl = re.search(rf"int rnnfuse_cudnn_{name}\((.*?)\);", text, re.S).group(1)
        params = len(decl.split(","))
        line = re.search(rf"lib\.rnnfuse_cudnn_{name}\.argtypes = (.*)", source).group(1)
        declared = eval(line, {"i": 1, "p": 1, "sz": 1, "cfg": 1, "szp": 1})  # a list
        assert len(declared) == params, name


def test_the_build_command_and_its_cache(fresh, monkeypatch):
    log = fresh / "log"
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, log)))
    monkeypatch.setenv("CUDNN", str(_fake_cudnn(fresh / "cudnn")))
    monkeypatch.setattr(build, "core_cuda_include", lambda: fresh / "cuda" / "include")
    path = build.build_cudnn_core()
    assert path.name == "librnnfuse_cudnn_core.so" and "cudnn-core-cudnn9.1.0-" in str(path)
    (command,) = log.read_text().splitlines()
    assert f"-I{fresh / 'cudnn' / 'include'}" in command
    assert f"-I{fresh / 'cuda' / 'include'}" in command
    assert f"-Wl,-rpath,{fresh / 'cudnn' / 'lib'}" in command
    assert "-Wl,--exclude-libs,ALL" in command and "cudnn_rnn_core.cc" in command
    assert "-lcudnn" not in command and "-lcuda" not in command
    assert build.build_cudnn_core() == path
    assert len(log.read_text().splitlines()) == 1  # built once


def test_without_nvcc_the_core_builds_on_a_wheels_cuda_headers(fresh, monkeypatch):
    """torch users seldom have the CUDA toolkit: the headers of a wheel
    (here TensorFlow's copy, or nvidia-cuda-runtime's) serve instead."""
    def no_nvcc():
        raise build.BuildError("no nvcc found")

    monkeypatch.setattr(build, "find_nvcc", no_nvcc)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    wheel = fresh / "site" / "tensorflow" / "include" / "third_party" / "gpus" / "cuda" / "include"
    wheel.mkdir(parents=True)
    for name in ("cuda.h", "cuda_runtime_api.h"):
        (wheel / name).write_text("")
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "tensorflow":
            spec = importlib.machinery.ModuleSpec("tensorflow", None, is_package=True)
            spec.submodule_search_locations = [str(fresh / "site" / "tensorflow")]
            return spec
        if name == "nvidia.cuda_runtime":
            return None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert build.core_cuda_include() == wheel
    (wheel / "cuda.h").unlink()
    with pytest.raises(build.BuildError, match=r"no CUDA headers.*Fix: install the CUDA toolkit"):
        build.core_cuda_include()


def test_a_missing_cudnn_names_the_fix(fresh, monkeypatch):
    import importlib.util

    monkeypatch.setenv("CUDNN", str(fresh / "nowhere"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    monkeypatch.setattr(build, "core_cuda_include", lambda: fresh)
    with pytest.raises(build.BuildError, match=r"pip install 'rnnfuse\[cuda\]'"):
        build.build_cudnn_core()


def test_a_failed_build_is_remembered_not_retried(fresh, monkeypatch):
    calls = []

    def failing():
        calls.append(1)
        raise build.BuildError("no C++ compiler found")

    monkeypatch.setattr(build, "build_cudnn_core", failing)
    assert "no C++ compiler found" in cudnn_core.load_failure()
    assert "no C++ compiler found" in cudnn_core.load_failure()
    assert len(calls) == 1


def test_what_nvcc_says_is_asked_once_per_nvcc_file(fresh):
    """A fresh process loading built libraries spawns no compiler: nvcc's
    answers are kept per nvcc file (a changed nvcc is asked again), and a
    failed run is not kept."""
    log = fresh / "ran.log"
    nvcc = fresh / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "Cuda compilation tools, release 12.8, V12.8.1"\n')
    nvcc.chmod(0o755)
    assert build.nvcc_version(str(nvcc)) == build.nvcc_version(str(nvcc)) == "12.8"
    assert log.read_text().splitlines() == ["--version"]
    nvcc.write_text(nvcc.read_text().replace("12.8", "13.0") + "exit 0\n")
    assert build.nvcc_version(str(nvcc)) == "13.0"
    failing = fresh / "nvcc-failing"
    failing.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    failing.chmod(0o755)
    assert build.nvcc_version(str(failing)) == build.nvcc_version(str(failing)) == "unknown"
    assert log.read_text().splitlines() == ["--version"] * 4
