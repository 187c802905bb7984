"""Builds and loads rnnfuse's own cuDNN RNN op for TensorFlow (csrc/).

The first time a GPU is visible, `load_op()` compiles the op's kernels
(csrc/rnnfuse_cudnn_rnn.cc) with rnnfuse's cuDNN core
(rnnfuse/backends/cuda/csrc/cudnn_rnn_core.cc) under TensorFlow's flags
and loads it, cached in the user cache folder (or $RNNFUSE_CACHE_DIR)
under a key of the TensorFlow and cuDNN versions and the sources' hash.

It needs a C++17 compiler ($CXX, g++, c++), TensorFlow's headers (in its
wheel) and cuDNN 9 ($CUDNN, the `nvidia-cudnn-cu12` package, $CUDNN_HOME /
$CUDA_HOME, the system). libcudnn.so.9 is linked NEEDED with an rpath to
its folder, so the core's dlopen binds to that cuDNN; no CUDA runtime is
linked (TensorFlow's serves). `build_wavefront_op()` / `load_wavefront_op()`
build the wavefront op into its own library (it also needs nvcc).

Any failure warns once with the reason and the fix and returns None; the
backend then runs CudnnRNNV3. `RNNFUSE_DISABLE_OP=1` turns the op off;
`rnnfuse build-ops` prebuilds.

Example (no GPU needed; compiles only):

    >>> build_op().name  # doctest: +SKIP
    'rnnfuse_cudnn_rnn.so'
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from rnnfuse.backends.cuda import build as cuda_build
from rnnfuse.backends.cuda.build import BuildError, cache_dir, cudnn_header_version, find_cudnn

__all__ = [
    "BuildError",
    "build_op",
    "build_wavefront_op",
    "cache_dir",
    "disabled",
    "find_cudnn",
    "library_path",
    "load_op",
    "load_failure",
    "load_wavefront_op",
    "wavefront_load_failure",
]

logger = logging.getLogger("rnnfuse")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("rnnfuse_cudnn_rnn.cc",)
# Headers the op files include (csrc/): part of both libraries' cache keys
# (`cuda_build.digest` also follows every `#include "..."` it can find).
HEADERS = ("rnnfuse_tf_op.h",)
LIBRARY_NAME = "rnnfuse_cudnn_rnn.so"
_FLAGS_VERSION = "2"  # bump when the build command changes
# The cuDNN core's sources, compiled into the op's library (build_command).
CORE_SOURCES = tuple(cuda_build.SOURCE_DIR / name for name in cuda_build.CORE_SOURCES)

WAVEFRONT_SOURCE = "rnnfuse_wavefront_op.cc"
WAVEFRONT_LIBRARY_NAME = "rnnfuse_wavefront_op.so"

_LOCK = threading.Lock()
# Memo caches: each op's one load attempt a process (module, reason).
_STATE: dict[str, Any] = {"module": None, "tried": False, "reason": None}
_WAVEFRONT: dict[str, Any] = {"module": None, "tried": False, "reason": None}


# The C++ compiler ($CXX, g++, c++): the same search as the CUDA builds'.
find_compiler = cuda_build.find_cxx


def _tf_flags() -> tuple[list[str], list[str], str, str]:
    import tensorflow as tf

    include = tf.sysconfig.get_include()
    compile_flags = list(tf.sysconfig.get_compile_flags())
    link_flags = list(tf.sysconfig.get_link_flags())
    cuda_include = os.path.join(include, "third_party", "gpus", "cuda", "include")
    if not os.path.isfile(os.path.join(cuda_include, "cuda_runtime_api.h")):
        home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        cuda_include = os.path.join(home, "include")
    return compile_flags, link_flags, cuda_include, tf.__version__


def build_command(compiler: str, output: Path) -> list[str]:
    """The compile command for the op (raises BuildError)."""
    cudnn_inc, cudnn_lib = find_cudnn()
    compile_flags, link_flags, cuda_include, _ = _tf_flags()
    if not os.path.isfile(os.path.join(cuda_include, "cuda_runtime_api.h")):
        raise BuildError(
            "no CUDA runtime headers (cuda_runtime_api.h) in TensorFlow's wheel or "
            "$CUDA_HOME/include. Fix: set CUDA_HOME to a CUDA toolkit"
        )
    return [
        compiler,
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-O2",
        "-DGOOGLE_CUDA=1",
        "-w",
        *compile_flags,
        f"-I{cuda_include}",
        f"-I{cudnn_inc}",
        f"-I{cuda_build.SOURCE_DIR}",
        *[str(SOURCE_DIR / s) for s in SOURCES],
        # The core compiled in, not linked: one self-contained library to
        # load (and ship next to a SavedModel), keyed by the core's source.
        str(cuda_build.SOURCE_DIR / "cudnn_rnn_core.cc"),
        "-o",
        str(output),
        *link_flags,
        "-ldl",
        f"-L{cudnn_lib}",
        f"-Wl,-rpath,{cudnn_lib}",
        "-Wl,--no-as-needed",
        "-l:libcudnn.so.9",
        "-Wl,--as-needed",
    ]


def library_path() -> Path:
    """Where the op library for this TensorFlow/cuDNN/source goes."""
    cudnn_inc, _ = find_cudnn()
    import tensorflow as tf

    digest = cuda_build.digest((*(SOURCE_DIR / name for name in SOURCES + HEADERS), *CORE_SOURCES),
                               _FLAGS_VERSION)
    key = f"tf{tf.__version__}-cudnn{cudnn_header_version(cudnn_inc)}-{digest}"
    return cache_dir() / key / LIBRARY_NAME


_FIX = ("check that TensorFlow's headers match the installed TensorFlow and that g++ "
        "supports C++17")


def build_op(force: bool = False, verbose: bool = False) -> Path:
    """Compiles the op (unless cached) and returns the library's path.

    Raises:
        BuildError: no compiler, no headers, or the compiler failed."""
    compiler = find_compiler()
    return _build(library_path(), lambda tmp: build_command(compiler, tmp), "the op",
                  "rnnfuse's cuDNN RNN op", force, verbose)


def _build(target: Path, command, what: str, name: str, force: bool, verbose: bool) -> Path:
    """`target` built (unless cached) by `command(tmp_path)`."""

    def make(tmp: Path) -> None:
        cmd = command(tmp)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        logger.info("building %s for TensorFlow (%s)", name, target)
        cuda_build.run_compiler(cmd, what, _FIX)

    return cuda_build.cached_build(target, make, force)


def disabled() -> bool:
    """Whether RNNFUSE_DISABLE_OP turns the op off (read on every call)."""
    return os.environ.get("RNNFUSE_DISABLE_OP", "") not in ("", "0")


def load_failure() -> str | None:
    """Why the op is not loaded (after `load_op()` was tried), or None."""
    return _STATE["reason"]


def _warn(reason: str) -> None:
    message = (
        f"rnnfuse: its own cuDNN RNN op is not available ({reason}); fused "
        "TensorFlow stacks run on tf.raw_ops.CudnnRNNV3 (standard cuDNN algorithm "
        "only, no projections, no bfloat16)."
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_op():
    """The loaded op module, or None (built on first use where TensorFlow
    sees a GPU; a failure warns once)."""
    if _STATE["tried"]:
        return _STATE["module"]
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["module"]
        module, reason = None, None
        try:
            module = _load()
        except Exception as exc:  # any failure means: use CudnnRNNV3
            reason = str(exc) or type(exc).__name__
        _STATE.update(module=module, reason=reason, tried=True)
        if module is None and reason and not reason.startswith("no GPU"):
            _warn(reason)
        return module


def _check_gpu() -> None:
    """Raises RuntimeError where no op may load: RNNFUSE_DISABLE_OP, no GPU."""
    if disabled():
        raise RuntimeError("RNNFUSE_DISABLE_OP is set. Fix: unset it to use the op")
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise RuntimeError("no GPU visible to TensorFlow")


def _load():
    import tensorflow as tf

    _check_gpu()
    if not tf.test.is_built_with_cuda():
        raise RuntimeError("this TensorFlow is not built with CUDA")
    path = build_op()
    try:
        module = tf.load_op_library(str(path))
    except Exception as exc:
        raise RuntimeError(
            f"loading {path} failed: {exc}. Fix: delete {path.parent} to rebuild, or "
            "make libcudnn.so.9 loadable (pip install 'rnnfuse[cuda]')"
        ) from exc
    return module


def wavefront_command(compiler: str, cubin: Path, output: Path) -> list[str]:
    """The compile command for the wavefront ops around `cubin`: TensorFlow's
    flags, the op's adapter and the kernel's C-ABI launcher (the driver
    through dlopen; no CUDA runtime linked)."""
    compile_flags, link_flags, cuda_include, _ = _tf_flags()
    return [
        compiler, "-std=c++17", "-shared", "-fPIC", "-O2", "-DGOOGLE_CUDA=1", "-w",
        *compile_flags, f"-I{cuda_include}", f"-I{cuda_build.SOURCE_DIR}",
        f'-DRF_WAVEFRONT_CUBIN="{cubin}"',
        str(SOURCE_DIR / WAVEFRONT_SOURCE), str(cuda_build.SOURCE_DIR / "wavefront_host.cc"),
        "-o", str(output), *link_flags, "-ldl",
    ]


def build_wavefront_op(force: bool = False, verbose: bool = False) -> Path:
    """Compiles the wavefront ops (unless cached) and returns their library's
    path; needs `build_op`'s tools but cuDNN, plus nvcc. No GPU needed.

    Raises:
        BuildError: no compiler, no nvcc, or a compiler failed."""
    import tensorflow as tf

    compiler = find_compiler()
    cubin = cuda_build.build_cubin(force=force)
    digest = cuda_build.digest((SOURCE_DIR / WAVEFRONT_SOURCE, *(SOURCE_DIR / name for name in HEADERS),
                                *cuda_build.HOST_SOURCES), _FLAGS_VERSION, cubin.parent.name)
    target = cache_dir() / f"tf{tf.__version__}-wavefront-{digest}" / WAVEFRONT_LIBRARY_NAME
    return _build(target, lambda tmp: wavefront_command(compiler, cubin, tmp),
                  "the wavefront op", "rnnfuse's wavefront op", force, verbose)


def wavefront_load_failure() -> str | None:
    """Why the wavefront op is not loaded (after `load_wavefront_op()`), or None."""
    return _WAVEFRONT["reason"]


def load_wavefront_op():
    """The loaded wavefront op module, or None (the reason in
    `wavefront_load_failure()`); no warning: without it cuDNN runs."""
    with _LOCK:
        if _WAVEFRONT["tried"]:
            return _WAVEFRONT["module"]
        module, reason = None, None
        try:
            _check_gpu()
            import tensorflow as tf

            module = tf.load_op_library(str(build_wavefront_op()))
        except Exception as exc:  # any failure means: cuDNN runs
            reason = str(exc) or type(exc).__name__
            logger.info("rnnfuse: the wavefront op is not available: %s", reason)
        _WAVEFRONT.update(module=module, reason=reason, tried=True)
        return module


def reset_for_tests() -> None:
    """Forget previous load attempts (tests only)."""
    _STATE.update(module=None, tried=False, reason=None)
    _WAVEFRONT.update(module=None, tried=False, reason=None)
