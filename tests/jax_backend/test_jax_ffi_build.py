"""rnnfuse's XLA FFI library for JAX (csrc/jax_*.cc) compiles here, without
a GPU, and every handler it exports registers with jax.ffi; a missing
header folder or a failing compiler is a BuildError naming the fix.

The wavefront cubin is a stand-in file (.incbin embeds any bytes): nvcc's
kernel build is tests/test_wavefront_build.py's; this checks the handlers
and the launcher compile against jaxlib's FFI headers.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import threading
from pathlib import Path

import jax
import pytest

from fake_compiler import fake_compiler
from rnnfuse.backends.cuda import build
from rnnfuse.backends.jax import ffi_build, wavefront


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder and a stand-in cubin in it."""
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path))
    cubin = tmp_path / "stand_in.cubin"
    cubin.write_bytes(b"not a cubin")
    return cubin


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(library path, stand-in cubin): one build (g++, 10-30 s) for the module."""
    folder = tmp_path_factory.mktemp("jax-ffi")
    cubin = folder / "stand_in.cubin"
    cubin.write_bytes(b"not a cubin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RNNFUSE_CACHE_DIR", str(folder))
        return ffi_build.build_ffi_library(cubin=cubin), cubin, folder


def _have_compilers():
    try:
        build.find_cxx(), build.find_nvcc()
    except build.BuildError as err:
        return str(err)
    return None


needs_compilers = pytest.mark.skipif(_have_compilers() is not None,
                                     reason=str(_have_compilers()))


@needs_compilers
def test_the_handlers_compile_and_register_with_jax(built, monkeypatch):
    path, cubin, folder = built
    assert path.name == ffi_build.LIBRARY_NAME
    lib = ctypes.CDLL(str(path))
    for target in wavefront.TARGETS:
        # Registering for CUDA needs no GPU; the handler is XLA's to call.
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform="CUDA")
    # Cached: the second call builds nothing.
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(folder))
    monkeypatch.setenv("CXX", "false")
    assert ffi_build.build_ffi_library(cubin=cubin) == path


def test_each_pass_has_its_own_source_file_on_xlas_stream():
    names = {s.removeprefix("jax_").removesuffix(".cc") for s in ffi_build.FFI_SOURCES}
    assert names == {"wavefront_forward", "wavefront_backward"}
    names = {s.removeprefix("jax_").removesuffix(".cc") for s in ffi_build.CUDNN_FFI_SOURCES}
    assert names == {"cudnn_forward", "cudnn_backward"}
    for source in ffi_build.FFI_SOURCES + ffi_build.CUDNN_FFI_SOURCES:
        text = (build.SOURCE_DIR / source).read_text()
        assert "PlatformStream<cudaStream_t>" in text  # XLA's stream, not a default one


def test_the_wavefront_abi_is_declared_once_for_every_binding():
    """The JAX handlers and the TensorFlow op read one framework-free header."""
    assert "#include \"wavefront_abi.h\"" in (build.SOURCE_DIR / "jax_ffi_common.h").read_text()
    op_source = build.SOURCE_DIR.parent.parent / "tensorflow" / "csrc" / "rnnfuse_wavefront_op.cc"
    op = op_source.read_text()
    assert "#include \"wavefront_abi.h\"" in op and "size_t rnnfuse_wf_workspace_bytes(" not in op


def _reached_headers(sources) -> set[str]:
    """The csrc/ headers `sources` reach by `#include "..."`, read here
    independently of `build.included_files`."""
    seen, todo = set(), list(sources)
    while todo:
        text = (build.SOURCE_DIR / todo.pop()).read_text()
        for name in re.findall(r'#\s*include\s*"([^"]+)"', text):
            if (build.SOURCE_DIR / name).is_file() and name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


LIBRARIES = [
    (ffi_build.ffi_key, Path("/cache/wavefront-nvcc12.6-0123/wavefront.cubin"),
     ffi_build.FFI_SOURCES + ffi_build.LIBRARY_SOURCES),
    (ffi_build.cudnn_ffi_key, Path("/cache/cudnn-core-0123/librnnfuse_cudnn_core.so"),
     ffi_build.CUDNN_FFI_SOURCES),
]


@pytest.mark.parametrize("key, built_from, sources", LIBRARIES, ids=["wavefront", "cudnn"])
def test_an_edit_to_any_file_a_library_reads_changes_its_cache_key(key, built_from, sources,
                                                                   tmp_path, monkeypatch):
    """Every source and every header it includes (cuda_driver.h among them)
    keys the library's cache; a file it does not read does not."""
    headers = _reached_headers(sources)
    assert "cuda_driver.h" in headers and not any(h.startswith("xla/") for h in headers)
    copy = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, copy)
    monkeypatch.setattr(build, "SOURCE_DIR", copy)
    for name in sorted(set(sources) | headers):
        before = key(built_from)
        with open(copy / name, "a") as f:
            f.write("\n// edited\n")
        assert key(built_from) != before, name
    unread = (set(ffi_build.FFI_SOURCES + ffi_build.LIBRARY_SOURCES + ffi_build.CUDNN_FFI_SOURCES)
              | {"wavefront.cu"}) - set(sources) - headers
    before = key(built_from)
    for name in unread:
        with open(copy / name, "a") as f:
            f.write("\n// edited\n")
    assert key(built_from) == before, unread


def test_the_native_builds_key_their_caches_with_one_digest():
    """No build module hashes its sources by hand: `build.digest` keys them all."""
    root = Path(build.__file__).resolve().parents[1]
    for module in ("jax/ffi_build.py", "tensorflow/op_build.py", "cuda/build.py"):
        text = (root / module).read_text()
        assert ("hashlib" in text) == (module == "cuda/build.py"), module


def test_registration_happens_once_and_says_why_it_failed(monkeypatch):
    """One loader for both libraries: the build is tried once a process and
    its failure is the reason the layers run."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    builds = []

    def no_library():
        builds.append(1)
        raise ffi_build.BuildError("no nvcc found")

    answers = {}
    for _ in range(2):
        why = ffi_build.load_and_register(answers, threading.Lock(), "the wavefront kernel",
                                          no_library, ("rnnfuse_wf_forward",))
        assert why == ("rnnfuse's XLA FFI library of the wavefront kernel is not available: "
                       "no nvcc found")
    assert builds == [1]


def _have_core_toolchain():
    try:
        build.find_cxx(), build.find_cudnn(), build.core_cuda_include(), ffi_build.ffi_include()
    except build.BuildError as err:
        return str(err)
    return None


@pytest.mark.skipif(_have_core_toolchain() is not None, reason=str(_have_core_toolchain()))
def test_the_cudnn_handlers_build_link_the_core_and_register(tmp_path, monkeypatch):
    """The cuDNN core's handlers compile against jaxlib's FFI headers and
    link the core itself (its folder on the rpath: one copy a process)."""
    import subprocess

    from rnnfuse.backends.jax import cudnn_core

    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path))
    path = ffi_build.build_cudnn_ffi_library()
    assert path.name == ffi_build.CUDNN_LIBRARY_NAME
    core = build.build_cudnn_core()
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert core.name in needed and str(core.parent) in needed, needed
    lib = ctypes.CDLL(str(path))
    for target in cudnn_core.TARGETS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform="CUDA")
    monkeypatch.setenv("CXX", "false")  # cached: nothing is compiled again
    assert ffi_build.build_cudnn_ffi_library() == path


def test_a_cudnn_handler_build_failure_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    core = tmp_path / "librnnfuse_cudnn_core.so"
    core.write_text("")
    with pytest.raises(ffi_build.BuildError, match="cuDNN core for JAX failed"):
        ffi_build.build_cudnn_ffi_library(core=core)


def test_the_cudnn_handlers_reached_through_a_linked_cache_are_not_built_again(tmp_path,
                                                                              monkeypatch):
    """A second cache folder whose ops link to the first (a process with its
    own RNNFUSE_CACHE_DIR sharing the built libraries) finds the handlers
    built against the same core: its path through the link keys nothing."""
    monkeypatch.setattr(ffi_build, "ffi_include", lambda: tmp_path)
    monkeypatch.setattr(build, "core_cuda_include", lambda: tmp_path)
    log = tmp_path / "cxx.log"
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, log)))
    first = tmp_path / "first"
    core = first / "ops" / "cudnn-core-0123" / "librnnfuse_cudnn_core.so"
    core.parent.mkdir(parents=True)
    core.write_text("")
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(first))
    built = ffi_build.build_cudnn_ffi_library(core=core)
    second = tmp_path / "second"
    second.mkdir()
    (second / "ops").symlink_to(first / "ops")
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(second))
    again = ffi_build.build_cudnn_ffi_library(core=second / "ops" / core.parent.name / core.name)
    assert again.resolve() == built.resolve()
    assert log.read_text().count("built") == 1


def test_missing_ffi_headers_are_a_build_error_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(tmp_path))
    with pytest.raises(ffi_build.BuildError, match="no xla/ffi/api/ffi.h.*Fix: reinstall jaxlib"):
        ffi_build.build_ffi_library()


@needs_compilers
def test_a_compiler_failure_is_a_build_error_with_its_output(cache, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(ffi_build.BuildError, match="XLA FFI library for JAX failed"):
        ffi_build.build_ffi_library(cubin=cache)


@needs_compilers
def test_the_library_workspace_sizes_are_the_bindings(built):
    """The binding sizes the FFI results that hold the kernels' workspaces
    itself (no library call in a trace); they are the library's sizes."""
    from rnnfuse.backends.cuda import library

    lib = library.WavefrontLibrary(built[0])  # the FFI library exports the C ABI too
    for shape in [(1, 8, 4, 7), (4, 512, 64, 1000), (3, 96, 5, 13)]:
        assert wavefront.workspace_bytes(*shape) == lib.workspace_bytes(*shape)
        assert wavefront.workspace_bytes(*shape, 4) == lib.workspace_bytes(*shape, 4)
        assert (wavefront.backward_stack_workspace_bytes(*shape)
                == lib.backward_stack_workspace_bytes(*shape))
    assert wavefront.backward_layer_workspace_bytes() == lib.backward_workspace_bytes()


def test_build_ops_under_jax_builds_the_ffi_library(monkeypatch, capsys, tmp_path):
    from rnnfuse.cli import main

    monkeypatch.setattr(build, "build_cudnn_core", lambda force=False: tmp_path / "core.so")
    monkeypatch.setattr(build, "build_library", lambda force=False: tmp_path / "wavefront.so")
    monkeypatch.setattr(ffi_build, "build_cudnn_ffi_library",
                        lambda force=False: tmp_path / "cudnn.so")
    monkeypatch.setattr(ffi_build, "build_ffi_library", lambda force=False: tmp_path / "lib.so")
    assert main(["build-ops"]) == 0
    # The wavefront kernel's C-ABI library too: the kernel checks load it.
    assert capsys.readouterr().out.strip().splitlines()[-3:] == [
        str(tmp_path / "wavefront.so"), str(tmp_path / "cudnn.so"), str(tmp_path / "lib.so")]

    def no_headers(force=False):
        raise ffi_build.BuildError("no xla/ffi/api/ffi.h")

    monkeypatch.setattr(ffi_build, "build_cudnn_ffi_library", no_headers)
    assert main(["build-ops"]) == 0  # the wavefront library still built: a note
    assert "cuDNN core's XLA FFI library was not built (no xla/ffi/api/ffi.h)" in (
        capsys.readouterr().err)

    def fails(force=False):
        raise ffi_build.BuildError("no nvcc found")

    monkeypatch.setattr(ffi_build, "build_ffi_library", fails)
    assert main(["build-ops"]) != 0
    assert "XLA FFI library for JAX failed (no nvcc found)" in capsys.readouterr().err
