"""torch binding of rnnfuse's cuDNN RNN core (cuda/csrc/cudnn_rnn_core.h):
the fused cuDNN call with the algorithm as an input, so the plan's
algorithm (standard, persistent static or dynamic) runs in both passes,
which `torch._VF` never chooses for a multi-layer call.

`torch.ops.rnnfuse.cudnn_rnn` is a custom op over the core's C ABI (ctypes,
no torch dependency); its gradient is `cudnn_rnn_backward` on the forward's
reserve space. `core_reason` says beforehand why the core cannot run a call
here; a `CoreError` is cuDNN refusing it; either way the backend runs
`torch._VF`. The CPU tests replace `core_forward` and `core_backward`
with an emulation (tests/cudnn_reference.py).

Example (on a GPU with the core built):

    >>> y, hy, cy = run(x, "lstm", 2, 64, params, h0, c0)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from rnnfuse.backends.torch.streams import launch_stream

__all__ = ["KERNEL_NAME", "CoreCall", "algorithm_code", "canonical_params", "core_backward",
           "core_forward", "core_reason", "disabled", "load_failure", "reserve_bytes", "run",
           "runs_eagerly"]

KERNEL_NAME = "torch.ops.rnnfuse.cudnn_rnn"
_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MATHS = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")
# Memo cache: call configuration -> the core's (workspace, reserve) sizes.
_SIZES: dict[tuple, tuple[int, int]] = {}
_SIZES_LOCK = threading.Lock()


def disabled() -> bool:
    """Whether RNNFUSE_DISABLE_CORE turns the core off (read on every call)."""
    return os.environ.get("RNNFUSE_DISABLE_CORE", "") not in ("", "0")


def _cuda():
    from rnnfuse.backends.cuda import cudnn_core

    return cudnn_core


def core_reason(x: torch.Tensor) -> str | None:
    """Why the core cannot run a call on `x` (a CUDA tensor) here, or None
    (it may still refuse the configuration when called: `CoreError`)."""
    if x.dtype not in _DTYPES:
        return (f"the cuDNN core runs float32, float16 and bfloat16, not "
                f"{str(x.dtype).replace('torch.', '')}")
    if disabled():
        return "the cuDNN core is turned off (RNNFUSE_DISABLE_CORE)"
    failure = load_failure()
    if failure is not None:
        return f"the cuDNN core is not available: {failure}"
    return None


@torch.compiler.assume_constant_result  # a trace's constant (the loader takes locks)
def load_failure() -> str | None:
    """Why the core does not load here, or None."""
    return _cuda().load_failure()


def algorithm_code(algorithm, dtype: torch.dtype, allow_tf32: bool) -> int:
    """The core's `algorithm` field for an `Algorithm` (None: standard) in
    `dtype`: half types run tensor ops unless asked otherwise; float32
    without TF32 runs FMA.

    >>> from rnnfuse.plan import Algorithm
    >>> algorithm_code(Algorithm.parse("persistent_static+tc"), torch.float16, True)
    5
    >>> algorithm_code(None, torch.float32, False)
    3"""
    algo = 0 if algorithm is None else int(algorithm.algo)
    math = "default" if algorithm is None else algorithm.math
    if dtype == torch.float32 and not allow_tf32:
        math = "fma"
    elif dtype in (torch.float16, torch.bfloat16) and math == "default":
        math = "tensor_op"
    return 4 * algo + _MATHS.index(math)


def canonical_params(weights, num_pseudo_layers: int) -> torch.Tensor:
    """The core's flat buffer from PyTorch's weight list: every pseudo-layer's
    matrices (w_ih, w_hh, w_hr) row-major, then every one's biases (PyTorch's
    gate orders are cuDNN's).

    >>> w = [torch.full((4, 3), 1.), torch.full((4, 1), 2.), torch.full((4,), 3.),
    ...      torch.full((4,), 4.)]
    >>> canonical_params(w, 1).tolist()[:12] == [1.0] * 12
    True"""
    weights = list(weights)
    per = len(weights) // num_pseudo_layers
    if per not in (4, 5) or per * num_pseudo_layers != len(weights):
        raise ValueError(f"canonical_params: expected 4 or 5 tensors per pseudo-layer for "
                         f"{num_pseudo_layers}; received {len(weights)}")
    mats, biases = [], []
    for p in range(num_pseudo_layers):
        w = weights[p * per:(p + 1) * per]
        mats += [w[0].reshape(-1), w[1].reshape(-1)] + ([w[4].reshape(-1)] if per == 5 else [])
        biases += [w[2].reshape(-1), w[3].reshape(-1)]
    return torch.cat(mats + biases)


class CoreCall:
    """One configuration of the core (the fields of `rnnfuse_cudnn_rnn` as
    a list of ints for the custom op, plus dropout and seed)."""

    def __init__(self, kind: str, num_layers: int, units: int, input_size: int, *,
                 directions: int = 1, proj_size: int = 0, algorithm: int = 0,
                 allow_tf32: bool = False, dropout: float = 0.0, seed: int = 0):
        self.ints = [_MODES.index(kind), int(num_layers), int(units), int(proj_size),
                     int(input_size), int(directions), int(algorithm), int(bool(allow_tf32))]
        self.dropout, self.seed = float(dropout), int(seed) & (2**63 - 1)


def _config(ints, dtype: torch.dtype, dropout: float, seed: int):
    mode, layers, units, proj, input_size, dirs, algorithm, tf32 = ints
    return _cuda().RnnConfig.of(_MODES[mode], layers, units, input_size, directions=dirs,
                                proj_size=proj, dtype=_DTYPES[dtype], algorithm=algorithm,
                                allow_tf32=bool(tf32), dropout=dropout, seed=seed)


def _sizes(lib, config, steps: int, batch: int, lengths, stream: int, device) -> tuple[int, int]:
    """(workspace, reserve) bytes, asked once per configuration and shape."""
    key = (config.key(), steps, batch, device.index,
           None if lengths is None else bytes(lengths.numpy().tobytes()))
    with _SIZES_LOCK:
        found = _SIZES.get(key)
    if found is None:
        found = lib.sizes(config, steps, batch,
                          None if lengths is None else lengths.data_ptr(), stream)
        with _SIZES_LOCK:
            _SIZES[key] = found
    return found


_FULL_LENGTHS: dict[tuple, torch.Tensor] = {}


def _full_lengths(x: torch.Tensor) -> torch.Tensor:
    """int32 lengths (all T) for x [T, B, F] on its device: made once per shape
    for eager calls (the core only reads them); a trace makes its own."""
    steps, batch = int(x.shape[0]), int(x.shape[1])
    if not runs_eagerly(x):
        return torch.full((batch,), steps, dtype=torch.int32, device=x.device)
    key = (batch, steps, x.device)
    found = _FULL_LENGTHS.get(key)
    if found is None:
        if len(_FULL_LENGTHS) >= 256:  # a long run of new shapes: start over
            _FULL_LENGTHS.clear()
        found = _FULL_LENGTHS[key] = torch.full((batch,), steps, dtype=torch.int32,
                                                device=x.device)
    return found


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _launch(ints, dropout: float, seed: int, x):
    """(library, config, steps, batch, stream) for one call of the core on
    `x` [T, B, D]."""
    lib = _cuda().load()
    return (lib, _config(ints, x.dtype, dropout, seed), int(x.shape[0]), int(x.shape[1]),
            launch_stream(x.device))


def core_forward(ints: list[int], dropout: float, seed: int, training: bool, x, hx, cx, params,
                 lengths, dev_lengths):
    """The core's forward: (y [T, B, D*R], hy, cy, reserve uint8); `lengths`
    on the host, `dev_lengths` on the device (or None); cx and cy are empty
    but for an LSTM."""
    lib, config, steps, batch, stream = _launch(ints, dropout, seed, x)
    work, reserve_bytes = _sizes(lib, config, steps, batch, lengths, stream, x.device)
    lstm = ints[0] == 0
    out = (ints[3] or ints[2]) * ints[5]
    y = x.new_empty((steps, batch, out))
    hy = torch.empty_like(hx)
    cy = torch.empty_like(cx) if lstm else x.new_empty((0,))
    workspace = torch.empty(work, dtype=torch.uint8, device=x.device)
    reserve = torch.empty(reserve_bytes if training else 0, dtype=torch.uint8, device=x.device)
    lib.forward(config, training, steps, batch,
                host_lengths=None if lengths is None else lengths.data_ptr(),
                dev_lengths=dev_lengths.data_ptr(), stream=stream, x=x.data_ptr(),
                hx=_ptr(hx), cx=_ptr(cx) if lstm else 0, params=params.data_ptr(),
                y=y.data_ptr(), hy=hy.data_ptr(), cy=_ptr(cy), workspace=workspace.data_ptr(),
                workspace_bytes=work, reserve=_ptr(reserve), reserve_bytes=reserve.numel())
    return y, hy, cy, reserve


def core_backward(ints: list[int], dropout: float, seed: int, x, hx, cx, params, lengths,
                  dev_lengths, y, dy, dhy, dcy, reserve):
    """The core's backward data then backward weights: (dx, dhx, dcx, dparams)."""
    lib, config, steps, batch, stream = _launch(ints, dropout, seed, x)
    work, reserve_bytes = _sizes(lib, config, steps, batch, lengths, stream, x.device)
    lstm = ints[0] == 0
    dx, dhx = torch.empty_like(x), torch.empty_like(hx)
    dcx = torch.empty_like(cx) if lstm else x.new_empty((0,))
    dparams = torch.empty_like(params)
    workspace = torch.empty(work, dtype=torch.uint8, device=x.device)
    host = None if lengths is None else lengths.data_ptr()
    common = dict(host_lengths=host, dev_lengths=dev_lengths.data_ptr(), stream=stream,
                  workspace=workspace.data_ptr(), workspace_bytes=work,
                  reserve=reserve.data_ptr(), reserve_bytes=reserve.numel())
    # cuDNN writes into the reserve space here (as PyTorch's and TensorFlow's
    # own backward calls do): the forward's reserve has no other reader.
    lib.backward_data(config, steps, batch, y=y.data_ptr(), dy=dy.data_ptr(), dhy=_ptr(dhy),
                      dcy=_ptr(dcy) if lstm else 0, hx=_ptr(hx), cx=_ptr(cx) if lstm else 0,
                      params=params.data_ptr(), dx=dx.data_ptr(), dhx=dhx.data_ptr(),
                      dcx=_ptr(dcx), **common)
    lib.backward_weights(config, steps, batch, x=x.data_ptr(), hx=_ptr(hx), y=y.data_ptr(),
                         dparams=dparams.data_ptr(), **common)
    return dx, dhx, dcx, dparams


@torch.library.custom_op("rnnfuse::cudnn_rnn", mutates_args=())
def _rnn_op(x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor, params: torch.Tensor,
            lengths: Optional[torch.Tensor], dev_lengths: torch.Tensor, ints: list[int],
            dropout: float, seed: int, training: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return core_forward(ints, dropout, seed, training, x, hx, cx, params, lengths, dev_lengths)


def reserve_bytes(ints: list[int], dropout: float, seed: int, training: bool, x) -> int:
    """The reserve bytes of a call on `x` [T, B, D], full lengths (a trace's)."""
    if not training:
        return 0
    lib, config, steps, batch, stream = _launch(ints, dropout, seed, x)
    return _sizes(lib, config, steps, batch, None, stream, x.device)[1]


@_rnn_op.register_fake
def _(x, hx, cx, params, lengths, dev_lengths, ints, dropout, seed, training):
    out = (ints[3] or ints[2]) * ints[5]
    cy = torch.empty_like(cx) if ints[0] == 0 else x.new_empty((0,))
    size = (torch.library.get_ctx().new_dynamic_size() if lengths is not None
            else reserve_bytes(ints, dropout, seed, training, x))
    reserve = x.new_empty((size,), dtype=torch.uint8)
    return x.new_empty((x.shape[0], x.shape[1], out)), torch.empty_like(hx), cy, reserve


@torch.library.custom_op("rnnfuse::cudnn_rnn_backward", mutates_args=())
def _rnn_backward_op(x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor, params: torch.Tensor,
                     lengths: Optional[torch.Tensor], dev_lengths: torch.Tensor,
                     y: torch.Tensor, dy: torch.Tensor, dhy: torch.Tensor, dcy: torch.Tensor,
                     reserve: torch.Tensor, ints: list[int], dropout: float, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return core_backward(ints, dropout, seed, x, hx, cx, params, lengths, dev_lengths, y, dy,
                         dhy, dcy, reserve)


@_rnn_backward_op.register_fake
def _(x, hx, cx, params, lengths, dev_lengths, y, dy, dhy, dcy, reserve, ints, dropout, seed):
    dcx = torch.empty_like(cx) if ints[0] == 0 else x.new_empty((0,))
    return torch.empty_like(x), torch.empty_like(hx), dcx, torch.empty_like(params)


def _setup_context(ctx, inputs, output):
    x, hx, cx, params, lengths, dev_lengths, ints, dropout, seed, training = inputs
    y, _, _, reserve = output
    ctx.save_for_backward(x, hx, cx, params, y, reserve)
    ctx.lengths, ctx.dev_lengths = lengths, dev_lengths
    ctx.args = (list(ints), dropout, seed, training)


def _backward(ctx, dy, dhy, dcy, _dreserve, eager=False):
    x, hx, cx, params, y, reserve = ctx.saved_tensors
    ints, dropout, seed, training = ctx.args
    if not training:
        raise RuntimeError(
            "rnnfuse's cuDNN core ran this call's forward for inference (no reserve space), "
            "so it has no gradient. Fix: run it with training=True (autograd recording)")
    lstm = ints[0] == 0
    dy = torch.zeros_like(y) if dy is None else dy.contiguous()
    dhy = torch.zeros_like(hx) if dhy is None else dhy.contiguous()
    dcy = (torch.zeros_like(cx) if dcy is None else dcy.contiguous()) if lstm else cx
    if eager:
        dx, dhx, dcx, dparams = core_backward(ints, dropout, seed, x, hx, cx, params, ctx.lengths,
                                              ctx.dev_lengths, y, dy, dhy, dcy, reserve)
    else:
        dx, dhx, dcx, dparams = _rnn_backward_op(x, hx, cx, params, ctx.lengths, ctx.dev_lengths,
                                                 y, dy, dhy, dcy, reserve, ints, dropout, seed)
    return dx, dhx, (dcx if lstm else None), dparams, None, None, None, None, None, None


_rnn_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerCall(torch.autograd.Function):
    """`_rnn_op` with its gradient, for a call that runs eagerly on plain
    tensors: the same forward and backward functions, without the custom
    op's dispatch (tens of microseconds of host time a call, each way).
    Traces (torch.compile, export) and fake or meta tensors take the
    custom op (`runs_eagerly`)."""

    @staticmethod
    def forward(ctx, x, hx, cx, params, lengths, dev_lengths, ints, dropout, seed, training,
                packing, *values):
        if packing is not None:
            params = packing.pack()
        output = core_forward(ints, dropout, seed, training, x, hx, cx, params, lengths,
                              dev_lengths)
        _setup_context(ctx, (x, hx, cx, params, lengths, dev_lengths, ints, dropout, seed,
                             training), output)
        ctx.packing = packing
        ctx.mark_non_differentiable(output[3])
        ctx.set_materialize_grads(False)  # None for an unused output, as the custom op's
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dhy, dcy, dreserve):
        grads = _backward(ctx, dy, dhy, dcy, dreserve, eager=True)
        if ctx.packing is None:
            return grads + (None,)
        return grads[:3] + (None,) * 8 + tuple(ctx.packing.gradients(grads[3]))


# `_EagerCall.apply` less Function.apply's Python pass over every argument, which
# unwraps dead functorch wrappers: no plain tensor outside a transform is one.
_eager_apply = super(torch.autograd.Function, _EagerCall).apply


def _apply_eagerly(*args):
    if torch._C._are_functorch_transforms_active():
        return _EagerCall.apply(*args)
    return _eager_apply(*args)


def runs_eagerly(*tensors: torch.Tensor) -> bool:
    """Whether a call on `tensors` runs eagerly on plain tensors or
    Parameters (no trace; no fake, meta or functorch-wrapped tensor): where
    a tensor made once may be kept and reused."""
    if torch.compiler.is_compiling():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(type(t) in _PLAIN and not t.is_meta and not wrapped(t) for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def run(x: torch.Tensor, kind: str, num_layers: int, units: int, params: torch.Tensor,
        hx: torch.Tensor, cx: torch.Tensor | None, lengths: torch.Tensor | None = None, *,
        directions: int = 1, proj_size: int = 0, algorithm: int = 0, allow_tf32: bool = False,
        dropout: float = 0.0, seed: int = 0, training: bool = False):
    """One core call: (y [T, B, D*R], hy [L*D, B, R], cy [L*D, B, H] or None)
    from time-major x, the canonical params, hx, cx, host `lengths` and the
    `algorithm_code`; `training` runs the training forward (reserve, dropout).
    `params` may be a packing of them (`values`, `pack()`, `gradients(grad)`,
    `tensor()`), packed inside an eager call's own autograd node.

    Raises:
        CoreError: the core refused or failed the call."""
    call = CoreCall(kind, num_layers, units, int(x.shape[-1]), directions=directions,
                    proj_size=proj_size, algorithm=algorithm, allow_tf32=allow_tf32,
                    dropout=dropout, seed=seed)
    if lengths is not None:
        lengths = lengths.to(device="cpu", dtype=torch.int32).contiguous()
        dev_lengths = lengths.to(x.device)
    else:
        dev_lengths = _full_lengths(x)
    cx_in = cx.contiguous() if kind == "lstm" else x.new_empty((0,))
    args = (x.contiguous(), hx.contiguous(), cx_in)
    rest = (lengths, dev_lengths, call.ints, call.dropout, call.seed, bool(training))
    packing = None if isinstance(params, torch.Tensor) else params
    if packing is not None and runs_eagerly(*args):
        y, hy, cy, _ = _apply_eagerly(*args, None, *rest, packing, *packing.values)
    else:
        args += ((params if packing is None else packing.tensor()).contiguous(),)
        if runs_eagerly(*args):
            y, hy, cy, _ = _apply_eagerly(*args, *rest, None)
        else:
            y, hy, cy, _ = _rnn_op(*args, *rest)
    return y, hy, (cy if kind == "lstm" else None)
