"""Builds rnnfuse's XLA FFI libraries for JAX (the csrc/jax_*.cc handlers).

- `librnnfuse_jax_ffi.so`: the wavefront handlers (`FFI_SOURCES`) and the
  launcher they wrap, its cubin embedded; g++ against
  `jax.ffi.include_dir()` (XLA's header-only FFI API) and CUDA's headers.
- `librnnfuse_jax_cudnn_ffi.so`: the cuDNN core's handlers, linking the
  core by rpath so a process holds one copy of it (its plans, handles and
  dropout states are per process); no nvcc needed.

No GPU is needed to build; each library is cached by `build.digest` of its
sources and their headers, the jaxlib version and the flags.

    >>> build_ffi_library().name  # doctest: +SKIP
    'librnnfuse_jax_ffi.so'
"""

from __future__ import annotations

from pathlib import Path

from rnnfuse.backends.cuda import build
from rnnfuse.backends.cuda.build import BuildError

__all__ = ["CUDNN_FFI_SOURCES", "CUDNN_LIBRARY_NAME", "FFI_SOURCES", "LIBRARY_NAME",
           "LIBRARY_SOURCES", "BuildError", "build_cudnn_ffi_library", "build_ffi_library",
           "cudnn_ffi_command", "cudnn_ffi_key", "ffi_command", "ffi_include", "ffi_key",
           "load_and_register"]

LIBRARY_NAME = "librnnfuse_jax_ffi.so"
# The handlers: one file a pass (forward, backward).
FFI_SOURCES = ("jax_wavefront_forward.cc", "jax_wavefront_backward.cc")
# The C-ABI libraries the handlers call, compiled into the same library.
LIBRARY_SOURCES = ("wavefront_host.cc",)
# The headers they include are found by `build.digest` (`build.included_files`).
_FLAGS_VERSION = "1"  # bump when the command changes
CUDNN_LIBRARY_NAME = "librnnfuse_jax_cudnn_ffi.so"
# The cuDNN core's handlers: forward (inference and training), backward
# (data and weights).
CUDNN_FFI_SOURCES = ("jax_cudnn_forward.cc", "jax_cudnn_backward.cc")


def ffi_include() -> Path:
    """`jax.ffi.include_dir()` where it holds xla/ffi/api/ffi.h; raises
    BuildError naming what is missing and the fix."""
    try:
        import jax.ffi
    except ImportError as err:
        raise BuildError(f"jax.ffi is not importable ({err}). Fix: install jax and jaxlib "
                         "0.4.31 or newer") from err
    include = Path(jax.ffi.include_dir())
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise BuildError(f"jaxlib's FFI headers are missing: no xla/ffi/api/ffi.h under "
                         f"{include}. Fix: reinstall jaxlib (0.4.31 or newer ships them)")
    return include


def ffi_command(cxx: str, cubin: Path, cuda_include: Path, include: Path, output: Path,
                sources: tuple = FFI_SOURCES + LIBRARY_SOURCES) -> list[str]:
    """The g++ command that builds the FFI library around `cubin`.

    XLA's headers are system headers (-isystem): their warnings are not ours.
    """
    return [
        cxx, *build.CXX_FLAGS, "-isystem", str(include), "-isystem", str(cuda_include),
        f"-I{build.SOURCE_DIR}", f'-DRF_WAVEFRONT_CUBIN="{cubin}"',
        *(str(build.SOURCE_DIR / s) for s in sources), "-o", str(output), "-ldl",
    ]


def ffi_key(cubin: Path) -> str:
    """The cache folder's name of the library around `cubin`: `build.digest`
    of the sources and their headers, the cubin's own key (its folder), the
    jaxlib version and the flags."""
    import jaxlib

    key = build.digest(FFI_SOURCES + LIBRARY_SOURCES, _FLAGS_VERSION, cubin.parent.name,
                       jaxlib.__version__, *build.CXX_FLAGS)
    return f"jax-ffi-{key}"


def build_ffi_library(force: bool = False, cubin: Path | None = None) -> Path:
    """Builds (unless cached) librnnfuse_jax_ffi.so; returns its path.

    `cubin`: the wavefront cubin to embed (default: `build.build_cubin()`,
    which runs nvcc; tests pass any file to check that the host code
    compiles).

    Raises:
        BuildError: no jaxlib headers, no nvcc, no C++ compiler, or a
            compiler failed (the message says which and the fix).
    """
    include = ffi_include()
    cxx = build.find_cxx()
    cubin = Path(cubin) if cubin is not None else build.build_cubin(force=force)
    cuda_include = build.cuda_include(build.find_nvcc())
    target = build.cache_dir() / ffi_key(cubin) / LIBRARY_NAME

    def make(tmp: Path) -> None:
        build.run_compiler(ffi_command(cxx, cubin, cuda_include, include, tmp),
                           "rnnfuse's XLA FFI library for JAX",
                           "check that the C++ compiler supports C++17 and that jaxlib's "
                           "FFI headers match it")

    return build.cached_build(target, make, force)


def cudnn_ffi_command(cxx: str, include: Path, cuda_include: Path, core: Path, output: Path,
                      sources: tuple = CUDNN_FFI_SOURCES) -> list[str]:
    """The g++ command that builds the cuDNN core's handlers, linked to the
    core at `core` (its folder on the rpath, so the library loads the copy
    `rnnfuse.backends.cuda.cudnn_core.load` loads)."""
    return [
        cxx, *build.CXX_FLAGS, "-isystem", str(include), "-isystem", str(cuda_include),
        f"-I{build.SOURCE_DIR}",
        *(str(build.SOURCE_DIR / s) for s in sources), "-o", str(output),
        f"-L{core.parent}", f"-l:{core.name}", f"-Wl,-rpath,{core.parent}", "-ldl",
    ]


def cudnn_ffi_key(core: Path) -> str:
    """The cache folder's name of the cuDNN handlers linked to `core`:
    `build.digest` of their sources and headers, the core's path (its
    folder is its own key), the jaxlib version and the flags."""
    import jaxlib

    key = build.digest(CUDNN_FFI_SOURCES, _FLAGS_VERSION, str(core), jaxlib.__version__,
                       *build.CXX_FLAGS)
    return f"jax-cudnn-ffi-{key}"


def build_cudnn_ffi_library(force: bool = False, core: Path | None = None) -> Path:
    """Builds (unless cached) librnnfuse_jax_cudnn_ffi.so; returns its path.

    `core`: the cuDNN core to link (default: `build.build_cudnn_core()`, g++
    against cuDNN's and CUDA's headers; no GPU, no nvcc).

    Raises:
        BuildError: no jaxlib headers, no C++ compiler, no CUDA or cuDNN headers,
            or a compiler failed (the message says which and the fix).
    """
    include = ffi_include()
    cxx = build.find_cxx()
    cuda_include = build.core_cuda_include()
    # The real path keys it: a cache folder reached through a link (another
    # RNNFUSE_CACHE_DIR linking the same ops) reuses the build, not g++.
    core = (Path(core) if core is not None else build.build_cudnn_core(force=force)).resolve()
    target = build.cache_dir() / cudnn_ffi_key(core) / CUDNN_LIBRARY_NAME

    def make(tmp: Path) -> None:
        build.run_compiler(cudnn_ffi_command(cxx, include, cuda_include, core, tmp),
                           "rnnfuse's XLA FFI library of the cuDNN core for JAX",
                           "check that the C++ compiler supports C++17 and that jaxlib's "
                           "FFI headers match it")

    return build.cached_build(target, make, force)


def load_and_register(answers: dict, lock, what: str, build_library, targets) -> str | None:
    """Loads `build_library()`'s library and registers its `targets` with
    jax.ffi for CUDA, once a process (`answers` keeps the answer under
    `lock`); None, or why `what` cannot run under JAX here: JAX is not on a
    GPU, or the library failed to build or load (then the layers run).

    >>> import threading
    >>> def no_library():
    ...     raise BuildError("no nvcc found")
    >>> why = load_and_register({}, threading.Lock(), "the wavefront kernel", no_library, ())
    >>> why.endswith("no nvcc found") or why.startswith("the wavefront kernel runs on CUDA GPUs")
    True
    """
    with lock:
        if "targets" not in answers:
            answers["targets"] = _register(what, build_library, targets)
        return answers["targets"]


def _register(what: str, build_library, targets) -> str | None:
    import ctypes

    import jax

    if jax.default_backend() != "gpu":
        return f"{what} runs on CUDA GPUs only; JAX runs on the {jax.default_backend()}"
    try:
        lib = ctypes.CDLL(str(build_library()))
        for target in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                        platform="CUDA")
    except Exception as exc:  # noqa: BLE001 - a failed build or load: the layers run
        return f"rnnfuse's XLA FFI library of {what} is not available: {exc}"
    return None
