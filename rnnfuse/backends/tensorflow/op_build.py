"""Builds and loads rnnfuse's own cuDNN RNN op for TensorFlow (csrc/).

Nothing to do for the user: the first time a GPU is visible, `load_op()`
compiles `csrc/rnnfuse_cudnn_rnn.cc` (the ops' kernels, which adapt
tensors) together with rnnfuse's cuDNN RNN core
(rnnfuse/backends/cuda/csrc/cudnn_rnn_core.cc, where the cuDNN logic
lives; about 25 s of g++ on two cores) with TensorFlow's compile and link
flags (`tf.sysconfig`) and loads it. The library is cached in the user cache folder
(`platformdirs.user_cache_dir("rnnfuse")/ops/`, or `$RNNFUSE_CACHE_DIR`),
under a name keyed by the TensorFlow version, the cuDNN version and a
hash of the source and build flags; a `filelock` lock keeps two processes
from building at once (the second waits, then loads the first's library).

What the build needs:

- a C++17 compiler: `$CXX`, else `g++`, else `c++`;
- TensorFlow's headers (its wheel ships them, CUDA's runtime headers
  included under `include/third_party/gpus/cuda/include`);
- cuDNN 9's headers and `libcudnn.so.9`, found in this order: `$CUDNN`
  (a folder with include/ and lib/), the `nvidia-cudnn-cu12` pip package
  (`pip install rnnfuse[cuda]`), `$CUDNN_HOME`/`$CUDA_HOME`, the system
  (/usr/include, /usr/lib/x86_64-linux-gnu).

libcudnn.so.9 is linked as a NEEDED entry (`--no-as-needed`) with an rpath
to the folder it was found in, so loading the op loads that cuDNN and the
core's dlopen of the soname binds to it; no CUDA runtime is linked (its
calls bind to the runtime inside libtensorflow_framework.so.2).

The same machinery builds `RnnfuseWavefront` (csrc/rnnfuse_wavefront_op.cc
with rnnfuse/backends/cuda/csrc/, which also needs nvcc: see
rnnfuse.backends.cuda.build) into its own library, `build_wavefront_op()` /
`load_wavefront_op()`, so a machine without nvcc keeps the cuDNN op.

If anything fails (no compiler, no headers, a load error), `load_op()`
warns once (logger "rnnfuse" and `warnings.warn`) with the reason and the
fix, returns None, and the TensorFlow backend keeps using CudnnRNNV3.
`RNNFUSE_DISABLE_OP=1` turns the op off. `rnnfuse build-ops` prebuilds.

Example (no GPU needed; compiles only):

    >>> path = build_op()  # doctest: +SKIP
    >>> path.name  # doctest: +SKIP
    'rnnfuse_cudnn_rnn.so'
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
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
# Headers the op files include (csrc/): part of both libraries' cache keys.
HEADERS = ("rnnfuse_tf_op.h",)
LIBRARY_NAME = "rnnfuse_cudnn_rnn.so"
_FLAGS_VERSION = "2"  # bump when the build command changes
# The cuDNN core's sources, compiled into the op's library (build_command).
CORE_SOURCES = tuple(cuda_build.SOURCE_DIR / name for name in cuda_build.CORE_SOURCES)

WAVEFRONT_SOURCE = "rnnfuse_wavefront_op.cc"
WAVEFRONT_LIBRARY_NAME = "rnnfuse_wavefront_op.so"

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"module": None, "tried": False, "reason": None, "warned": False}
_WAVEFRONT: dict[str, Any] = {"module": None, "tried": False, "reason": None}


def find_compiler() -> str:
    """The C++ compiler to use; raises BuildError."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError(
        "no C++ compiler found (looked for $CXX, g++, c++ on PATH). Fix: install "
        "one (for example `apt-get install g++`) or set CXX"
    )


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

    digest = hashlib.sha256(_FLAGS_VERSION.encode())
    for path in (*(SOURCE_DIR / name for name in SOURCES + HEADERS), *CORE_SOURCES):
        digest.update(path.read_bytes())
    key = f"tf{tf.__version__}-cudnn{cudnn_header_version(cudnn_inc)}-{digest.hexdigest()[:12]}"
    return cache_dir() / key / LIBRARY_NAME


_FIX = ("check that TensorFlow's headers match the installed TensorFlow and that g++ "
        "supports C++17")


def build_op(force: bool = False, verbose: bool = False) -> Path:
    """Compiles the op (unless cached) and returns the library's path.

    Raises:
        BuildError: no compiler, no headers, or the compiler failed.
    """
    compiler = find_compiler()
    target = library_path()

    def make(tmp: Path) -> None:
        cmd = build_command(compiler, tmp)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        logger.info("building rnnfuse's cuDNN RNN op for TensorFlow (%s)", target)
        cuda_build.run_compiler(cmd, "the op", _FIX)

    return cuda_build.cached_build(target, make, force)


def disabled() -> bool:
    """Whether RNNFUSE_DISABLE_OP turns the op off (read on every call)."""
    return os.environ.get("RNNFUSE_DISABLE_OP", "") not in ("", "0")


def load_failure() -> str | None:
    """Why the op is not loaded (after `load_op()` was tried), or None."""
    return _STATE["reason"]


def _warn(reason: str) -> None:
    if _STATE["warned"]:
        return
    _STATE["warned"] = True
    message = (
        f"rnnfuse: its own cuDNN RNN op is not available ({reason}); fused "
        "TensorFlow stacks run on tf.raw_ops.CudnnRNNV3 (standard cuDNN algorithm "
        "only, no projections, no bfloat16)."
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_op():
    """The loaded op module (with `rnnfuse_cudnn_rnn`, `..._backprop`), or None.

    Builds it on first use. Loads only when TensorFlow sees a GPU; any
    failure warns once and returns None (see the module docstring).
    """
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


def _load():
    if disabled():
        raise RuntimeError("RNNFUSE_DISABLE_OP is set. Fix: unset it to use the op")
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise RuntimeError("no GPU visible to TensorFlow")
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
    """The compile command for the RnnfuseWavefront op around `cubin`.

    TensorFlow's flags and headers (cuda.h, cuda_runtime_api.h come with its
    wheel), the op's adapter and the kernel's C-ABI launcher
    (rnnfuse/backends/cuda/csrc/wavefront_host.cc, which embeds `cubin` and
    reaches the CUDA driver through dlopen); no CUDA runtime is linked, as
    for the cuDNN op.
    """
    compile_flags, link_flags, cuda_include, _ = _tf_flags()
    return [
        compiler, "-std=c++17", "-shared", "-fPIC", "-O2", "-DGOOGLE_CUDA=1", "-w",
        *compile_flags, f"-I{cuda_include}", f"-I{cuda_build.SOURCE_DIR}",
        f'-DRF_WAVEFRONT_CUBIN="{cubin}"',
        str(SOURCE_DIR / WAVEFRONT_SOURCE), str(cuda_build.SOURCE_DIR / "wavefront_host.cc"),
        "-o", str(output), *link_flags, "-ldl",
    ]


def build_wavefront_op(force: bool = False, verbose: bool = False) -> Path:
    """Compiles the wavefront ops (unless cached); returns their library's
    path: RnnfuseWavefront (inference), RnnfuseWavefrontSaving and
    RnnfuseWavefrontBackward (training; rnnfuse_wavefront_op.cc).

    Needs what `build_op` needs but cuDNN, plus nvcc for the kernel's cubin
    (rnnfuse.backends.cuda.build). No GPU needed.

    Raises:
        BuildError: no compiler, no nvcc, or a compiler failed.
    """
    import tensorflow as tf

    compiler = find_compiler()
    cubin = cuda_build.build_cubin(force=force)
    digest = hashlib.sha256(_FLAGS_VERSION.encode() + cubin.parent.name.encode())
    for path in (SOURCE_DIR / WAVEFRONT_SOURCE, *(SOURCE_DIR / name for name in HEADERS),
                 *(cuda_build.SOURCE_DIR / n for n in cuda_build.HOST_SOURCES)):
        digest.update(path.read_bytes())
    target = cache_dir() / f"tf{tf.__version__}-wavefront-{digest.hexdigest()[:12]}" / WAVEFRONT_LIBRARY_NAME

    def make(tmp: Path) -> None:
        cmd = wavefront_command(compiler, cubin, tmp)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        logger.info("building rnnfuse's wavefront op for TensorFlow (%s)", target)
        cuda_build.run_compiler(cmd, "the wavefront op", _FIX)

    return cuda_build.cached_build(target, make, force)


def wavefront_load_failure() -> str | None:
    """Why the wavefront op is not loaded (after `load_wavefront_op()`), or None."""
    return _WAVEFRONT["reason"]


def load_wavefront_op():
    """The loaded RnnfuseWavefront op module, or None (with the reason in
    `wavefront_load_failure()`).

    Builds it on first use, only when TensorFlow sees a GPU and
    RNNFUSE_DISABLE_OP is unset. No warning: the op is a tuner candidate,
    and without it fused stacks run on cuDNN as before.
    """
    with _LOCK:
        if _WAVEFRONT["tried"]:
            return _WAVEFRONT["module"]
        module, reason = None, None
        try:
            if disabled():
                raise RuntimeError("RNNFUSE_DISABLE_OP is set. Fix: unset it to use the op")
            import tensorflow as tf

            if not tf.config.list_physical_devices("GPU"):
                raise RuntimeError("no GPU visible to TensorFlow")
            module = tf.load_op_library(str(build_wavefront_op()))
        except Exception as exc:  # any failure means: cuDNN runs
            reason = str(exc) or type(exc).__name__
            logger.info("rnnfuse: the wavefront op is not available: %s", reason)
        _WAVEFRONT.update(module=module, reason=reason, tried=True)
        return module


def reset_for_tests() -> None:
    """Forget previous load attempts (tests only)."""
    _STATE.update(module=None, tried=False, reason=None, warned=False)
    _WAVEFRONT.update(module=None, tried=False, reason=None)
