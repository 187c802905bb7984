"""JAX binding of rnnfuse's cuDNN RNN core (csrc/cudnn_rnn_core.h) through
XLA FFI: the same core as torch's, so a plan's cuDNN algorithm runs in both
passes. The handlers take XLA's stream; the workspace is a result of every
call, the reserve space a result of the training forward.

`rnn` is a `jax.custom_vjp` over `TARGETS` (time-major x [T, B, F],
canonical flat params, int32 lengths [B]): the inference forward, or under
`jax.grad` the training forward then backward data and backward weights.
`call_sizes` asks the core for the buffer sizes when the step is traced, so a
refused algorithm falls back then, not when the step runs. The CPU tests
replace `ffi_call`, `reserve_bytes` and `workspace_bytes` with an emulation.

Example (on a GPU):

    >>> config = CoreConfig("lstm", 2, 64, 32)  # doctest: +SKIP
    >>> y, hy, cy = rnn(x, hx, cx, params, lengths, config=config)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KERNEL_NAME", "TARGETS", "CoreConfig", "algorithm_code", "core_reason",
           "call_sizes", "disabled", "ffi_call", "register", "reserve_bytes", "rnn",
           "workspace_bytes"]

TARGETS = ("rnnfuse_cudnn_ffi_forward", "rnnfuse_cudnn_ffi_forward_training",
           "rnnfuse_cudnn_ffi_backward_data", "rnnfuse_cudnn_ffi_backward_weights")
# The `KernelRun` name of a call on the core.
KERNEL_NAME = "rnnfuse cuDNN core (XLA FFI)"
MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
DTYPES = ("float32", "float16", "bfloat16", "float64")
_MATHS = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    """The handlers' attributes; hashable, as a static custom_vjp argument.

    >>> CoreConfig("gru", 2, 8, 3, directions=2).attributes()["mode"]
    np.int32(1)
    """

    kind: str
    num_layers: int
    units: int
    input_size: int
    directions: int = 1
    proj_size: int = 0
    algorithm: int = 0
    allow_tf32: bool = False
    dropout: float = 0.0
    seed: int = 0
    # Every sequence is T long: the handlers read no lengths on the host.
    full_lengths: bool = True

    def __post_init__(self):
        if self.kind not in MODES:
            raise ValueError(f"CoreConfig: kind must be one of {MODES}; received {self.kind!r}")

    @property
    def lstm(self) -> bool:
        return self.kind == "lstm"

    @property
    def output_size(self) -> int:
        return self.proj_size or self.units

    def attributes(self) -> dict:
        """The handlers' attributes (jax_cudnn_rnn.h's Attrs)."""
        return dict(mode=np.int32(MODES.index(self.kind)), num_layers=np.int32(self.num_layers),
                    num_units=np.int32(self.units), proj_size=np.int32(self.proj_size),
                    directions=np.int32(self.directions), algorithm=np.int32(self.algorithm),
                    allow_tf32=np.int32(bool(self.allow_tf32)),
                    dropout=np.float32(self.dropout),
                    seed=np.int64(int(self.seed) & (2**63 - 1)),
                    full_lengths=np.int32(bool(self.full_lengths)))

    def struct(self, dtype: str):
        """The C struct `rnnfuse_cudnn_rnn` for `dtype` (the ctypes binding's)."""
        from rnnfuse.backends.cuda import cudnn_core

        return cudnn_core.RnnConfig.of(
            self.kind, self.num_layers, self.units, self.input_size,
            directions=self.directions, proj_size=self.proj_size, dtype=str(dtype),
            algorithm=self.algorithm, allow_tf32=self.allow_tf32, dropout=self.dropout,
            seed=int(self.seed) & (2**63 - 1))


def algorithm_code(algorithm, dtype: str, allow_tf32: bool) -> int:
    """The core's `algorithm` code for an `Algorithm` (None: standard);
    half types default to tensor ops, float32 without TF32 to FMA, as on torch
    (float64 runs the default math whatever the code says).

    >>> from rnnfuse.plan import Algorithm
    >>> algorithm_code(Algorithm.parse("persistent_static+tc"), "float16", False)
    5
    >>> algorithm_code(None, "float32", False)
    3
    """
    algo = 0 if algorithm is None else int(algorithm.algo)
    math = "default" if algorithm is None else algorithm.math
    if str(dtype) == "float32" and not allow_tf32:
        math = "fma"
    elif str(dtype) in ("float16", "bfloat16") and math == "default":
        math = "tensor_op"
    return 4 * algo + _MATHS.index(math)


def disabled() -> bool:
    """Whether RNNFUSE_DISABLE_CORE turns the core off (read on every call)."""
    return os.environ.get("RNNFUSE_DISABLE_CORE", "") not in ("", "0")


# -- registration ----------------------------------------------------------------------

_LOCK = threading.Lock()
_REGISTERED: dict[str, str | None] = {}


def register() -> str | None:
    """Builds and registers the CUDA handlers once a process; None, or why
    the core cannot run under JAX here."""
    from rnnfuse.backends.jax import ffi_build

    return ffi_build.load_and_register(_REGISTERED, _LOCK, "the cuDNN core",
                                       ffi_build.build_cudnn_ffi_library, TARGETS)


def core_reason(dtype: str) -> str | None:
    """Why the core cannot run a call in `dtype` here, or None (cuDNN may
    still refuse the configuration: `reserve_bytes` raises `CoreError`)."""
    if str(dtype) not in DTYPES:
        return f"the cuDNN core runs {', '.join(DTYPES)}, not {dtype}"
    if disabled():
        return "the cuDNN core is turned off (RNNFUSE_DISABLE_CORE)"
    return register()


def ffi_call(target: str, results, *operands, input_output_aliases=None, **attributes):
    """`jax.ffi.ffi_call`, as one name the CPU tests can replace."""
    return jax.ffi.ffi_call(target, results, input_output_aliases=input_output_aliases)(
        *operands, **attributes)


_SIZES: dict[tuple, tuple[int, int]] = {}  # a memo of the core's answers


def call_sizes(config: CoreConfig, dtype: str, steps: int, batch: int) -> tuple[int, int]:
    """(workspace bytes, reserve bytes) of a call, asked once per
    configuration and shape in XLA's primary context on the first GPU.

    Raises:
        CoreError: the core cannot run this configuration here (cuDNN
            refused it, no cuDNN, no driver).
    """
    from rnnfuse.backends.cuda import cudnn_core

    key = (config, str(dtype), int(steps), int(batch))
    with _LOCK:
        found = _SIZES.get(key)
    if found is None:
        lib = cudnn_core.load()
        with _primary_context(_ORDINAL):
            found = tuple(lib.sizes(config.struct(dtype), int(steps), int(batch), None, 0))
        with _LOCK:
            _SIZES[key] = found
    return found


def reserve_bytes(config: CoreConfig, dtype: str, steps: int, batch: int) -> int:
    """Bytes of the reserve space of a training call (see `call_sizes`)."""
    return call_sizes(config, dtype, steps, batch)[1]


def workspace_bytes(config: CoreConfig, dtype: str, steps: int, batch: int) -> int:
    """Bytes of a call's workspace, at least 1 (see `call_sizes`)."""
    return max(1, call_sizes(config, dtype, steps, batch)[0])


# A Keras distribution replicates a step over GPUs of one kind: ask the first.
_ORDINAL = 0


class _primary_context:
    """Makes the GPU's primary context (XLA's) current for a call outside a step."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal

    def __enter__(self):
        from rnnfuse.backends.cuda.cudnn_core import E_UNAVAILABLE, CoreError

        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CoreError(f"libcuda.so.1 does not load ({err})", E_UNAVAILABLE) from None
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        for rc, what in ((cuda.cuInit(0), "cuInit"),
                         (cuda.cuDeviceGet(ctypes.byref(device), self.ordinal), "cuDeviceGet"),
                         (cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                          "cuDevicePrimaryCtxRetain"),
                         (cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")):
            if rc != 0:
                raise CoreError(f"{what} failed (CUDA error {rc})", E_UNAVAILABLE)
        self._cuda = cuda
        return self

    def __exit__(self, *exc):
        popped = ctypes.c_void_p()
        self._cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _forward(x, hx, cx, params, lengths, config: CoreConfig, save: bool):
    """(y, hy, cy) and, with `save`, the reserve space."""
    steps, batch, _ = x.shape
    dt = x.dtype
    results = [_sds((steps, batch, config.directions * config.output_size), dt),
               _sds(hx.shape, dt), _sds(cx.shape, dt)]
    if save:
        results.append(_sds((reserve_bytes(config, jnp.dtype(dt).name, steps, batch),),
                            jnp.uint8))
    out = ffi_call(TARGETS[1] if save else TARGETS[0], results + [_workspace(config, x)],
                   x, hx, cx, params, lengths, **config.attributes())
    return tuple(out[:-1])


def _workspace(config: CoreConfig, x):
    """The uint8 workspace result of a call on x [T, B, F]."""
    steps, batch, _ = x.shape
    return _sds((workspace_bytes(config, jnp.dtype(x.dtype).name, steps, batch),), jnp.uint8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _rnn(x, hx, cx, params, lengths, config, training):
    return _forward(x, hx, cx, params, lengths, config, save=training)[:3]


def _rnn_fwd(x, hx, cx, params, lengths, config, training):
    y, hy, cy, reserve = _forward(x, hx, cx, params, lengths, config, save=True)
    return (y, hy, cy), (x, hx, cx, params, lengths, y, reserve)


def _rnn_bwd(config, training, residuals, cotangents):
    x, hx, cx, params, lengths, y, reserve = residuals
    dy, dhy, dcy = (jnp.asarray(c).astype(x.dtype) for c in cotangents)
    attrs = config.attributes()
    dx, dhx, dcx, reserve, _ = ffi_call(
        TARGETS[2], [_sds(x.shape, x.dtype), _sds(hx.shape, x.dtype), _sds(cx.shape, x.dtype),
                     _sds(reserve.shape, reserve.dtype), _workspace(config, x)],
        y, dy, dhy, dcy, hx, cx, params, lengths, reserve, input_output_aliases={8: 3},
        **attrs)
    dparams, _ = ffi_call(TARGETS[3], [_sds(params.shape, params.dtype), _workspace(config, x)],
                          x, hx, y, lengths, reserve, **attrs)
    return dx, dhx, dcx, dparams, None


_rnn.defvjp(_rnn_fwd, _rnn_bwd)


def rnn(x, hx, cx, params, lengths, *, config: CoreConfig, training: bool = False):
    """One differentiable core call on time-major x [T, B, F]: (y [T, B, D*R],
    hy [L*D, B, R], cy [L*D, B, H] or None but for an LSTM). `training` runs
    the training forward (dropout) even where nothing differentiates.
    """
    cx = cx if config.lstm else _empty(x.dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    y, hy, cy = _rnn(x, hx, cx, params, lengths, config, bool(training))
    return y, hy, (cy if config.lstm else None)
