"""PyTorch backend: a whole stack as one `torch._VF.lstm/gru/rnn_*` call.

Keras variables are `torch.nn.Parameter`s under KERAS_BACKEND=torch; the
weight list is built from them on every call, so gradients and assignments
reach the original layers.

Weight list layout (`nn.LSTM._flat_weights` order), per pseudo-layer
p = (level 0, fwd), (level 0, bwd), (level 1, fwd), ...:

    [w_ih, w_hh, b_ih, b_hh]          (+ [w_hr] for projected LSTMs)

with `n` the pseudo-layer's input width (input_size at level 0, D times the
output width above), `H = units`, `P = proj_size`, `G` gates (4, 3, 1):

- lstm: gate order i, f, c, o in both. w_ih = kernel^T [4H, n], w_hh =
  recurrent_kernel^T [4H, H] (or [4H, P]), b_ih = Keras' bias, b_hh = 0,
  w_hr = projection_kernel^T [P, H].
- gru (reset_after=True): Keras' z, r, h become PyTorch's r, z, n in w_ih,
  w_hh and both rows of Keras' (2, 3H) bias (b_ih row 0, b_hh row 1).
- rnn_tanh / rnn_relu: w_ih = kernel^T, w_hh = recurrent_kernel^T,
  b_ih = Keras' bias, b_hh = 0.

`use_bias=False` gives zero biases. States are [L*D, B, H] (h: [L*D, B, P]
when projected). A level reading a Bidirectional merged by "sum" or "ave"
packs w_ih = [s*W; s*W]^T, s = 1 or 1/2 (see `StackSpec.input_scale`).
A right-padded mask becomes lengths (`pack_padded_sequence`).

Kernels: "cudnn" is rnnfuse's cuDNN core (`cudnn_core`) on CUDA, else
`torch._VF` (the `KernelRun`'s note says why); "stock" is `torch._VF`;
"wavefront" is rnnfuse's wavefront kernel, or "cudnn" where it cannot run
the call. `levels_per_call` splits a stack into calls (`set_call_mode`,
`call_mode()` or RNNFUSE_TORCH_CALLS override it).
Calls on the core read one flat buffer (`cudnn_core.canonical_params`'s
layout), built straight from the variables by `pack_canonical`.

The fused call also runs on the CPU: PyTorch's native kernels run the
whole loop in C++ where Keras' torch backend steps in Python.

Example:

    >>> import keras
    >>> from rnnfuse.backends.base import StackSpec
    >>> cell = keras.layers.GRUCell(4)
    >>> cell.build((None, 3))
    >>> [tuple(w.shape) for w in pack_params(StackSpec("gru", 4, ((cell,),)))]
    [(12, 3), (12, 4), (12,), (12,)]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import warnings
import weakref
from typing import Any, NamedTuple, Sequence

import keras
import numpy as np
import torch
from torch.nn.utils import rnn as rnn_utils

from rnnfuse.backends.base import TUNED_ALGORITHMS as CORE_TUNED_ALGORITHMS
from rnnfuse.backends.base import (GATES, StackCall, StackRun, StackSpec,
                                   run_or_fall_back)
from rnnfuse.backends.cuda.cudnn_core import E_NOT_SUPPORTED, CoreError, prefers_small_h
from rnnfuse.backends.torch import cudnn_core
from rnnfuse.reasons import FusionWarning, KernelRun
from rnnfuse.scoped import checked_choice, scoped

__all__ = [
    "CALL_MODES",
    "call_mode",
    "device_environment",
    "get_call_mode",
    "KERNELS",
    "concrete_bool",
    "is_available",
    "kernel_reason",
    "levels_per_call",
    "mask_is_supported",
    "needs_exact_float32",
    "pack_params",
    "run_stack",
    "set_call_mode",
    "timed_step",
    "torch_rnn",
    "tuned_algorithms",
    "unsupported_reason",
]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")

KERNELS = ("cudnn", "stock", "wavefront")

# "auto": see `levels_per_call`; "one": one call; "per_level": one a level.
CALL_MODES = ("auto", "one", "per_level")
_ENV_VAR = "RNNFUSE_TORCH_CALLS"


def _mode_from_environment() -> str:
    """RNNFUSE_TORCH_CALLS's mode, or "auto" with a `FusionWarning` for
    anything else, so a typo never stops `import rnnfuse`."""
    raw = os.environ.get(_ENV_VAR, "")
    if not raw or raw in CALL_MODES:
        return raw or "auto"
    warnings.warn(
        f"rnnfuse: the environment variable {_ENV_VAR}={raw!r} is not a call "
        f"mode; expected one of {', '.join(repr(m) for m in CALL_MODES)}. Using "
        f"'auto'. Fix: set {_ENV_VAR} to one of those, or unset it",
        FusionWarning,
        stacklevel=2,
    )
    return "auto"


# A new thread starts from RNNFUSE_TORCH_CALLS (read at import).
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "rnnfuse_torch_call_mode", default=_mode_from_environment()
)


def _check_mode(mode: Any, where: str) -> str:
    return checked_choice(mode, CALL_MODES, where, "mode")


def set_call_mode(mode: str) -> None:
    """How `run_stack` splits a stack into `torch._VF` calls (`CALL_MODES`),
    from now on in this thread (or asyncio task); `call_mode()` does it for
    a block.

    Raises:
        ValueError: `mode` is not one of `CALL_MODES`."""
    _MODE.set(_check_mode(mode, "set_call_mode(mode)"))


@torch.compiler.assume_constant_result
def get_call_mode() -> str:
    """The call mode in force here: the innermost `call_mode()` block or
    `set_call_mode` of this thread, else RNNFUSE_TORCH_CALLS's (or "auto")."""
    return _MODE.get()


@contextlib.contextmanager
def call_mode(mode: str):
    """Context manager: calls made in this block, in this thread only, use `mode`.

    Example:

        >>> with call_mode("per_level"):
        ...     get_call_mode()
        'per_level'
        >>> get_call_mode()
        'auto'"""
    with scoped(_MODE, _check_mode(mode, "call_mode(mode)")):
        yield


def concrete_bool(value: Any) -> bool | None:
    """`value` as a Python bool: torch runs eagerly, so it is known."""
    return bool(value)




def tuned_algorithms() -> tuple:
    """CORE_TUNED_ALGORITHMS where rnnfuse's cuDNN core loads on a CUDA
    device, else (None,): `torch._VF` picks cuDNN's algorithm itself."""
    if not torch.cuda.is_available() or cudnn_core.disabled():
        return (None,)
    return CORE_TUNED_ALGORITHMS if cudnn_core.load_failure() is None else (None,)


def is_available() -> bool:
    """Always True: PyTorch runs these ops on CUDA and on the CPU."""
    return True


def device_environment() -> dict:
    """The device and library versions a tuned plan depends on (on the
    CPU with the thread count)."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        device = f"cpu x{torch.get_num_threads()} threads"
    return {
        "device": device,
        "torch": torch.__version__,
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "-",
        "calls": get_call_mode(),
    }


def timed_step(run, x, variables: Sequence[Any], training: bool):
    """A step of `run(x, training)` (+ gradients) for the tuner: a callable
    giving a scalar tensor."""
    params = [getattr(v, "value", v) for v in variables]

    def step():
        if not training:
            with torch.no_grad():
                y = run(x, False)
                return sum(t.float().sum() for t in keras.tree.flatten(y))
        y = run(x, True)
        loss = sum((t.float() ** 2).mean() for t in keras.tree.flatten(y))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach() + sum(g.float().sum() * 0.0 for g in grads if g is not None)

    return step


def unsupported_reason(stack: StackSpec, dtype: str) -> str | None:
    """Why this backend cannot run `stack` in `dtype`, or None."""
    if str(dtype) not in SUPPORTED_DTYPES:
        return (
            f"PyTorch's fused RNNs run {', '.join(SUPPORTED_DTYPES)}, not "
            f"{dtype}; the original layers run instead"
        )
    if stack.proj_size and stack.kind != "lstm":
        return f"PyTorch projects only LSTMs, not {stack.kind}"
    if stack.proj_size and stack.proj_size >= stack.units:
        return (
            f"PyTorch needs proj_size < units; received proj_size="
            f"{stack.proj_size} with units={stack.units}"
        )
    return None


def kernel_reason(kernel: str, group: Any, shape: tuple, training: bool = False) -> str | None:
    """Why plan kernel `kernel` cannot run `group`'s inference (or with
    `training`, training) calls at input `shape` here, or None: the
    wavefront kernels' checks on the device of the group's variables."""
    if kernel != "wavefront":
        return f"the torch backend has no {kernel!r} kernel to time"
    from rnnfuse.backends.torch import wavefront

    batch, steps, features = (int(d) for d in shape[:3])
    device = keras.ops.convert_to_tensor(group.views[0].levels[0][0].kernel).device
    if group.bidirectional:
        # One launch a layer for both directions; training a launch a direction.
        from rnnfuse.backends.torch import wavefront_bidirectional as bidir

        check = bidir.training_reason if training else bidir.unsupported_reason
        return check(group.cell, group.num_layers, group.units, batch, steps, features,
                     _torch_dtype(group.dtype), device, proj_size=group.proj_size)
    check = wavefront.training_reason if training else wavefront.unsupported_reason
    return check(
        group.cell, group.num_layers, group.units, batch, steps, features,
        _torch_dtype(group.dtype), device, directions=2 if group.bidirectional else 1,
        proj_size=group.proj_size)


def mask_is_supported(mask: Any) -> torch.Tensor:
    """True when `mask` [B, T] is right-padded and no sequence is empty."""
    mask = keras.ops.convert_to_tensor(mask).to(torch.bool)
    lengths = mask.sum(dim=1)
    steps = torch.arange(mask.shape[1], device=mask.device)
    right_padded = steps.unsqueeze(0) < lengths.unsqueeze(1)
    return torch.logical_and(
        torch.all(mask == right_padded), torch.all(lengths > 0)
    )


def _tensor(variable: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The variable's live value (the Parameter itself), cast and moved."""
    return keras.ops.convert_to_tensor(variable).to(device=device, dtype=dtype)


def _zrh_to_rzn(x: torch.Tensor, units: int) -> torch.Tensor:
    """Swap the first two gate blocks (Keras z, r -> PyTorch r, z) on axis 0."""
    return torch.cat([x[units : 2 * units], x[:units], x[2 * units :]], dim=0)


def _cell_params(
    kind: str,
    cell: Any,
    dtype: torch.dtype,
    device: torch.device,
    input_scale: float | None = None,
) -> list[torch.Tensor]:
    """[w_ih, w_hh, b_ih, b_hh] (+ [w_hr]) of one pseudo-layer; `input_scale`
    packs the input kernel doubled, [s*W; s*W]."""
    kernel = _tensor(cell.kernel, dtype, device)
    if input_scale is not None:
        half = kernel if input_scale == 1.0 else kernel * input_scale
        kernel = torch.cat([half, half], dim=0)  # [2n, G*H]
    w_ih = kernel.t()  # [G*H, n]
    w_hh = _tensor(cell.recurrent_kernel, dtype, device).t()  # [G*H, H or P]
    rows = int(w_ih.shape[0])
    units = rows // GATES[kind]
    if cell.use_bias:
        bias = _tensor(cell.bias, dtype, device)
    else:
        bias = torch.zeros(
            (2, rows) if kind == "gru" else (rows,), dtype=dtype, device=device
        )
    if kind == "gru":
        w_ih, w_hh = _zrh_to_rzn(w_ih, units), _zrh_to_rzn(w_hh, units)
        bias = bias.reshape(2, rows)
        b_ih, b_hh = _zrh_to_rzn(bias[0], units), _zrh_to_rzn(bias[1], units)
    else:
        b_ih = bias.reshape(rows)
        b_hh = torch.zeros(rows, dtype=dtype, device=device)
    params = [w_ih.contiguous(), w_hh.contiguous(), b_ih, b_hh]
    if getattr(cell, "proj_size", 0):
        params.append(_tensor(cell.projection_kernel, dtype, device).t().contiguous())
    return params


def pack_params(
    stack: StackSpec,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """PyTorch's flat weight list for `stack`, from its live variables:
    4 tensors per pseudo-layer (5 projected), in `torch._VF`'s order.

    Args:
        stack: the levels and cells.
        dtype: the compute dtype (a torch dtype or its name).
        device: where the call runs (default: where the variables are)."""
    dtype = _torch_dtype(dtype)
    if device is None:
        device = keras.ops.convert_to_tensor(stack.cells[0][0].kernel).device
    params = []
    for i, level in enumerate(stack.cells):
        for cell in level:
            params += _cell_params(
                stack.kind, cell, dtype, torch.device(device), stack.input_scale(i)
            )
    return params


def pack_canonical(
    stack: StackSpec,
    dtype: torch.dtype | str,
    device: torch.device | str,
    first: int = 0,
    levels: int | None = None,
) -> torch.Tensor:
    """The core's flat buffer (`cudnn_core.canonical_params` of
    `pack_params`, value for value) for levels [first, first + levels) of
    `stack`, from its live variables in a few copies.

    `canonical_params(pack_params(...))` copies each matrix twice (its
    transpose, then the concatenation) and launches three to five ops per
    pseudo-layer. Here the matrices are transposed views, consecutive ones
    of equal width are concatenated row-wise in one copy, everything else
    joins them in one more, and the result is cast once: the same values
    (cast and copy commute), the same gradients, a few ops per call.

    >>> import keras
    >>> from rnnfuse.backends.torch import cudnn_core
    >>> cell = keras.layers.GRUCell(4)
    >>> cell.build((None, 3))
    >>> stack = StackSpec("gru", 4, ((cell,),))
    >>> flat = pack_canonical(stack, torch.float32, "cpu")
    >>> bool(torch.equal(flat, cudnn_core.canonical_params(pack_params(stack), 1)))
    True
    """
    levels = stack.num_levels - first if levels is None else levels
    read = _reader()
    return _packed(_packing(stack, first, levels, read), stack, _torch_dtype(dtype), device,
                   first, levels, read)


def _packed(packing: "_Packing | None", stack: StackSpec, dtype: torch.dtype, device,
            first: int, levels: int, read) -> torch.Tensor:
    """`pack_canonical`'s buffer, from `packing` where the call has one."""
    if packing is not None:
        return packing.tensor().to(device=torch.device(device), dtype=dtype)
    mats, biases = [], []
    for i in range(first, first + levels):
        for cell in stack.cells[i]:
            _canonical_pieces(stack.kind, cell, stack.input_scale(i), dtype, read, mats, biases)
    flats, group = [], []
    for m in mats + [None]:
        if group and (m is None or m.shape[1] != group[0].shape[1] or m.dtype != group[0].dtype):
            flats.append(group[0].reshape(-1) if len(group) == 1 else torch.cat(group).view(-1))
            group = []
        if m is not None:
            group.append(m)
    return torch.cat(flats + biases).to(device=torch.device(device), dtype=dtype)


_GATHERS: dict[tuple, tuple] = {}


def _core_params(stack: StackSpec, dtype: torch.dtype, device: torch.device, first: int,
                levels: int) -> "torch.Tensor | _Packing":
    """`pack_canonical`'s buffer for a core call, or its `_Packing` where
    the core's own autograd node can pack it (no cast or move)."""
    read = _reader()
    packing = _packing(stack, first, levels, read)
    if packing is None or packing.values[0].dtype != dtype or packing.values[0].device != device:
        return _packed(packing, stack, dtype, device, first, levels, read)
    return packing


def _packing(stack: StackSpec, first: int, levels: int, read) -> "_Packing | None":
    """This call's `_Packing` of `pack_canonical`'s buffer, or None where
    the call keeps the general path."""
    found = _gather_for(stack, first, levels, read)
    if found is None:
        return None
    variables, index, inverse, layout = found
    return _Packing(index, inverse, tuple([read(v) for v in variables]), layout)


class _Packing(NamedTuple):
    """`pack_canonical`'s buffer as `values` flattened after slot 0 (the zero
    every constant bias reads) and gathered by `index`: one copy and one
    gather a call each way. Each element is read once, so its gradient is
    the one value `inverse` gathers back, viewed by `layout` (each value's
    shape, strides and offset: one op a value, where a narrow is two)."""

    index: torch.Tensor
    inverse: torch.Tensor
    values: tuple
    layout: tuple

    def pack(self) -> torch.Tensor:
        """The buffer (not recorded by autograd)."""
        zero = _zeros(1, self.values[0])
        return torch._C._nn.flatten_dense_tensors([zero, *self.values]).index_select(0, self.index)

    def gradients(self, grad: torch.Tensor) -> tuple:
        """The values' gradients from the buffer's."""
        flat = grad.index_select(0, self.inverse)
        return tuple([flat.as_strided(*view) for view in self.layout])

    def tensor(self) -> torch.Tensor:
        """The buffer as one autograd node."""
        return _Gather.apply(self, *self.values)


class _Gather(torch.autograd.Function):
    """`_Packing.tensor`'s autograd node."""

    @staticmethod
    def forward(ctx, packing, *values):
        ctx.packing = packing
        return packing.pack()

    @staticmethod
    def backward(ctx, grad):
        return (None, *ctx.packing.gradients(grad))


def _gather_for(stack: StackSpec, first: int, levels: int, read) -> tuple | None:
    """(variables, index, inverse, layout) of `_Packing`; `index` is
    `pack_canonical`'s own layout, built once per stack, slice and device by
    packing tensors that hold each element's position. None where a call
    keeps the general path: in a trace or a functorch transform, where a
    variable's value is not a plain tensor, or with a doubled input kernel
    (whose halves' gradients sum)."""
    probe = read(stack.cells[first][0].kernel)
    if not cudnn_core.runs_eagerly(probe) or torch._C._are_functorch_transforms_active():
        return None
    key = (id(stack), first, levels, probe.device)
    if key in _GATHERS:
        return _GATHERS[key]
    weakref.finalize(stack, _GATHERS.pop, key, None)  # dropped with its stack
    if any(stack.input_scale(i) is not None for i in range(first, first + levels)):
        _GATHERS[key] = None
        return None
    variables, positions = [], {}

    def read_positions(variable):
        if id(variable) not in positions:
            size = int(np.prod(variable.shape))
            start = 1 + sum(int(np.prod(v.shape)) for v in variables)
            variables.append(variable)
            positions[id(variable)] = torch.arange(
                start, start + size, dtype=torch.float64).reshape(tuple(variable.shape))
        return positions[id(variable)]

    mats, biases = [], []
    for i in range(first, first + levels):
        for cell in stack.cells[i]:
            _canonical_pieces(stack.kind, cell, None, torch.float64, read_positions, mats, biases)
    index = torch.cat([m.reshape(-1) for m in mats] + biases).to(torch.int64)
    reads = index[index > 0] - 1
    if not torch.equal(torch.sort(reads).values, torch.arange(len(reads))):
        _GATHERS[key] = None  # not a permutation of the variables' elements
        return None
    inverse = torch.empty_like(reads)
    inverse[reads] = torch.nonzero(index > 0).reshape(-1)
    offsets = np.cumsum([0] + [int(np.prod(v.shape)) for v in variables]).tolist()
    layout = tuple((tuple(v.shape), torch.empty(tuple(v.shape), device="meta").stride(), at)
                   for v, at in zip(variables, offsets))
    found = _GATHERS[key] = (variables, index.to(probe.device), inverse.to(probe.device), layout)
    return found


_ZEROS: dict[tuple, torch.Tensor] = {}


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    """A constant zero bias (read, never written, no gradient), made once
    (in a trace: made there)."""
    if not cudnn_core.runs_eagerly(like):
        return torch.zeros(n, dtype=like.dtype, device=like.device)
    key = (n, like.dtype, like.device)
    found = _ZEROS.get(key)
    if found is None:
        found = _ZEROS[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
    return found


def _canonical_pieces(kind: str, cell: Any, input_scale: float | None, dtype: torch.dtype,
                      read, mats: list, biases: list) -> None:
    """Appends one pseudo-layer's matrices (w_ih, w_hh[, w_hr] as 2-D views
    [rows, cols]) and biases (1-D) in the layout `_cell_params` gives,
    before the cast (a doubled input kernel is cast first, as `_cell_params`
    casts it: its halves' gradients then sum in `dtype`). GRU gate blocks
    are reordered by one gather per tensor (its gradient one scatter)."""
    kernel = read(cell.kernel)
    if input_scale is not None:
        kernel = kernel.to(dtype)
        half = kernel if input_scale == 1.0 else kernel * input_scale
        kernel = torch.cat([half, half], dim=0)
    recurrent = read(cell.recurrent_kernel)
    rows = int(kernel.shape[1])
    if kind == "gru":
        order = _rzn_order(rows // 3, kernel)
        mats += [kernel.index_select(1, order).t(), recurrent.index_select(1, order).t()]
        if cell.use_bias:
            biases.append(read(cell.bias).reshape(2, rows).index_select(1, order).reshape(-1))
        else:
            biases.append(_zeros(2 * rows, kernel))
    else:
        mats += [kernel.t(), recurrent.t()]
        biases += [read(cell.bias).reshape(rows) if cell.use_bias else _zeros(rows, kernel),
                   _zeros(rows, kernel)]
    if getattr(cell, "proj_size", 0):
        mats.append(read(cell.projection_kernel).t())


_RZN: dict[tuple, torch.Tensor] = {}


def _rzn_order(units: int, like: torch.Tensor) -> torch.Tensor:
    """The gate columns of Keras' z, r, h blocks in PyTorch's r, z, n order
    (`_zrh_to_rzn` as an index) on `like`'s device, made once per width and
    device (in a trace: made there)."""
    def make():
        return torch.cat([torch.arange(units, 2 * units), torch.arange(units),
                          torch.arange(2 * units, 3 * units)]).to(like.device)

    if not cudnn_core.runs_eagerly(like):
        return make()
    key = (units, like.device)
    found = _RZN.get(key)
    if found is None:
        found = _RZN[key] = make()
    return found


def _live(variable: Any) -> torch.Tensor:
    """A variable's live value (the Parameter itself, as `_tensor` reads it,
    without its cast and move: `pack_canonical` does those once)."""
    if isinstance(variable, keras.Variable):
        return variable.value
    return keras.ops.convert_to_tensor(variable)


def _reader():
    """How one packing reads its variables: `_live` (Keras' `value`, which
    checks its scopes on every read: a stateless call's values, autocast's
    casts), or, outside every scope, the Parameter `value` would return,
    read directly (a few microseconds a variable less)."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.common.variables import get_autocast_scope

    if in_stateless_scope() or get_autocast_scope() is not None or str(
            keras.src.backend.torch.core.get_device()) == "meta":
        return _live

    def read(variable):
        value = getattr(variable, "_value", None)
        return value if isinstance(value, torch.Tensor) else _live(variable)

    return read


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype))


def _states(
    given: Sequence[Any] | None,
    stack: StackSpec,
    width: int,
    batch: int,
    like: torch.Tensor,
    shared_zeros: bool = False,
) -> torch.Tensor:
    """[levels * directions, B, width] from per-pseudo-layer states (None: 0);
    `shared_zeros`: all-zero states may be `_zero_states`' (for kernels known
    to only read them)."""
    if not given or all(s is None for s in given):
        if shared_zeros:
            return _zero_states((stack.num_pseudo_layers, batch, width), like)
        return torch.zeros((stack.num_pseudo_layers, batch, width), dtype=like.dtype,
                           device=like.device)
    zeros = torch.zeros((batch, width), dtype=like.dtype, device=like.device)
    given = list(given or [])
    given += [None] * (stack.num_pseudo_layers - len(given))
    return torch.stack(
        [
            zeros
            if s is None
            else keras.ops.convert_to_tensor(s).to(device=like.device, dtype=like.dtype)
            for s in given
        ]
    )


_ZERO_STATES: dict[tuple, torch.Tensor] = {}


def _zero_states(shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """Zero initial states of `shape` for a kernel that only reads them: an
    eager call on plain tensors reads one made once per shape (no
    allocation or fill a call); a trace makes its own."""
    if not cudnn_core.runs_eagerly(like):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    key = (shape, like.dtype, like.device)
    found = _ZERO_STATES.get(key)
    if found is None:
        if len(_ZERO_STATES) >= 256:  # a long run of new shapes: start over
            _ZERO_STATES.clear()
        found = _ZERO_STATES[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
    return found


def _reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverses each x[b, :lengths[b]] in time; padding stays at the end."""
    steps = x.shape[1]
    t = torch.arange(steps, device=x.device).unsqueeze(0)  # [1, T]
    lengths = lengths.to(x.device).unsqueeze(1)  # [B, 1]
    index = torch.where(t < lengths, lengths - 1 - t, t)  # [B, T]
    return torch.gather(x, 1, index.unsqueeze(-1).expand_as(x))


@contextlib.contextmanager
def _quiet_projection_warning(stack: StackSpec, x: torch.Tensor):
    """Hides PyTorch's note that oneDNN has no LSTMP: on the CPU its own
    native kernel runs projected LSTMs, the intended path here."""
    if not stack.proj_size or x.device.type != "cpu":
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="LSTM with projections is not supported with oneDNN"
        )
        yield


@torch.compiler.assume_constant_result  # a trace's constant (the device's properties)
def _persistent_single_layer(kind: str, units: int, batch: int, steps: int, device) -> bool:
    """Whether PyTorch runs a float16 single-layer call on cuDNN's persistent
    kernel (aten/src/ATen/native/cudnn/RNN.cpp's heuristics), for levels
    whose input width is `units`."""
    if not (units <= 1024 and units % 128 == 0):
        return False
    prop = torch.cuda.get_device_properties(device)
    if prop.major == 7:
        if prop.minor == 5:
            return False
        return ((batch % 16 == 0 and batch not in (80, 112)) or batch == 8) and (
            (steps >= 40 and batch <= 128)
            or (steps >= 20 and batch <= 96)
            or (steps >= 10 and batch <= 32)
        )
    if prop.major >= 8 and prop.multi_processor_count >= 98 and prop.minor != 6:
        if kind == "gru":
            return False
        if kind == "lstm":
            return batch % 8 == 0 and batch <= 128
        return batch % 8 == 0 and batch <= 128 and (batch < 96 or units < 896)
    return False


def levels_per_call(stack: StackSpec, x: torch.Tensor, packed: bool) -> int:
    """How many levels each `torch._VF` call runs (the call mode's choice).

    "auto" runs the whole stack in one call, except float16 on CUDA where
    PyTorch picks cuDNN's persistent kernel only for single-layer,
    unidirectional, unpacked calls without projection: its multi-layer call
    is then several times slower than one call a level."""
    mode = get_call_mode()
    if mode == "one" or stack.num_levels == 1:
        return stack.num_levels
    if mode == "per_level":
        return 1
    if (
        x.is_cuda
        and x.dtype == torch.float16
        and not packed
        and stack.num_directions == 1
        and not stack.proj_size
        and _persistent_single_layer(
            stack.kind, stack.units, int(x.shape[0]), int(x.shape[1]), x.device
        )
    ):
        return 1
    return stack.num_levels


def _run_calls(
    stack: StackSpec,
    inputs: torch.Tensor,
    batch_sizes: torch.Tensor | None,
    hx: Any,
    params: list[torch.Tensor],
    dropout: float,
    train: bool,
    per_call: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The stack as ceil(levels / per_call) chained `torch._VF` calls on
    batch-first `inputs`, or packed data with `batch_sizes`; the
    between-level dropout between calls is applied here."""
    lstm = stack.kind == "lstm"
    dirs = stack.num_directions
    per_pseudo = len(params) // stack.num_pseudo_layers
    y, finals = inputs, []
    for first in range(0, stack.num_levels, per_call):
        levels = min(per_call, stack.num_levels - first)
        if first and dropout and train:
            y = torch.nn.functional.dropout(y, dropout, training=True)
        rows = slice(first * dirs, (first + levels) * dirs)
        hx_part = tuple(s[rows] for s in hx) if lstm else hx[rows]
        params_part = params[first * dirs * per_pseudo : (first + levels) * dirs * per_pseudo]
        flags = (True, levels, dropout, train, dirs == 2)  # has_biases, ...
        with _quiet_projection_warning(stack, y):
            if batch_sizes is None:
                result = torch_rnn(stack.kind, y, hx_part, params_part, *flags, True)
            else:
                result = torch_rnn(stack.kind, y, batch_sizes, hx_part, params_part, *flags)
        y = result[0]
        finals.append(result[1:])
    if len(finals) == 1:
        return y, tuple(finals[0])
    return y, tuple(torch.cat(parts) for parts in zip(*finals))


# -- float32 precision: Keras' Python loop computes exact float32 matmuls, while
# cuDNN follows torch.backends.cudnn.allow_tf32 (on by default). The flag is
# process-wide and read when a call (or its backward) sets up, so it is held
# off around both passes of such a call.

class _FlagHolds:
    """Counted holds of cuDNN's TF32 flag at False. Process-wide because the
    flag is, and a hold taken in a forward may end in an autograd thread: the
    first hold saves the user's value, the last release puts it back."""

    def __init__(self):
        self._lock = threading.Lock()
        self.holds = 0
        self._user_value: bool | None = None

    def hold(self) -> None:
        with self._lock:
            if self.holds == 0:
                self._user_value = torch.backends.cudnn.allow_tf32
                torch.backends.cudnn.allow_tf32 = False
            self.holds += 1

    def release(self) -> None:
        with self._lock:
            self.holds -= 1
            if self.holds == 0:
                torch.backends.cudnn.allow_tf32 = self._user_value


_EXACT_FLOAT32 = _FlagHolds()


def _hold_exact_float32() -> None:
    _EXACT_FLOAT32.hold()


def _release_exact_float32() -> None:
    _EXACT_FLOAT32.release()


def needs_exact_float32(stack: StackSpec, x: torch.Tensor, mask: Any) -> bool:
    """Whether this call runs cuDNN without TF32 to follow Keras' loop: float32
    on CUDA with TF32 matmuls off, for `stack.keras_loop` stacks and masked
    LSTM/GRU layers."""
    if not (x.is_cuda and x.dtype == torch.float32):
        return False
    if torch.backends.cuda.matmul.allow_tf32 or not torch.backends.cudnn.allow_tf32:
        return False
    return stack.keras_loop or (mask is not None and not stack.proj_size)


class _Hold:
    """One call's hold on exact float32 in its backward pass, released when
    its graph is freed if the backward stopped between the two nodes."""

    def __init__(self):
        self._state = [False]
        weakref.finalize(self, _release_if_held, self._state)

    @property
    def held(self) -> bool:
        return self._state[0]

    @held.setter
    def held(self, value: bool) -> None:
        self._state[0] = value


def _release_if_held(state: list) -> None:
    if state[0]:
        state[0] = False
        _release_exact_float32()


class _BackwardSwitch(torch.autograd.Function):
    """Identity whose backward takes the hold (on a call's outputs) or
    releases it (on its inputs)."""

    @staticmethod
    def forward(ctx, hold, held, *tensors):
        ctx.hold, ctx.held = hold, held
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.hold.held != ctx.held:
            ctx.hold.held = ctx.held
            (_hold_exact_float32 if ctx.held else _release_exact_float32)()
        return (None, None, *grads)


def _run_calls_exact(stack, inputs, batch_sizes, hx, params, dropout, train, per_call):
    """`_run_calls` with cuDNN's TF32 off in its forward and its backward."""
    lstm = stack.kind == "lstm"
    states = list(hx) if lstm else [hx]
    tensors = [inputs, *states, *params]
    track = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if track:
        hold = _Hold()
        tensors = list(_BackwardSwitch.apply(hold, False, *tensors))
        inputs, states = tensors[0], tensors[1 : 1 + len(states)]
        params = tensors[1 + len(states) :]
        hx = tuple(states) if lstm else states[0]
    _hold_exact_float32()
    try:
        y, finals = _run_calls(stack, inputs, batch_sizes, hx, params, dropout, train, per_call)
    finally:
        _release_exact_float32()
    if track and y.requires_grad:
        out = _BackwardSwitch.apply(hold, True, y, *finals)
        y, finals = out[0], tuple(out[1:])
    return y, finals


def torch_rnn(mode: str, *args):
    """`torch._VF.<mode>(*args)`; one module-level name so tests can spy on it."""
    return getattr(torch._VF, mode)(*args)


def run_stack(sequences: Any, call: StackCall) -> StackRun:
    """Runs `call.stack` over `sequences` [B, T, F] (batch-major, in the
    compute dtype) in one PyTorch RNN call (or one a level, `levels_per_call`).

    How torch reads the `StackCall`'s fields:
        initial_h: h [B, H], or [B, P] when projected.
        dropout: cuDNN's between levels on the core, seeded by seed + seed2 *
            2**31; on `torch._VF` from PyTorch's global RNG.
        algorithm: the core's cuDNN algorithm in both passes (`torch._VF`
            chooses its own).
        kernel: "cudnn", "stock" or "wavefront" (see the module docstring);
            another raises NotImplementedError.
        training: not read: whether autograd records the call decides.

    Returns:
        A `StackRun`: outputs [B, T, D*P'] with zeros past each length, final
        h [L*D, B, P'], final c [L*D, B, H] or None (P' = proj_size or units),
        and the `KernelRun`."""
    if call.kernel not in KERNELS:
        raise NotImplementedError(
            f"the torch backend runs the kernels {list(KERNELS)}, not {call.kernel!r}"
        )
    if call.kernel == "wavefront":
        return _run_wavefront(sequences, call)
    stack, dropout = call.stack, float(call.dropout)
    x = keras.ops.convert_to_tensor(sequences)
    batch, steps = int(x.shape[0]), int(x.shape[1])
    # torch._VF and the cuDNN core only read the initial states.
    hx: Any = _states(call.initial_h, stack, stack.output_size, batch, x, shared_zeros=True)
    if stack.kind == "lstm":
        hx = (hx, _states(call.initial_c, stack, stack.units, batch, x, shared_zeros=True))
    lengths = _short_lengths(call.mask, steps)
    if call.reverse:
        x = torch.flip(x, [1]) if lengths is None else _reverse_within_lengths(x, lengths)
    per_call = levels_per_call(stack, x, packed=lengths is not None)
    exact = needs_exact_float32(stack, x, call.mask)
    core_note = None
    if call.kernel == "cudnn" and core_applies(x):
        core_note = cudnn_core.core_reason(x)
        if core_note is None:
            try:
                return _run_on_core(stack, x, lengths, hx, dropout, call.seed, call.algorithm,
                                    per_call, exact)
            except CoreError as err:
                core_note = f"the cuDNN core refused this call ({err})"
        core_note += "; torch._VF runs it (PyTorch chooses cuDNN's algorithm)"
    if (stack.kind == "lstm" and not x.is_cuda and torch.is_grad_enabled()
            and torch.compiler.is_compiling()):
        raise NotImplementedError(
            "torch.compile cannot differentiate PyTorch's CPU LSTM kernel (mkldnn_rnn_layer)")
    params = pack_params(stack, x.dtype, x.device)
    return _run_on_vf(stack, x, lengths, hx, params, dropout, per_call, exact, core_note)


def _run_wavefront(sequences: Any, call: StackCall) -> StackRun:
    """The "wavefront" kernel, or "cudnn" where it cannot run the call."""
    from rnnfuse.backends.cuda.library import WavefrontError
    from rnnfuse.backends.torch import wavefront, wavefront_bidirectional

    # No wavefront across bidirectional layers: a layer's directions run
    # side by side instead (one after the other for training).
    run = (wavefront_bidirectional.run_stack if call.stack.num_directions == 2
           else wavefront.run_autograd)
    return run_or_fall_back(
        lambda: run(sequences, call),
        lambda: run_stack(sequences, dataclasses.replace(
            call, seed=(0, 0), algorithm=None, kernel="cudnn", training=False)),
        "the wavefront kernel",
        # A launch the driver refuses at run time (the CTAs cannot all
        # be resident) is refused here too: torch runs eagerly.
        errors=(NotImplementedError, WavefrontError),
    )


def _short_lengths(mask: Any, steps: int) -> torch.Tensor | None:
    """The mask's sequence lengths on the host, or None where every
    sequence is `steps` long (no packing needed)."""
    if mask is None:
        return None
    lengths = keras.ops.convert_to_tensor(mask).to(torch.int64).sum(dim=1).cpu()
    return lengths if bool((lengths < steps).any()) else None


def _run_on_vf(stack, x, lengths, hx, params, dropout, per_call, exact, core_note) -> StackRun:
    """`run_stack`'s calls on `torch._VF`, packed where `lengths` is given."""
    lstm = stack.kind == "lstm"
    # cuDNN's backward needs train=True; dropout > 0 only comes when training.
    train = torch.is_grad_enabled() or dropout > 0
    run_calls = _run_calls_exact if exact else _run_calls
    if lengths is None:
        outputs, final = run_calls(stack, x, None, hx, params, dropout, train, per_call)
    else:
        packed = rnn_utils.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        order, restore = packed.sorted_indices, packed.unsorted_indices
        hx_sorted = (
            tuple(s.index_select(1, order) for s in hx) if lstm else hx.index_select(1, order)
        )
        data, final = run_calls(
            stack, packed.data, packed.batch_sizes, hx_sorted, params, dropout, train, per_call
        )
        out = rnn_utils.PackedSequence(data, packed.batch_sizes, order, restore)
        outputs, _ = rnn_utils.pad_packed_sequence(
            out, batch_first=True, total_length=int(x.shape[1]))
        final = tuple(s.index_select(1, restore) for s in final)
    calls = -(-stack.num_levels // per_call)
    note = None if calls == 1 else f"{calls} calls of {per_call} level(s) each"
    ran = KernelRun(f"torch._VF.{stack.kind}", "", note).with_note(core_note)
    return StackRun(outputs, final[0], final[1] if lstm else None, ran)


def core_applies(x: torch.Tensor) -> bool:
    """Whether a "cudnn" call on `x` is meant for rnnfuse's cuDNN core (CUDA);
    the CPU tests make it True to run the core's emulation."""
    return x.is_cuda


def _run_on_core(stack, x, lengths, hx, dropout, seed, algorithm, per_call, exact):
    """`run_stack`'s calls on rnnfuse's cuDNN core, the plan's algorithm in
    both passes. Without one, a narrow state runs persistent static small-h
    and per-level calls persistent static with tensor ops, as PyTorch picks
    them; a masked call runs the standard
    algorithm (the persistent ones refuse padded lengths).

    Raises:
        CoreError: the core refused or failed a call."""
    from rnnfuse.plan import Algorithm

    h0, c0 = hx if stack.kind == "lstm" else (hx, None)
    allow_tf32 = bool(torch.backends.cudnn.allow_tf32) and not exact
    note = None
    if algorithm is None and prefers_small_h(
            stack.kind, stack.units, stack.proj_size, lengths is not None):
        algorithm = Algorithm.parse("persistent_static_small_h")
        note = "PyTorch's choice for this state width: persistent static small-h"
    elif (algorithm is None and per_call == 1 and stack.num_levels > 1
            and get_call_mode() == "auto"):
        algorithm = Algorithm.parse("persistent_static+tc")
        note = "PyTorch's choice for these calls: persistent static, one level a call"
    if lengths is not None and algorithm is not None and not algorithm.is_standard:
        note = "a masked call runs the standard algorithm (padded lengths)"
        algorithm = None
    try:
        return _core_calls(stack, x, lengths, h0, c0, dropout, seed, algorithm, per_call,
                           allow_tf32, note)
    except CoreError as err:
        if algorithm is None or algorithm.is_standard or err.code != E_NOT_SUPPORTED:
            raise
        note = (f"cuDNN refused {algorithm.name} for this call ({err}); the standard "
                "algorithm runs")
        return _core_calls(stack, x, lengths, h0, c0, dropout, seed, None, per_call,
                           allow_tf32, note)


# The name a call without an algorithm reports (the standard one's).
_STANDARD_NAME = "standard"


def _core_calls(stack, x, lengths, h0, c0, dropout, seed, algorithm, per_call,
                allow_tf32, note):
    """`_run_on_core`'s calls with one algorithm (None: standard)."""
    lstm = stack.kind == "lstm"
    dirs = stack.num_directions
    code = cudnn_core.algorithm_code(algorithm, x.dtype, allow_tf32)
    firsts = range(0, stack.num_levels, per_call)
    flats = [_core_params(stack, x.dtype, x.device, first, min(per_call, stack.num_levels - first))
             for first in firsts]
    weights = [t for f in flats for t in (f.values if isinstance(f, _Packing) else (f,))]
    wants_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, h0, *(() if c0 is None else (c0,)), *weights))
    training = wants_grad or dropout > 0
    seed_value = int(seed[0]) + (int(seed[1]) << 31)
    y = x.transpose(0, 1)
    finals = []
    for first, flat in zip(firsts, flats):
        levels = min(per_call, stack.num_levels - first)
        if first and dropout and training:
            y = torch.nn.functional.dropout(y, dropout, training=True)
        rows = slice(first * dirs, (first + levels) * dirs)
        y, hy, cy = cudnn_core.run(
            y, stack.kind, levels, stack.units, flat,
            h0[rows], None if c0 is None else c0[rows], lengths, directions=dirs,
            proj_size=stack.proj_size, algorithm=code, allow_tf32=allow_tf32,
            dropout=dropout, seed=seed_value, training=training)
        finals.append((hy, cy))
    final_h = torch.cat([f[0] for f in finals]) if len(finals) > 1 else finals[0][0]
    final_c = None
    if lstm:
        final_c = torch.cat([f[1] for f in finals]) if len(finals) > 1 else finals[0][1]
    name = _STANDARD_NAME if algorithm is None else algorithm.name
    calls = len(finals)
    if calls > 1:
        split = f"{calls} calls of {per_call} level(s) each"
        note = split if note is None else f"{note}; {split}"
    ran = KernelRun(cudnn_core.KERNEL_NAME, name, note)
    return StackRun(y.transpose(0, 1), final_h, final_c, ran)
