"""Builds rnnfuse's native libraries (csrc/) and caches them under
`cache_dir()`, keyed by a hash of the sources, the compiler and the flags.

- `build_cubin()`: nvcc compiles `csrc/wavefront.cu` to an sm_90a cubin;
- `build_library()`: g++ embeds it (`.incbin`) with `csrc/wavefront_host.cc`
  into `librnnfuse_wavefront.so`, a C ABI over the CUDA driver API;
- `build_cudnn_core()`: g++ compiles `csrc/cudnn_rnn_core.cc` into
  `librnnfuse_cudnn_core.so` against cuDNN's headers (`find_cudnn`), with
  an rpath to the cuDNN found.

No step needs a GPU. They need nvcc 12.4+ ($NVCC, $CUDA_HOME/bin, PATH, the
newest /usr/local/cuda*) and a C++17 compiler ($CXX, g++, c++). A file lock
keeps two processes from building the same file at once.

Example (no GPU needed; compiles only):

    >>> build_library().name  # doctest: +SKIP
    'librnnfuse_wavefront.so'
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "BuildError",
    "build_cubin",
    "build_cudnn_core",
    "build_library",
    "cache_dir",
    "cached_build",
    "file_lock",
    "core_cuda_include",
    "cudnn_header_version",
    "digest",
    "find_cudnn",
    "find_cxx",
    "load_library",
    "find_nvcc",
    "included_files",
    "nvcc_version",
    "asked_of_tool",
    "run_compiler",
]

logger = logging.getLogger("rnnfuse")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCES = ("wavefront.cu", "wavefront.cuh")
HOST_SOURCES = ("wavefront_host.cc", "wavefront_plan.h", "wavefront.cuh", "cuda_driver.h", "wavefront_abi.h")
LIBRARY_NAME = "librnnfuse_wavefront.so"
CUBIN_NAME = "wavefront.cubin"
# sm_90a: the forward's opt-in variant 2 uses wgmma; the other kernels
# compile to the same code as for sm_90.
NVCC_FLAGS = ("-std=c++17", "-O3", "-cubin", "-gencode=arch=compute_90a,code=sm_90a")
CXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
             "-static-libstdc++", "-static-libgcc")
_FLAGS_VERSION = "1"  # bump when a build command changes

CORE_SOURCES = ("cudnn_rnn_core.cc", "cudnn_rnn_core.h", "cuda_driver.h")
CORE_LIBRARY_NAME = "librnnfuse_cudnn_core.so"
# Hides the static libstdc++'s symbols: the core loads into processes with
# their own C++ runtime (torch, TensorFlow).
CORE_LINK_FLAGS = ("-ldl", "-Wl,--exclude-libs,ALL")


class BuildError(RuntimeError):
    """The kernel could not be built; the message says why and how to fix it."""


def cache_dir() -> Path:
    """Where built libraries go: $RNNFUSE_CACHE_DIR/ops or the user cache dir."""
    env = os.environ.get("RNNFUSE_CACHE_DIR")
    if env:
        return Path(env) / "ops"
    try:
        import platformdirs
    except ImportError:  # an install without the dependency: XDG's default
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rnnfuse"
    else:
        base = Path(platformdirs.user_cache_dir("rnnfuse"))
    return base / "ops"


class _FcntlLock:
    """A process lock on `path` (used only when `filelock` is missing)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def file_lock(path: str):
    """A lock that holds across processes (`filelock`, else fcntl)."""
    try:
        import filelock
    except ImportError:
        return _FcntlLock(path)
    return filelock.FileLock(path)


def find_nvcc() -> str:
    """The nvcc to use (see the module docstring); raises BuildError."""
    candidates = [os.environ.get("NVCC")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), key=_version_key, reverse=True)
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise BuildError(
        "no nvcc found (looked at $NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda*/bin). "
        "Fix: install the CUDA toolkit (12.4 or newer) or set NVCC to its nvcc"
    )


def _version_key(path: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", path))


def find_cxx() -> str:
    """The C++ compiler to use; raises BuildError."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError(
        "no C++ compiler found (looked for $CXX, g++, c++ on PATH). Fix: install "
        "one (for example `apt-get install g++`) or set CXX"
    )


def asked_of_tool(tool: str, *args: str) -> str:
    """`tool args`' stdout and stderr, kept in the cache folder per tool file
    (path, size, mtime) and args: a process that loads built libraries
    spawns no compiler.

    >>> asked_of_tool(shutil.which("true") or "/bin/true") == ""
    True
    """
    info = os.stat(tool)
    key = hashlib.sha256(repr((os.path.realpath(tool), info.st_size, info.st_mtime_ns, args))
                         .encode()).hexdigest()[:16]
    memo = cache_dir() / "tools" / f"{key}.txt"
    try:
        return memo.read_text()
    except OSError:
        pass
    proc = subprocess.run([tool, *args], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=memo.parent)
            with os.fdopen(fd, "w") as f:
                f.write(out)
            os.replace(tmp, memo)
        except OSError:
            pass  # a read-only cache folder: ask again next time
    return out


def nvcc_version(nvcc: str) -> str:
    """'13.0' from `nvcc --version` ('unknown' if it does not say)."""
    out = asked_of_tool(nvcc, "--version")
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def cuda_include(nvcc: str) -> Path:
    """The toolkit's include/ that `nvcc` compiles with (cuda.h); raises BuildError.

    Asked of nvcc itself (`--dryrun` prints its INCLUDES), so a wrapper
    script on PATH works too."""
    out = asked_of_tool(nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull)
    dirs = re.findall(r'-I"?([^"\s]+)', out)
    dirs.append(str(Path(nvcc).resolve().parent.parent / "include"))
    for inc in map(Path, dirs):
        if (inc / "cuda.h").is_file():
            return inc
    raise BuildError(f"no cuda.h in the include folders of {nvcc} ({', '.join(dirs)}). Fix: "
                     "set NVCC to the nvcc of a complete CUDA toolkit")


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def included_files(sources) -> list[Path]:
    """`sources` (names under SOURCE_DIR, or paths) and every rnnfuse header
    they reach by `#include "..."`, in the order first reached.

    A header is looked for next to the file that includes it, then in
    SOURCE_DIR (the builds' -I); one found in neither (jaxlib's, TensorFlow's)
    is left out: its library's version keys it.

    >>> [p.name for p in included_files(["jax_cudnn_forward.cc"])]
    ['jax_cudnn_forward.cc', 'jax_cudnn_rnn.h', 'cuda_driver.h', 'cudnn_rnn_core.h']
    """
    found: dict[Path, None] = {}
    todo = [SOURCE_DIR / s for s in sources]  # an absolute path stays as it is
    while todo:
        path = todo.pop(0)
        if path in found:
            continue
        found[path] = None
        for name in _INCLUDE.findall(path.read_text()):
            for folder in (path.parent, SOURCE_DIR):
                if (folder / name).is_file():
                    todo.append(folder / name)
                    break
    return list(found)


def digest(sources, *extra: str) -> str:
    """The 12-hex-digit cache key of a native build: the bytes of `sources`
    and of every header they include (`included_files`), and `extra` (the
    compiler's version, flags, the libraries built against). Every native
    build keys its cache with it, so an edit to any file it reads rebuilds.

    >>> len(digest(["cudnn_rnn_core.cc"], "-O2")), digest(["cudnn_rnn_core.cc"], "-O2") == digest(["cudnn_rnn_core.cc"], "-O3")
    (12, False)
    """
    h = hashlib.sha256(_FLAGS_VERSION.encode())
    for path in included_files(sources):
        h.update(path.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:12]


def built_once(memo: dict, lock, build) -> Path:
    """`build()`'s library, built (or found) once per cache folder a process
    (`memo`: folder -> its path, or the BuildError it raised, guarded by
    `lock`): a failed build fails the same way for the rest of the process,
    so callers that ask on every call do not run the compiler again."""
    folder = str(cache_dir())
    with lock:
        done = memo.get(folder)
        if isinstance(done, Exception):
            raise done
        if done is None or not Path(done).exists():
            try:
                done = memo[folder] = build()
            except BuildError as exc:
                memo[folder] = exc
                raise
    return Path(done)


def load_library(path, env_var: str, built, loaded: dict, lock, open_library):
    """The library at `path`, else at $`env_var`, else `built()`'s, opened
    by `open_library` once per resolved path (`loaded`: the caller's memo
    cache, guarded by `lock`)."""
    if path is None:
        path = os.environ.get(env_var) or None
    if path is None:
        path = built()
    key = str(Path(path).resolve())
    with lock:
        if key not in loaded:
            loaded[key] = open_library(key)
        return loaded[key]


def run_compiler(cmd: list[str], what: str, fix: str) -> None:
    """Runs a compile command; raises BuildError with its last lines and `fix`."""
    logger.info("building %s: %s", what, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BuildError(f"compiling {what} failed ({Path(cmd[0]).name} exit {proc.returncode}):"
                         f"\n{tail}\nFix: {fix}")


def cached_build(target: Path, make, force: bool = False) -> Path:
    """Builds `target` with make(tmp_path) under a lock unless it exists."""
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(str(target) + ".lock"):
        if target.exists() and not force:
            return target  # another process built it while we waited
        fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
        os.close(fd)
        try:
            make(Path(tmp))
            os.chmod(tmp, 0o755 if target.suffix == ".so" else 0o644)  # mkstemp made it 0600
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def build_cubin(force: bool = False) -> Path:
    """Compiles csrc/wavefront.cu to a cached sm_90a cubin; returns its path."""
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    key = f"wavefront-nvcc{version}-{digest(KERNEL_SOURCES, *NVCC_FLAGS)}"
    target = cache_dir() / key / CUBIN_NAME

    def make(tmp: Path) -> None:
        cmd = [nvcc, *NVCC_FLAGS, str(SOURCE_DIR / "wavefront.cu"), "-o", str(tmp)]
        run_compiler(cmd, "rnnfuse's wavefront kernel", "check that nvcc is CUDA 12.4 or newer")

    return cached_build(target, make, force)


def host_command(cxx: str, cubin: Path, include: Path, output: Path) -> list[str]:
    """The g++ command that builds the C-ABI library around `cubin`."""
    return [
        cxx, *CXX_FLAGS, f"-I{include}", f'-DRF_WAVEFRONT_CUBIN="{cubin}"',
        str(SOURCE_DIR / "wavefront_host.cc"), "-o", str(output), "-ldl",
    ]


def build_library(force: bool = False, cubin: Path | None = None) -> Path:
    """Builds (unless cached) librnnfuse_wavefront.so; returns its path.

    `cubin`: the wavefront cubin to embed (default: `build_cubin()`, which
    runs nvcc; tests of the host's plans and argument checks pass any file).

    Raises:
        BuildError: no nvcc, no C++ compiler, or a compiler failed."""
    cxx = find_cxx()
    cubin = Path(cubin) if cubin is not None else build_cubin(force=force)
    include = cuda_include(find_nvcc())
    key = f"wavefront-lib-{digest(HOST_SOURCES, cubin.parent.name, *CXX_FLAGS)}"
    target = cache_dir() / key / LIBRARY_NAME

    def make(tmp: Path) -> None:
        run_compiler(host_command(cxx, cubin, include, tmp), "rnnfuse's wavefront library",
                     "check that the C++ compiler supports C++17")

    return cached_build(target, make, force)


def find_cudnn() -> tuple[Path, Path]:
    """(include dir, lib dir) of a cuDNN 9 install; raises BuildError.

    Looked for in this order: `$CUDNN` (a folder with include/ and lib/),
    the `nvidia-cudnn-cu12` pip package (`pip install rnnfuse[cuda]`),
    `$CUDNN_HOME`/`$CUDA_HOME`/`$CUDA_PATH`, the system, /usr/local/cuda."""
    candidates: list[tuple[str, Path]] = []
    if os.environ.get("CUDNN"):
        candidates.append(("$CUDNN", Path(os.environ["CUDNN"])))
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append(("nvidia-cudnn-cu12", Path(loc)))
    for var in ("CUDNN_HOME", "CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append((f"${var}", Path(os.environ[var])))
    candidates.append(("system", Path("/usr")))
    candidates.append(("/usr/local/cuda", Path("/usr/local/cuda")))
    tried = []
    for origin, root in candidates:
        includes = [root / "include", root / "include" / "x86_64-linux-gnu"]
        libs = [root / "lib", root / "lib64", root / "lib" / "x86_64-linux-gnu"]
        inc = next((d for d in includes if (d / "cudnn.h").is_file()), None)
        lib = next((d for d in libs if (d / "libcudnn.so.9").exists()), None)
        if inc is not None and lib is not None:
            return inc, lib
        tried.append(f"{origin} ({root})")
    raise BuildError(
        "no cuDNN 9 headers and libcudnn.so.9 found (looked in "
        + ", ".join(tried)
        + "). Fix: pip install 'rnnfuse[cuda]' (nvidia-cudnn-cu12), or set "
        "CUDNN to a folder with include/cudnn.h and lib/libcudnn.so.9"
    )


def cudnn_header_version(include: Path) -> str:
    """'9.28.0' from cudnn_version.h ('unknown' if it does not say)."""
    text = ""
    for name in ("cudnn_version.h", "cudnn_version_v9.h", "cudnn.h"):
        p = include / name
        if p.is_file():
            text += p.read_text(errors="replace")
    parts = [re.search(rf"#define CUDNN_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCHLEVEL")]
    if not all(parts):
        return "unknown"
    return ".".join(m.group(1) for m in parts)


def core_cuda_include() -> Path:
    """A folder with cuda.h and cuda_runtime_api.h for the core (types
    only: it calls the driver through dlopen): nvcc's toolkit
    (`cuda_include`), else the nvidia-cuda-runtime wheel's, else
    `$CUDA_HOME/include`, else the copy inside TensorFlow's wheel (found
    without importing TensorFlow). Raises BuildError naming what it tried."""
    import importlib.util

    found: list[Path] = []
    try:
        found.append(cuda_include(find_nvcc()))
    except BuildError:
        pass
    for package, sub in (("nvidia.cuda_runtime", "include"),
                         ("tensorflow", "include/third_party/gpus/cuda/include")):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            found.append(Path(loc) / sub)
    if os.environ.get("CUDA_HOME"):
        found.insert(1, Path(os.environ["CUDA_HOME"]) / "include")
    for inc in found:
        if (inc / "cuda.h").is_file() and (inc / "cuda_runtime_api.h").is_file():
            return inc
    raise BuildError(
        "no CUDA headers (cuda.h and cuda_runtime_api.h) for the cuDNN core (looked in "
        + (", ".join(map(str, found)) or "no candidate folder")
        + "). Fix: install the CUDA toolkit (nvcc) or set CUDA_HOME to one")


def core_command(cxx: str, cuda_inc: Path, cudnn_inc: Path, cudnn_lib: Path,
                 output: Path) -> list[str]:
    """The g++ command that builds the cuDNN RNN core (no framework, no
    CUDA runtime: cuDNN and the driver are dlopen'ed; the rpath lets it
    find the libcudnn.so.9 it was built against where none is loaded)."""
    return [
        cxx, *CXX_FLAGS, f"-I{cuda_inc}", f"-I{cudnn_inc}",
        str(SOURCE_DIR / "cudnn_rnn_core.cc"), "-o", str(output), *CORE_LINK_FLAGS,
        f"-Wl,-rpath,{cudnn_lib}",
    ]


def build_cudnn_core(force: bool = False) -> Path:
    """Builds (unless cached) librnnfuse_cudnn_core.so; returns its path.

    Needs a C++ compiler, the CUDA headers (`core_cuda_include`: nvcc's
    toolkit, else a wheel's) and cuDNN 9's headers (`find_cudnn`). No GPU,
    no framework, no nvcc where a wheel brings the headers.

    Raises:
        BuildError: no compiler, no headers, or the compiler failed."""
    cxx = find_cxx()
    cuda_inc = core_cuda_include()
    cudnn_inc, cudnn_lib = find_cudnn()
    key = (f"cudnn-core-cudnn{cudnn_header_version(cudnn_inc)}-"
           f"{digest(CORE_SOURCES, *CXX_FLAGS, *CORE_LINK_FLAGS, str(cudnn_lib))}")
    target = cache_dir() / key / CORE_LIBRARY_NAME

    def make(tmp: Path) -> None:
        run_compiler(core_command(cxx, cuda_inc, cudnn_inc, cudnn_lib, tmp),
                     "rnnfuse's cuDNN RNN core", "check that the C++ compiler supports C++17")

    return cached_build(target, make, force)
