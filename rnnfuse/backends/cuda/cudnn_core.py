"""ctypes binding of librnnfuse_cudnn_core.so (csrc/cudnn_rnn_core.h).

The core is framework-free: device pointers and a CUDA stream as ints, run
through cuDNN 9's RNN API. `RnnConfig` is the C struct `rnnfuse_cudnn_rnn`;
`param_count` needs no GPU; every other call raises `CoreError` with the
library's message and code where it fails, so a caller can fall back.

Example (no GPU needed; builds the library once):

    >>> lib = load()  # doctest: +SKIP
    >>> lib.param_count(RnnConfig.of("lstm", 2, 8, 3))  # doctest: +SKIP
    992
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

__all__ = ["ABI_VERSION", "DTYPES", "MODES", "SMALL_H_UNITS", "CoreError", "CoreLibrary",
           "RnnConfig", "algorithm_code", "load", "load_failure", "prefers_small_h",
           "reset_for_tests"]

ABI_VERSION = 1
MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
DTYPES = ("float32", "float16", "bfloat16", "float64")
# cudnn_rnn_core.h's return codes.
E_ARGUMENT, E_UNAVAILABLE, E_NOT_SUPPORTED, E_CUDNN, E_CUDA = -1, -2, -3, -4, -5
# The math types in the order of an algorithm code's low two bits.
MATHS = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")

_LOCK = threading.Lock()
# Memo caches: resolved path -> its loaded library.
_LOADED: dict[str, "CoreLibrary"] = {}
# Memo cache: cache folder -> the library built there, or the build's error.
_BUILT: dict[str, object] = {}


class CoreError(RuntimeError):
    """The core refused or failed a call; `code` is its return code."""

    def __init__(self, message: str, code: int = E_CUDNN):
        super().__init__(message)
        self.code = code

    @property
    def unsupported(self) -> bool:
        """cuDNN does not run this configuration (or cannot run here)."""
        return self.code in (E_NOT_SUPPORTED, E_UNAVAILABLE)


class RnnConfig(ctypes.Structure):
    """`rnnfuse_cudnn_rnn` (48 bytes): one stack's configuration.

    >>> c = RnnConfig.of("gru", 3, 16, 8, directions=2, dtype="float16")
    >>> (c.mode, c.num_layers, c.directions, c.dtype, ctypes.sizeof(c))
    (1, 3, 2, 1, 48)"""

    _fields_ = [
        ("mode", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("num_units", ctypes.c_int32),
        ("proj_size", ctypes.c_int32),
        ("input_size", ctypes.c_int32),
        ("directions", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("algorithm", ctypes.c_int32),
        ("allow_tf32", ctypes.c_int32),
        ("dropout", ctypes.c_float),
        ("seed", ctypes.c_uint64),
    ]

    @classmethod
    def of(cls, kind: str, num_layers: int, units: int, input_size: int, *,
           directions: int = 1, proj_size: int = 0, dtype: str = "float32",
           algorithm: int = 0, allow_tf32: bool = False, dropout: float = 0.0,
           seed: int = 0) -> "RnnConfig":
        """The struct from names (ValueError for a kind or dtype it lacks)."""
        if kind not in MODES:
            raise ValueError(f"the cuDNN core runs {MODES}; received kind {kind!r}")
        if str(dtype) not in DTYPES:
            raise ValueError(f"the cuDNN core runs {DTYPES}; received dtype {dtype!r}")
        return cls(MODES.index(kind), int(num_layers), int(units), int(proj_size),
                   int(input_size), int(directions), DTYPES.index(str(dtype)), int(algorithm),
                   int(bool(allow_tf32)), float(dropout), int(seed) & (2**64 - 1))

    def key(self) -> tuple:
        """The fields as a tuple (hashable; equal configurations, equal keys)."""
        return tuple(getattr(self, name) for name, _ in self._fields_)


# The widest state cuDNN's small-h persistent algorithm serves in both
# passes, by cell kind: PyTorch's bounds for its backward pass.
SMALL_H_UNITS = {"lstm": 128, "gru": 128, "rnn_tanh": 256, "rnn_relu": 256}


def prefers_small_h(kind: str, units: int, proj_size: int, masked: bool) -> bool:
    """Whether a call with no plan algorithm runs cuDNN's persistent static
    small-h algorithm, as PyTorch's own calls of this shape do: far fewer
    launches than the standard one's per-step kernels. Never with a
    projection or padded lengths, which it refuses.

    >>> prefers_small_h("gru", 64, 0, False), prefers_small_h("lstm", 512, 0, False)
    (True, False)"""
    return not masked and not proj_size and int(units) <= SMALL_H_UNITS.get(kind, 0)


def algorithm_code(algo: int, math: str) -> int:
    """The core's `algorithm` field: 4 * algo + the math type's index.

    >>> algorithm_code(2, "tensor_op")
    9"""
    if algo not in range(4) or math not in MATHS:
        raise ValueError(f"algorithm_code: algo must be 0-3 and math one of {MATHS}; "
                         f"received {algo!r}, {math!r}")
    return 4 * algo + MATHS.index(math)


class CoreLibrary:
    """The loaded core (one per path)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        i, p, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        cfg = ctypes.POINTER(RnnConfig)
        szp = ctypes.POINTER(ctypes.c_size_t)
        lib.rnnfuse_cudnn_abi_version.restype = i
        lib.rnnfuse_cudnn_last_error.restype = ctypes.c_char_p
        lib.rnnfuse_cudnn_load.argtypes = [ctypes.c_char_p]
        lib.rnnfuse_cudnn_load.restype = i
        lib.rnnfuse_cudnn_param_count.argtypes = [cfg]
        lib.rnnfuse_cudnn_param_count.restype = ctypes.c_int64
        lib.rnnfuse_cudnn_sizes.argtypes = [cfg, i, i, p, p, szp, szp]
        lib.rnnfuse_cudnn_sizes.restype = i
        lib.rnnfuse_cudnn_forward.argtypes = [cfg, i, i, i, p, p, p] + [p] * 7 + [p, sz, p, sz]
        lib.rnnfuse_cudnn_forward.restype = i
        lib.rnnfuse_cudnn_backward_data.argtypes = [cfg, i, i, p, p, p] + [p] * 10 + [p, sz, p, sz]
        lib.rnnfuse_cudnn_backward_data.restype = i
        lib.rnnfuse_cudnn_backward_weights.argtypes = [cfg, i, i, p, p, p] + [p] * 4 + [p, sz, p, sz]
        lib.rnnfuse_cudnn_backward_weights.restype = i
        version = lib.rnnfuse_cudnn_abi_version()
        if version != ABI_VERSION:
            raise CoreError(f"{self.path} has ABI version {version}; this rnnfuse needs "
                            f"{ABI_VERSION}. Fix: rnnfuse build-ops --force", E_UNAVAILABLE)
        self._lib = lib

    def _check(self, rc: int) -> None:
        if rc < 0:
            message = (self._lib.rnnfuse_cudnn_last_error() or b"").decode(errors="replace")
            raise CoreError(message or f"the cuDNN core failed (code {rc})", rc)

    def cudnn_version(self, path: str | None = None) -> int:
        """The loaded cuDNN's version (90100, ...); CoreError without one."""
        rc = self._lib.rnnfuse_cudnn_load(path.encode() if path else None)
        self._check(rc)
        return rc

    def param_count(self, config: RnnConfig) -> int:
        """Elements of the canonical flat parameter buffer (no GPU needed)."""
        n = self._lib.rnnfuse_cudnn_param_count(ctypes.byref(config))
        if n < 0:
            self._check(E_ARGUMENT)
        return int(n)

    def sizes(self, config: RnnConfig, steps: int, batch: int, lengths: int | None,
              stream: int) -> tuple[int, int]:
        """(workspace bytes, reserve bytes) for this shape; `lengths`: the
        address of host int32 [batch] lengths, or None (all `steps`)."""
        work, reserve = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self._lib.rnnfuse_cudnn_sizes(ctypes.byref(config), steps, batch,
                                                  lengths or None, stream or None,
                                                  ctypes.byref(work), ctypes.byref(reserve)))
        return int(work.value), int(reserve.value)

    def forward(self, config: RnnConfig, training: bool, steps: int, batch: int, *,
                host_lengths: int | None, dev_lengths: int, stream: int, x: int, hx: int,
                cx: int, params: int, y: int, hy: int, cy: int, workspace: int,
                workspace_bytes: int, reserve: int, reserve_bytes: int) -> None:
        """The forward pass (device pointers as ints, 0 for NULL)."""
        self._check(self._lib.rnnfuse_cudnn_forward(
            ctypes.byref(config), int(bool(training)), steps, batch, host_lengths or None,
            dev_lengths or None, stream or None, x or None, hx or None, cx or None,
            params or None, y or None, hy or None, cy or None, workspace or None,
            workspace_bytes, reserve or None, reserve_bytes))

    def backward_data(self, config: RnnConfig, steps: int, batch: int, *,
                      host_lengths: int | None, dev_lengths: int, stream: int, y: int, dy: int,
                      dhy: int, dcy: int, hx: int, cx: int, params: int, dx: int, dhx: int,
                      dcx: int, workspace: int, workspace_bytes: int, reserve: int,
                      reserve_bytes: int) -> None:
        """dx, dhx, dcx from dy, dhy, dcy (0 for NULL: zeros / skipped)."""
        self._check(self._lib.rnnfuse_cudnn_backward_data(
            ctypes.byref(config), steps, batch, host_lengths or None, dev_lengths or None,
            stream or None, y or None, dy or None, dhy or None, dcy or None, hx or None,
            cx or None, params or None, dx or None, dhx or None, dcx or None,
            workspace or None, workspace_bytes, reserve or None, reserve_bytes))

    def backward_weights(self, config: RnnConfig, steps: int, batch: int, *,
                         host_lengths: int | None, dev_lengths: int, stream: int, x: int,
                         hx: int, y: int, dparams: int, workspace: int, workspace_bytes: int,
                         reserve: int, reserve_bytes: int) -> None:
        """The parameters' gradient, written into `dparams` (canonical layout)."""
        self._check(self._lib.rnnfuse_cudnn_backward_weights(
            ctypes.byref(config), steps, batch, host_lengths or None, dev_lengths or None,
            stream or None, x or None, hx or None, y or None, dparams or None,
            workspace or None, workspace_bytes, reserve or None, reserve_bytes))


def load(path: str | os.PathLike | None = None) -> CoreLibrary:
    """The core at `path`, else $RNNFUSE_CUDNN_CORE_LIB, else the cached
    build (built the first time: `rnnfuse.backends.cuda.build.build_cudnn_core`).

    Raises:
        BuildError: the build failed; CoreError: the library is not this
        rnnfuse's (ABI version); OSError: it does not load."""
    from rnnfuse.backends.cuda import build

    return build.load_library(path, "RNNFUSE_CUDNN_CORE_LIB", _built, _LOADED, _LOCK, CoreLibrary)


def _built() -> Path:
    """The cached build, built (or found) once per cache folder a process."""
    from rnnfuse.backends.cuda import build

    return build.built_once(_BUILT, _LOCK, build.build_cudnn_core)


def reset_for_tests() -> None:
    """Forget built and loaded libraries (tests only)."""
    with _LOCK:
        _BUILT.clear()
        _LOADED.clear()


def load_failure() -> str | None:
    """Why `load()` fails here (building it if needed), or None."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to fall back
        return str(exc) or type(exc).__name__
    return None
