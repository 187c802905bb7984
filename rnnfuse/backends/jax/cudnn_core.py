"""JAX binding of rnnfuse's cuDNN RNN core (csrc/cudnn_rnn_core.h), through
XLA FFI.

The handlers (csrc/jax_cudnn_forward.cc, jax_cudnn_backward.cc, built by
`ffi_build.build_cudnn_ffi_library`) are thin C++ over the core's C ABI:
the stream is XLA's, the workspace a result of every call, the reserve
space a result of the training forward, and a refusal an FFI error with the core's
message. The core is the library the torch binding loads, so a plan's
cuDNN algorithm (standard, persistent static, persistent dynamic) runs in
both passes on JAX as it does there.

Targets (`TARGETS`):

- `rnnfuse_cudnn_ffi_forward`: the inference forward;
- `rnnfuse_cudnn_ffi_forward_training`: the training forward (dropout
  applied, the reserve space filled);
- `rnnfuse_cudnn_ffi_backward_data`: dx, dhx, dcx (writes into the
  reserve, which it returns aliased);
- `rnnfuse_cudnn_ffi_backward_weights`: the parameters' gradient.

`rnn(x, hx, cx, params, lengths, config=..., training=...)` is a
`jax.custom_vjp` over them: time-major x [T, B, F], canonical flat params,
int32 lengths [B]. Where nothing differentiates it, the inference forward
runs (the training one where `training`: dropout); under `jax.grad` the
training forward runs and the backward pass is backward data then
backward weights on its reserve. Everything is an XLA custom call: a
jitted Keras step runs it with no host callback. A masked call
(`CoreConfig.full_lengths` False) copies the lengths to the host inside
the handler (cuDNN 9 reads them there too).

The reserve space's and the workspace's sizes are what XLA needs before
the step runs: `call_sizes` asks the core (`rnnfuse_cudnn_sizes`) when the
step is traced, which also tells whether cuDNN accepts the configuration
there (`CoreError`), so a refused algorithm falls back when traced, not
when the step runs. `ffi_call`, `reserve_bytes` and `workspace_bytes` are
the binding's only calls out: the CPU tests replace them with an emulation
(tests/jax_backend/core_emulation.py).

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
DTYPES = ("float32", "float16", "bfloat16")
_MATHS = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    """One configuration of the core: the handlers' attributes (hashable,
    so it is a static argument of the custom_vjp).

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
    """The core's `algorithm` field for a `rnnfuse.plan.Algorithm` (None:
    standard) in `dtype`: half types run tensor ops unless asked otherwise,
    float32 without TF32 runs FMA (as the torch binding's).

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
    """Builds (once, cached) and registers the handlers for CUDA; returns
    None, or why the core cannot run under JAX here (no GPU, no jaxlib FFI
    headers, no cuDNN headers, a build or load failure). Tried once a
    process."""
    from rnnfuse.backends.jax import ffi_build

    return ffi_build.registered_once(_REGISTERED, _LOCK, _register)


def _register() -> str | None:
    from rnnfuse.backends.jax import ffi_build

    if jax.default_backend() != "gpu":
        return f"the cuDNN core runs on CUDA GPUs; JAX runs on the {jax.default_backend()}"
    try:
        lib = ctypes.CDLL(str(ffi_build.build_cudnn_ffi_library()))
        for target in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                        platform="CUDA")
    except Exception as exc:  # noqa: BLE001 - a failed build or load: the layers run
        return f"rnnfuse's XLA FFI library of the cuDNN core is not available: {exc}"
    return None


def core_reason(dtype: str) -> str | None:
    """Why the core cannot run a call in `dtype` here, or None (cuDNN may
    still refuse the configuration: `reserve_bytes` raises `CoreError`)."""
    if str(dtype) not in DTYPES:
        return f"the cuDNN core runs {', '.join(DTYPES)}, not {dtype}"
    if disabled():
        return "the cuDNN core is turned off (RNNFUSE_DISABLE_CORE)"
    return register()


def ffi_call(target: str, results, *operands, input_output_aliases=None, **attributes):
    """`jax.ffi.ffi_call(target, results, ...)(*operands, **attributes)`;
    one module-level name so the CPU tests can put an emulation in its place."""
    return jax.ffi.ffi_call(target, results, input_output_aliases=input_output_aliases)(
        *operands, **attributes)


# -- the reserve space's size, asked when a step is traced -----------------------------

_SIZES: dict[tuple, tuple[int, int]] = {}  # a memo of the core's answers


def call_sizes(config: CoreConfig, dtype: str, steps: int, batch: int) -> tuple[int, int]:
    """(workspace bytes, reserve bytes) of a call (the core's
    `rnnfuse_cudnn_sizes` for full-length sequences: cuDNN sizes both by
    the longest), asked once per configuration and shape on the first local
    GPU with its primary context current (XLA's).

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


# Every local GPU is asked as the first one: a Keras distribution
# replicates a step over devices of one kind.
_ORDINAL = 0


class _primary_context:
    """Makes device `ordinal`'s primary context (the one XLA runs on)
    current on this thread for a call of the core outside a step."""

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


# -- the calls -------------------------------------------------------------------------


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
    """The workspace result of a call on x [T, B, F]: uint8, sized when
    the step is traced."""
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
    """One core call: (y [T, B, D*R], hy [L*D, B, R], cy [L*D, B, H] or
    None but for an LSTM).

    x [T, B, F] time-major in the compute dtype (float32, float16,
    bfloat16); hx, cx the initial states (cx None unless an LSTM); params
    the canonical flat buffer; lengths int32 [B] (every one T where
    `config.full_lengths`); `training`: the training forward even where
    nothing differentiates (dropout). Differentiable (`jax.custom_vjp`).
    """
    cx = cx if config.lstm else _empty(x.dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    y, hy, cy = _rnn(x, hx, cx, params, lengths, config, bool(training))
    return y, hy, (cy if config.lstm else None)
