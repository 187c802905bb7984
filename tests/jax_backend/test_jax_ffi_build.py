"""rnnfuse's XLA FFI library for JAX (csrc/jax_*.cc) compiles here, without
a GPU, and every handler it exports registers with jax.ffi; a missing
header folder or a failing compiler is a BuildError naming the fix.

The wavefront cubin is a stand-in file (.incbin embeds any bytes): nvcc's
kernel build is tests/test_wavefront_build.py's; this checks the handlers
and the launcher compile against jaxlib's FFI headers.
"""

from __future__ import annotations

import ctypes

import jax
import pytest

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


def test_every_handler_has_its_own_source_file():
    names = {s.removeprefix("jax_").removesuffix(".cc") for s in ffi_build.FFI_SOURCES}
    assert names == {"wavefront_forward", "wavefront_backward_stack", "wavefront_backward_layer"}
    for source in ffi_build.FFI_SOURCES:
        text = (build.SOURCE_DIR / source).read_text()
        assert "PlatformStream<cudaStream_t>" in text  # XLA's stream, not a default one


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
    monkeypatch.setattr(ffi_build, "build_ffi_library", lambda force=False: tmp_path / "lib.so")
    assert main(["build-ops"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "lib.so")

    def fails(force=False):
        raise ffi_build.BuildError("no nvcc found")

    monkeypatch.setattr(ffi_build, "build_ffi_library", fails)
    assert main(["build-ops"]) != 0
    assert "XLA FFI library for JAX failed (no nvcc found)" in capsys.readouterr().err
