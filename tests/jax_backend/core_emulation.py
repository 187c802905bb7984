"""The cuDNN core's FFI targets, emulated in jax.numpy for the CPU.

`Emulation` stands in for `rnnfuse.backends.jax.cudnn_core.ffi_call` (and
`reserve_bytes`): it takes what the binding passes to `jax.ffi.ffi_call`
(target, result shapes, operands, aliases, attributes), checks every
operand, result and attribute against the handlers' contracts
(csrc/jax_cudnn_forward.cc, jax_cudnn_backward.cc), records the call, and
returns what the core returns, from cuDNN's equations
(tests/cudnn_reference.py with `xp=jax.numpy`, in float32; float64 in float64):

- the forwards: y, hy, cy (no dropout: the GPU tests check cuDNN's); the
  training forward keeps x (float32 bytes) in its reserve space, as the
  real one keeps what the backward reads;
- backward data: dx, dhx, dcx, the vector-Jacobian product of the
  equations at the reserve's x and its operands, and the reserve it
  returns also holds dparams (float32 bytes), as the real one holds what
  backward weights reads: so a binding that did not pass the training
  forward's reserve to backward data, or backward data's to backward
  weights, gets wrong gradients;
- backward weights: dparams, read from that reserve.

Everything is jax.numpy, so the emulation runs inside jit like the real
call (no host callback). `install(monkeypatch)` swaps it in and makes the
core available; the GPU tests (tests/gpu/test_gpu_core_jax.py) prove the
library's arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_reference import cudnn_rnn
from rnnfuse.backends.jax import cudnn_core

# The workspace size the emulated core asks for (any size works: it writes nothing there).
WORKSPACE = 16
MODES = cudnn_core.MODES
ATTRIBUTES = ("mode", "num_layers", "num_units", "proj_size", "directions", "algorithm",
              "allow_tf32", "dropout", "seed", "full_lengths")


def _check(cond, message):
    if not cond:
        raise AssertionError(message)


def _param_count(mode, layers, units, proj, input_size, dirs):
    g = {"lstm": 4, "gru": 3}.get(mode, 1)
    out = proj or units
    n = 0
    for level in range(layers):
        width = input_size if level == 0 else out * dirs
        n += dirs * (g * units * (width + out) + (proj * units if proj else 0) + 2 * g * units)
    return n


class Emulation:
    """The FFI targets in jax.numpy; `calls` lists (target, attributes)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        # One a forward: kind, num_layers, bidirectional, blob_size, dtype.
        self.stacks: list[dict] = []
        self.sizes: list[tuple] = []
        self.refuse: callable | None = None  # config -> CoreError or None

    # -- what the binding calls ------------------------------------------------------

    def reserve_bytes(self, config, dtype, steps, batch):
        self.sizes.append((config, str(dtype), steps, batch))
        if self.refuse is not None:
            err = self.refuse(config)
            if err is not None:
                raise err
        # dparams, then x, in the compute type (see the module doc).
        return _size(dtype) * (self._params(config) + steps * batch * config.input_size)

    def workspace_bytes(self, config, dtype, steps, batch):
        return WORKSPACE

    @staticmethod
    def _params(config):
        return _param_count(config.kind, config.num_layers, config.units, config.proj_size,
                            config.input_size, config.directions)

    def ffi_call(self, target, results, *operands, input_output_aliases=None, **attrs):
        _check(target in cudnn_core.TARGETS, f"unknown target {target}")
        _check(tuple(sorted(attrs)) == tuple(sorted(ATTRIBUTES)),
               f"{target}: attributes {sorted(attrs)}, not jax_cudnn_rnn.h's {ATTRIBUTES}")
        for name, value in attrs.items():
            want = np.float32 if name == "dropout" else (np.int64 if name == "seed" else np.int32)
            _check(type(value) is want, f"{target}: {name} is {type(value)}, not {want}")
        self.calls.append((target, {k: v.item() for k, v in attrs.items()}))
        # Every call's last result is its workspace (uint8, workspace_bytes).
        *results, space = results
        _check(space.dtype == jnp.uint8 and tuple(space.shape) == (WORKSPACE,),
               f"{target}: the last result is the uint8 [{WORKSPACE}] workspace, not "
               f"{space.dtype} {space.shape}")
        short = target.removeprefix("rnnfuse_cudnn_ffi_")
        if short in ("forward", "forward_training"):
            _check(input_output_aliases is None, f"{target} aliases nothing")
            out = self._forward(short == "forward_training", results, *operands, **attrs)
        elif short == "backward_data":
            _check(input_output_aliases == {8: 3},
                   f"backward data must alias its reserve operand (8) to result 3; "
                   f"got {input_output_aliases}")
            out = self._backward_data(results, *operands, **attrs)
        else:
            out = self._backward_weights(results, *operands, **attrs)
        _check(len(out) == len(results), f"{target}: {len(results)} results asked")
        for got, want in zip(out, results):
            _check(tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype,
                   f"{target}: result {want.shape} {want.dtype}, computed {got.shape} {got.dtype}")
        return list(out) + [jnp.zeros((WORKSPACE,), jnp.uint8)]

    # -- the targets -----------------------------------------------------------------

    def _config(self, x, hx, cx, params, lengths, mode, num_layers, num_units, proj_size,
                directions, **_):
        mode = MODES[int(mode)]
        steps, batch, input_size = x.shape
        dirs, layers, units, proj = int(directions), int(num_layers), int(num_units), int(proj_size)
        dt = x.dtype
        _check(dt in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64), f"x is {dt}")
        _check(hx.shape == (layers * dirs, batch, proj or units) and hx.dtype == dt,
               f"hx {hx.shape} {hx.dtype}: want [L*D, B, R] of x's type")
        if mode == "lstm":
            _check(cx.shape == (layers * dirs, batch, units) and cx.dtype == dt,
                   f"an LSTM's cx is {cx.shape}")
        else:
            _check(cx.shape == (0,), f"a {mode}'s cx must be [0], not {cx.shape}")
        n = _param_count(mode, layers, units, proj, input_size, dirs)
        _check(params.shape == (n,) and params.dtype == dt,
               f"params {params.shape} {params.dtype}: want [{n}] {dt}")
        _check(lengths.shape == (batch,) and lengths.dtype == jnp.int32,
               f"lengths {lengths.shape} {lengths.dtype}: want int32 [{batch}]")
        return mode, dirs

    def _reference(self, mode, dirs, x, hx, cx, params, lengths):
        up = lambda a: None if a is None else a.astype(_compute(x.dtype))  # noqa: E731
        y, h, c = cudnn_rnn(jnp, up(x), up(hx), up(cx) if mode == "lstm" else None,
                            up(params), lengths, mode, dirs == 2)
        return y, h, c

    def _forward(self, training, results, x, hx, cx, params, lengths, **attrs):
        mode, dirs = self._config(x, hx, cx, params, lengths, **attrs)
        self.stacks.append(dict(kind=mode, num_layers=int(attrs["num_layers"]),
                                bidirectional=dirs == 2, blob_size=int(params.shape[0]),
                                dtype=str(x.dtype)))
        y, h, c = self._reference(mode, dirs, x, hx, cx, params, lengths)
        dt = x.dtype
        out = [y.astype(dt), h.astype(dt), c.astype(dt) if mode == "lstm" else jnp.zeros((0,), dt)]
        if training:
            (size,) = results[3].shape
            n, es = params.shape[0], _size(dt)
            _check(results[3].dtype == jnp.uint8 and size == es * (n + x.size),
                   f"the reserve is uint8 [{es * (n + x.size)}] (reserve_bytes), not "
                   f"{results[3].dtype} {results[3].shape}")
            kept = _bytes(x.reshape(-1))
            out.append(jnp.concatenate([jnp.zeros((es * n,), jnp.uint8), kept]))
        return out

    def _backward_data(self, results, y, dy, dhy, dcy, hx, cx, params, lengths, reserve,
                       **attrs):
        n, es, ct = params.shape[0], _size(y.dtype), _compute(y.dtype)
        x_shape = results[0].shape  # the backward's input size is dx's
        x = _floats(reserve[es * n:], ct).reshape(x_shape).astype(y.dtype)
        mode, dirs = self._config(x, hx, cx, params, lengths, **attrs)
        _check(dy.shape == y.shape and dy.dtype == y.dtype, "dy is y's shape and type")
        _check(dhy.shape == hx.shape and dhy.dtype == hx.dtype, "dhy is hx's shape and type")
        _check(dcy.shape == cx.shape, "dcy is cx's shape")
        lstm = mode == "lstm"

        def run(x, hx, cx, params):
            return self._reference(mode, dirs, x, hx, cx if lstm else None, params, lengths)

        up = lambda a: a.astype(ct)  # noqa: E731
        primal = (up(x), up(hx), up(cx) if lstm else jnp.zeros((0,), ct), up(params))
        _, vjp = jax.vjp(run, *primal)
        cot = (up(dy), up(dhy), up(dcy) if lstm else None)
        dx, dhx, dcx, dparams = vjp(cot)
        dt = y.dtype
        kept = jnp.concatenate([_bytes(dparams), reserve[es * n:]])
        return [dx.astype(dt), dhx.astype(dt),
                dcx.astype(dt) if lstm else jnp.zeros((0,), dt), kept]

    def _backward_weights(self, results, x, hx, y, lengths, reserve, **attrs):
        (want,) = results
        n, es = want.shape[0], _size(want.dtype)
        _check(reserve.dtype == jnp.uint8 and reserve.shape[0] >= es * n,
               "backward weights reads backward data's reserve")
        return [_floats(reserve[: es * n], _compute(want.dtype)).astype(want.dtype)]


def _compute(dtype):
    """The type the emulation computes `dtype` in: float64 or float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _size(dtype) -> int:
    return jnp.dtype(_compute(dtype)).itemsize


def _bytes(a):
    """[n] in its compute type -> uint8 [size * n]."""
    return jax.lax.bitcast_convert_type(a.astype(_compute(a.dtype)), jnp.uint8).reshape(-1)


def _floats(b, dtype=jnp.float32):
    """uint8 [size * n] -> [n] of `dtype`."""
    return jax.lax.bitcast_convert_type(b.reshape(-1, jnp.dtype(dtype).itemsize), dtype)


def install(monkeypatch) -> Emulation:
    """Puts the emulation in the binding's place and makes the core
    available (a GPU backend, the handlers registered); returns it."""
    from rnnfuse.backends import jax as jax_backend

    emulation = Emulation()
    monkeypatch.setattr(cudnn_core, "ffi_call", emulation.ffi_call)
    monkeypatch.setattr(cudnn_core, "reserve_bytes", emulation.reserve_bytes)
    monkeypatch.setattr(cudnn_core, "workspace_bytes", emulation.workspace_bytes)
    monkeypatch.setattr(cudnn_core, "register", lambda: None)
    monkeypatch.setattr(jax_backend, "is_available", lambda: True)
    return emulation
