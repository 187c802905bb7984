"""ctypes binding of librnnfuse_wavefront.so (csrc/wavefront_host.cc).

Framework-free: device pointers and a CUDA stream as integers. `plan()`
says without a GPU whether a stack fits; a refused launch raises
`WavefrontError` and the caller falls back to cuDNN. The `*_reason` checks
and `choose_backward` are shared by every binding.

Example (no GPU needed; builds the library once):

    >>> lib = load()  # doctest: +SKIP
    >>> lib.plan("lstm", 4, 512, 64, 1000, 512, sms=132, smem=232448)  # doctest: +SKIP
    (128, 210432)
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from pathlib import Path
from typing import Callable

__all__ = ["BACKWARDS", "BIDIRECTIONAL", "DTYPES", "FORWARD_VARIANT", "H200", "KINDS",
           "STACK_BACKWARD_VARIANT", "STACK_TIMEOUT_WORD", "BackwardChoice",
           "WavefrontError", "WavefrontLibrary", "backward_reason", "backward_stack_reason",
           "bidirectional_reason",
           "check_backward", "choose_backward", "device_reason", "load", "stack_reason"]

KINDS = ("lstm", "gru")
DTYPES = ("float16", "bfloat16")
# The plan's limits where no device is asked: a 132-SM Hopper GPU's.
H200 = {"sms": 132, "smem": 232448}
_LAYER_FIELDS = ("ctas", "mg", "kg", "ng", "units", "kpad", "smem")

_LOCK = threading.Lock()
_LOADED: dict[str, "WavefrontLibrary"] = {}  # resolved path -> library
# cache folder -> library built there (checking a build runs nvcc)
_BUILT: dict[str, Path | Exception] = {}


class WavefrontError(RuntimeError):
    """The library refused a call; the message says why."""


class WavefrontLibrary:
    """The loaded library (one per path)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        i, p, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        ip = ctypes.POINTER(ctypes.c_int)
        lib.rnnfuse_wf_last_error.restype = ctypes.c_char_p
        lib.rnnfuse_wf_plan.argtypes = [i, i, i, i, i, i, i, i, ip, ip]
        lib.rnnfuse_wf_plan.restype = i
        lib.rnnfuse_wf_plan_layers.argtypes = [i, i, i, i, i, i, i, i, ip]
        lib.rnnfuse_wf_plan_layers.restype = i
        lib.rnnfuse_wf_workspace_bytes.argtypes = [i, i, i, i, i]
        lib.rnnfuse_wf_workspace_bytes.restype = sz
        lib.rnnfuse_wf_device_limits.argtypes = [i, ip, ip, ip, ip]
        lib.rnnfuse_wf_device_limits.restype = i
        lib.rnnfuse_wf_forward.argtypes = [p] + [i] * 7 + [p] * 9 + [i, p, i]
        lib.rnnfuse_wf_forward.restype = i
        lib.rnnfuse_wf_forward_saving.argtypes = [p] + [i] * 7 + [p] * 9 + [i, p, i, p, p]
        lib.rnnfuse_wf_forward_saving.restype = i
        lib.rnnfuse_wf_forward_variant.argtypes = [p] + [i] * 7 + [p] * 9 + [i, i, p, i, p, p]
        lib.rnnfuse_wf_forward_variant.restype = i
        lib.rnnfuse_wf_backward_plan.argtypes = [i, i, i, i, i, ip, ip, ip]
        lib.rnnfuse_wf_backward_plan.restype = i
        lib.rnnfuse_wf_backward_workspace_bytes.argtypes = []
        lib.rnnfuse_wf_backward_workspace_bytes.restype = sz
        lib.rnnfuse_wf_backward_kind.argtypes = [p, i, i, i, i, i] + [p] * 12
        lib.rnnfuse_wf_backward_kind.restype = i
        lib.rnnfuse_wf_backward_stack_plan.argtypes = [i, i, i, i, i, i, ip, ip, ip, i, ip, ip]
        lib.rnnfuse_wf_backward_stack_plan.restype = i
        lib.rnnfuse_wf_backward_stack_workspace_bytes.argtypes = [i, i, i, i]
        lib.rnnfuse_wf_backward_stack_workspace_bytes.restype = sz
        lib.rnnfuse_wf_backward_stack.argtypes = [p] + [i] * 6 + [p] * 12 + [i]
        lib.rnnfuse_wf_backward_stack.restype = i
        lib.rnnfuse_wf_plan_directions.argtypes = [i, i, i, i, i, i, i, i, ip, ip]
        lib.rnnfuse_wf_plan_directions.restype = i
        lib.rnnfuse_wf_directions_workspace_bytes.argtypes = [i]
        lib.rnnfuse_wf_directions_workspace_bytes.restype = sz
        lib.rnnfuse_wf_forward_directions.argtypes = [p] + [i] * 7 + [p] * 11
        lib.rnnfuse_wf_forward_directions.restype = i
        lib.rnnfuse_wf_plan_offsets.argtypes = [i, i, i, i, i, ctypes.POINTER(ctypes.c_longlong)]
        lib.rnnfuse_wf_plan_offsets.restype = i
        lib.rnnfuse_wf_tma_staging.argtypes = [i] * 11 + [ctypes.c_uint, ip, ip,
                                                          ctypes.POINTER(ctypes.c_ulonglong)]
        lib.rnnfuse_wf_tma_staging.restype = i
        self._lib = lib

    def _error(self) -> str:
        return (self._lib.rnnfuse_wf_last_error() or b"").decode(errors="replace")

    def plan(self, kind: str, num_layers: int, units: int, batch: int, steps: int,
             input_size: int, *, sms: int, smem: int) -> tuple[int, int] | str:
        """(CTAs, shared bytes a CTA) of the stack's launch, or why it cannot run."""
        ctas, nbytes = ctypes.c_int(), ctypes.c_int()
        ok = self._lib.rnnfuse_wf_plan(_kind(kind), num_layers, units, batch, steps, input_size,
                                       sms, smem, ctypes.byref(ctas), ctypes.byref(nbytes))
        return (ctas.value, nbytes.value) if ok == 1 else self._error()

    def plan_layers(self, kind: str, num_layers: int, units: int, batch: int, steps: int,
                    input_size: int, *, sms: int, smem: int) -> list[dict] | str:
        """Each layer's plan ({ctas, mg, kg, ng, units, kpad, smem}), or why not."""
        out = (ctypes.c_int * (7 * max(1, num_layers)))()
        ok = self._lib.rnnfuse_wf_plan_layers(_kind(kind), num_layers, units, batch, steps,
                                              input_size, sms, smem, out)
        if ok != 1:
            return self._error()
        return [dict(zip(_LAYER_FIELDS, out[7 * l:7 * l + 7])) for l in range(num_layers)]

    def workspace_bytes(self, num_layers: int, units: int, batch: int, steps: int,
                        elem_bytes: int = 2) -> int:
        """Bytes of workspace one call needs (flags + L-1 sequence buffers)."""
        return int(self._lib.rnnfuse_wf_workspace_bytes(num_layers, units, batch, steps,
                                                        elem_bytes))

    def device(self, ordinal: int = 0) -> dict:
        """{sms, smem, major, minor} of CUDA device `ordinal` (no context needed)."""
        vals = [ctypes.c_int() for _ in range(4)]
        rc = self._lib.rnnfuse_wf_device_limits(ordinal, *[ctypes.byref(v) for v in vals])
        if rc != 0:
            raise WavefrontError(self._error())
        return dict(zip(("sms", "smem", "major", "minor"), (v.value for v in vals)))

    def forward(self, stream: int, dtype: str, kind: str, num_layers: int, units: int,
                batch: int, steps: int, input_size: int, *, xproj: int, params: int, h0: int,
                c0: int, lengths: int | None, y: int, hy: int, cy: int, workspace: int,
                mode: int = 0, trace: int = 0, trace_steps: int = 0, gates_out: int = 0,
                c_out: int = 0, variant: int = 0) -> None:
        """One forward pass (device pointers as ints; see wavefront.cuh).

        `mode`: a debug mode (0 computes the right answer); `variant`: 0, 1, 2 (wgmma), 3 (the h
        values as their own flags), 4 (variant 2 staged by tensor copies) or 5 (4 where it
        takes the stack, else 0);
        `trace`: 0 or a buffer of 2 * trace_steps * 8 uint64 for the timeline;
        `gates_out`, `c_out`: 0, or float32 [L, T, B, 4H] and [L, T, B, H] where
        the forward saves gates and c for `backward`."""
        if dtype not in DTYPES:
            raise WavefrontError(f"the wavefront kernel runs {DTYPES}, not {dtype}")
        rc = self._lib.rnnfuse_wf_forward_variant(
            stream or None, DTYPES.index(dtype), _kind(kind), num_layers, units, batch, steps,
            input_size, xproj, params, h0, c0 or None, lengths or None, y, hy, cy or None,
            workspace, mode, variant, trace or None, trace_steps, gates_out or None,
            c_out or None)
        if rc != 0:
            raise WavefrontError(self._error())

    def backward_plan(self, units: int, batch: int, steps: int, *, sms: int,
                      smem: int) -> dict | str:
        """The backward kernel's launch for one LSTM or GRU layer ({ctas, smem,
        rows}), or why it cannot run.

        >>> load().backward_plan(512, 64, 1000, **H200)  # doctest: +SKIP
        {'ctas': 128, 'smem': 79360, 'rows': 16}"""
        ctas, nbytes, rows = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        ok = self._lib.rnnfuse_wf_backward_plan(units, batch, steps, sms, smem,
                                                ctypes.byref(ctas), ctypes.byref(nbytes),
                                                ctypes.byref(rows))
        if ok != 1:
            return self._error()
        return dict(ctas=ctas.value, smem=nbytes.value, rows=rows.value)

    def backward_workspace_bytes(self) -> int:
        """Bytes of workspace one backward call needs (its flags)."""
        return int(self._lib.rnnfuse_wf_backward_workspace_bytes())

    def backward(self, stream: int, dtype: str, units: int, batch: int, steps: int, *,
                 w_hh: int, gates: int, cseq: int, c0: int, dy: int, dhy: int, dcy: int,
                 lengths: int | None, dgates: int, dh0: int, dc0: int, workspace: int,
                 kind: str = "lstm") -> None:
        """One layer's backward recurrence: float32 dgates [T, B, 4H], dh0 and
        an LSTM's dc0 [B, H]. A GRU's `cseq` is its saved h_{t-1}; c0, dcy, dc0 0."""
        if dtype not in DTYPES:
            raise WavefrontError(f"the wavefront kernel runs {DTYPES}, not {dtype}")
        rc = self._lib.rnnfuse_wf_backward_kind(
            stream or None, DTYPES.index(dtype), _kind(kind), units, batch, steps, w_hh, gates,
            cseq, c0 or None, dy, dhy, dcy or None, lengths or None, dgates, dh0, dc0 or None,
            workspace)
        if rc != 0:
            raise WavefrontError(self._error())


    def backward_stack_plan(self, num_layers: int, units: int, batch: int, steps: int, *,
                            sms: int, smem: int, variant: int = 0) -> dict | str:
        """The one-launch backward's plan for an LSTM stack ({ctas, smem, rows},
        with a `variant` also the planned `variant` and its `chunk`), or why it
        cannot run. No GPU needed.

        >>> load().backward_stack_plan(4, 512, 64, 1000, **H200)  # doctest: +SKIP
        {'ctas': 128, 'smem': 154368, 'rows': 64}"""
        ctas, nbytes, rows = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        planned, chunk = ctypes.c_int(), ctypes.c_int()
        ok = self._lib.rnnfuse_wf_backward_stack_plan(num_layers, units, batch, steps, sms, smem,
                                                      ctypes.byref(ctas), ctypes.byref(nbytes),
                                                      ctypes.byref(rows), int(variant),
                                                      ctypes.byref(planned), ctypes.byref(chunk))
        if ok != 1:
            return self._error()
        out = dict(ctas=ctas.value, smem=nbytes.value, rows=rows.value)
        if variant:
            out.update(variant=planned.value, chunk=chunk.value)
        return out

    def backward_stack_workspace_bytes(self, num_layers: int, units: int, batch: int,
                                       steps: int) -> int:
        """Bytes of workspace one stack backward needs: flags (STACK_TIMEOUT_WORD
        set by a timed-out wait), then float32 dy for the layers below the top."""
        return int(self._lib.rnnfuse_wf_backward_stack_workspace_bytes(num_layers, units, batch,
                                                                       steps))

    def backward_stack(self, stream: int, dtype: str, num_layers: int, units: int, batch: int,
                       steps: int, input_size: int, *, params: int, gates: int, cseq: int,
                       c0: int, dy: int, dhy: int, dcy: int, lengths: int | None, dgates: int,
                       dh0: int, dc0: int, workspace: int, variant: int = 0) -> None:
        """An LSTM stack's backward recurrences in one launch: dgates [L, T, B, 4H]
        and float32 dh0, dc0 [L, B, H]."""
        if dtype not in DTYPES:
            raise WavefrontError(f"the wavefront kernel runs {DTYPES}, not {dtype}")
        if variant not in (0, 1, 2):
            raise WavefrontError(f"backward_stack: variant must be 0, 1 or 2, not {variant!r}")
        rc = self._lib.rnnfuse_wf_backward_stack(
            stream or None, DTYPES.index(dtype), num_layers, units, batch, steps, input_size,
            params, gates, cseq, c0, dy, dhy, dcy, lengths or None, dgates, dh0, dc0, workspace,
            int(variant))
        if rc != 0:
            raise WavefrontError(self._error())

    def plan_directions(self, kind: str, units: int, batch: int, steps: int, input_size: int,
                        *, sms: int, smem: int, directions: int = 2) -> tuple[int, int] | str:
        """(CTAs, shared bytes a CTA) of one bidirectional layer's launch (both
        directions on disjoint CTAs), or why it cannot run. No GPU needed.

        >>> load().plan_directions("lstm", 384, 24, 700, 80, **H200)  # doctest: +SKIP
        (96, 89056)"""
        ctas, nbytes = ctypes.c_int(), ctypes.c_int()
        ok = self._lib.rnnfuse_wf_plan_directions(_kind(kind), directions, units, batch, steps,
                                                  input_size, sms, smem, ctypes.byref(ctas),
                                                  ctypes.byref(nbytes))
        return (ctas.value, nbytes.value) if ok == 1 else self._error()

    def directions_workspace_bytes(self, directions: int = 2) -> int:
        """Bytes of workspace `forward_directions` needs (its flags)."""
        return int(self._lib.rnnfuse_wf_directions_workspace_bytes(directions))

    def plan_offsets(self, kind: str, num_layers: int, units: int, input_size: int, *,
                     independent: bool = False) -> list[dict]:
        """wavefront_plan.h's PlanOffsets of each layer's (`independent`: each
        direction's) weights, for the CPU tests."""
        out = (ctypes.c_longlong * (4 * num_layers))()
        ok = self._lib.rnnfuse_wf_plan_offsets(_kind(kind), int(independent), num_layers, units,
                                               input_size, out)
        if ok != 1:
            raise WavefrontError(self._error())
        return [dict(zip(("w_ih", "w_hh", "b_in", "b_rec"), out[4 * l:4 * l + 4]))
                for l in range(num_layers)]

    def tma_staging(self, kind: str, num_layers: int, units: int, batch: int, steps: int,
                    input_size: int, *, layer: int, step: int, chunk: int, base: int = 0,
                    sms: int, smem: int) -> dict:
        """Variant 4's staging of one chunk as the kernel computes it
        (wavefront.cuh, "Variant 4"), for the CPU tests: {copies: [{map, k,
        row, plane, dst, half}], half_bytes: [2], descs: {(half, warpgroup,
        k-step): descriptor} for a chunk at shared address `base`}."""
        copies, half_bytes = (ctypes.c_int * (6 * 32))(), (ctypes.c_int * 2)()
        descs = (ctypes.c_ulonglong * 128)()
        n = self._lib.rnnfuse_wf_tma_staging(_kind(kind), num_layers, units, batch, steps,
                                             input_size, sms, smem, layer, step, chunk, base,
                                             copies, half_bytes, descs)
        if n < 0:
            raise WavefrontError(self._error())
        fields = ("map", "k", "row", "plane", "dst", "half")
        return {"copies": [dict(zip(fields, copies[6 * i:6 * i + 6])) for i in range(n)],
                "half_bytes": list(half_bytes),
                "descs": {(h, g, j): descs[(2 * h + g) * 32 + j]
                          for h in range(2) for g in range(2) for j in range(32)}}

    def forward_directions(self, stream: int, dtype: str, kind: str, units: int, batch: int,
                           steps: int, input_size: int, *, xproj: int, params: int, h0: int,
                           c0: int, lengths: int | None, y: int, hy: int, cy: int,
                           workspace: int, gates_out: int = 0, c_out: int = 0,
                           directions: int = 2) -> None:
        """One bidirectional layer's directions in one launch: xproj [D, T, B, G*H]
        (direction 1's reversed within each length), params the layer's buffer,
        h0/c0/hy/cy [D, B, H], y [D, T, B, H]."""
        if dtype not in DTYPES:
            raise WavefrontError(f"the wavefront kernel runs {DTYPES}, not {dtype}")
        rc = self._lib.rnnfuse_wf_forward_directions(
            stream or None, DTYPES.index(dtype), _kind(kind), directions, units, batch, steps,
            input_size, xproj, params, h0, c0 or None, lengths or None, y, hy, cy or None,
            workspace, gates_out or None, c_out or None)
        if rc != 0:
            raise WavefrontError(self._error())


# Bidirectional stacks are tuner candidates on the kernel; False keeps them on cuDNN.
BIDIRECTIONAL = True
BIDIRECTIONAL_OFF = ("bidirectional layers on the wavefront kernel are switched off "
                     "(rnnfuse.backends.cuda.library.BIDIRECTIONAL)")


def _hopper(ordinal: int):
    """(library, device `ordinal`'s properties) where the kernel can run
    there, else (None, why not)."""
    try:
        lib = load()
        dev = lib.device(ordinal)
    except Exception as exc:  # noqa: BLE001 - no nvcc, no driver: cuDNN runs
        return None, f"the wavefront kernel is not available: {exc}"
    if dev["major"] != 9:
        return None, (f"the wavefront kernel runs on compute capability 9.0 (Hopper), not "
                      f"{dev['major']}.{dev['minor']}")
    return lib, dev


def bidirectional_reason(kind: str, units: int, batch: int, steps: int, input_size: int,
                         ordinal: int = 0) -> str | None:
    """Why the kernel cannot run a bidirectional stack's layers on device
    `ordinal`, or None: `BIDIRECTIONAL`, the device and each layer's plan.

    >>> reason = bidirectional_reason("lstm", 384, 24, 700, 80)  # None on a Hopper GPU
    >>> reason is None or reason.startswith("the wavefront kernel")
    True"""
    if not BIDIRECTIONAL:
        return BIDIRECTIONAL_OFF
    lib, dev = _hopper(ordinal)
    if lib is None:
        return dev
    for width in {int(input_size), 2 * int(units)}:
        plan = lib.plan_directions(kind, units, int(batch), int(steps), width, sms=dev["sms"],
                                   smem=dev["smem"])
        if isinstance(plan, str):
            return plan
    return None


def directions_composed_reason(kind: str, units: int, batch: int, steps: int, input_size: int,
                               *, training: bool = False, ordinal: int = 0) -> str | None:
    """Why the TensorFlow and JAX compositions (one-layer calls a direction)
    cannot run: each layer's plan at the input width and 2H (and backward).

    >>> reason = directions_composed_reason("gru", 512, 32, 500, 512, training=True)
    >>> reason is None or isinstance(reason, str)
    True"""
    for width in sorted({int(input_size), 2 * int(units)}):
        reason = device_reason(kind, 1, units, int(batch), int(steps), width, ordinal)
        if reason is not None:
            return reason
    return backward_reason(kind, units, int(batch), int(steps), ordinal) if training else None


# Default variants (wavefront.cuh, "Variants"): another only once shown exact and faster.
# The forward's: variant 4 where it takes the stack, else 0 (kVariantBest).
FORWARD_VARIANT = 5
STACK_BACKWARD_VARIANT = 0

# After kMaxLayers (8) x kFlagStride (256) flag words: the timed-out word.
STACK_TIMEOUT_WORD = 8 * 256


def _kind(kind: str) -> int:
    if kind not in KINDS:
        raise WavefrontError(f"the wavefront kernel runs {KINDS}, not {kind!r}")
    return KINDS.index(kind)


def load(path: str | os.PathLike | None = None) -> WavefrontLibrary:
    """The library at `path`, else $RNNFUSE_WAVEFRONT_LIB, else the cached
    build (building it the first time: rnnfuse.backends.cuda.build)."""
    from rnnfuse.backends.cuda import build

    return build.load_library(path, "RNNFUSE_WAVEFRONT_LIB", _built_library, _LOADED, _LOCK,
                              WavefrontLibrary)


def _built_library() -> Path:
    """The cached build's library (`build.built_once`: every short call in
    the static kernel rule asks)."""
    from rnnfuse.backends.cuda import build

    return build.built_once(_BUILT, _LOCK, build.build_library)


def stack_reason(kind: str, dtype: str, *, directions: int = 1, proj_size: int = 0,
                 summed_inputs: bool = False, dropout: float = 0.0) -> str | None:
    """What the kernel never runs, whatever the shape and the device, or None.

    >>> stack_reason("gru", "float32")
    'the wavefront kernel runs float16 and bfloat16, not float32'
    >>> stack_reason("lstm", "bfloat16") is None
    True"""
    if kind not in KINDS:
        return f"the wavefront kernel runs LSTM and GRU stacks, not {kind}"
    if str(dtype) not in DTYPES:
        return f"the wavefront kernel runs float16 and bfloat16, not {dtype}"
    if directions != 1 or proj_size:
        return "the wavefront kernel runs unidirectional stacks without projections"
    if summed_inputs:
        return "the wavefront kernel reads each layer's output, not summed directions"
    if dropout:
        return "the wavefront kernel runs no dropout between layers"
    return None


def device_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                  input_size: int, ordinal: int = 0) -> str | None:
    """Why the kernel cannot run this stack on device `ordinal` (no library,
    no driver, not Hopper, or the plan's refusal naming the limit), or None."""
    lib, dev = _hopper(ordinal)
    if lib is None:
        return dev
    plan = lib.plan(kind, num_layers, units, int(batch), int(steps), int(input_size),
                    sms=dev["sms"], smem=dev["smem"])
    return plan if isinstance(plan, str) else None


def backward_reason(kind: str, units: int, batch: int, steps: int,
                    ordinal: int = 0) -> str | None:
    """Why the backward kernel cannot run this stack's layers on device
    `ordinal`, or None (training also needs the forward's checks).

    >>> backward_reason("simple_rnn", 64, 8, 10)
    'the wavefront backward kernel runs LSTM and GRU stacks, not simple_rnn'"""
    if kind not in KINDS:
        return f"the wavefront backward kernel runs LSTM and GRU stacks, not {kind}"
    lib = load()
    dev = lib.device(ordinal)
    plan = lib.backward_plan(units, int(batch), int(steps), sms=dev["sms"], smem=dev["smem"])
    return plan if isinstance(plan, str) else None


def backward_stack_reason(kind: str, num_layers: int, units: int, batch: int, steps: int,
                          ordinal: int = 0) -> str | None:
    """Why the one-launch backward cannot run this LSTM stack on device
    `ordinal`, or None (a GRU trains per layer)."""
    if kind != "lstm":
        return "the reverse-wavefront backward runs LSTM stacks only (a GRU runs the per-layer one)"
    lib = load()
    dev = lib.device(ordinal)
    plan = lib.backward_stack_plan(num_layers, units, int(batch), int(steps), sms=dev["sms"],
                                   smem=dev["smem"])
    return plan if isinstance(plan, str) else None


# "auto": "stack" where `backward_stack_reason` accepts the stack, else "layer".
BACKWARDS = ("auto", "layer", "stack")


@dataclasses.dataclass(frozen=True)
class BackwardChoice:
    """Which backward an LSTM stack's training call runs, and why.

    >>> BackwardChoice("layer", "auto", "too many CTAs").note
    'per-layer backward (v1): too many CTAs'"""

    backward: str  # what runs: "stack" (one launch) or "layer"
    requested: str  # "auto", "layer" or "stack"
    reason: str | None = None  # why "auto" did not pick "stack"

    @property
    def note(self) -> str:
        """One line for a user: which backward runs, and why "auto" fell back."""
        if self.backward == "stack":
            return "reverse-wavefront backward (v2, one launch for every layer)"
        return "per-layer backward (v1)" + (f": {self.reason}" if self.reason else "")


def check_backward(backward: object, where: str = "backward") -> str:
    """`backward` if it is one of BACKWARDS, else a ValueError naming `where`.

    >>> check_backward("stack")
    'stack'"""
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise ValueError(f"{where} must be one of {BACKWARDS} (\"auto\": the reverse-wavefront "
                         f"backward where its plan accepts the stack, else the per-layer one); "
                         f"received {backward!r}")
    return backward


def choose_backward(backward: str, kind: str, num_layers: int, units: int, batch: int,
                    steps: int, ordinal: int = 0, *, unavailable: str | None = None,
                    stack_reason: Callable[..., str | None] | None = None) -> BackwardChoice:
    """The backward a training call runs: "layer" or "stack" as asked; "auto"
    is "stack" where `stack_reason` accepts this stack on device `ordinal`,
    else "layer" with the refusal as the reason (`unavailable`: the
    binding's reason no kernel runs here). "auto" never raises.

    >>> choose_backward("auto", "lstm", 4, 512, 64, 1000,
    ...                 stack_reason=lambda *a: None).backward
    'stack'
    >>> choose_backward("auto", "lstm", 7, 320, 8, 10,
    ...                 stack_reason=lambda *a: "too many CTAs").reason
    'too many CTAs'"""
    check_backward(backward)
    if backward != "auto":
        return BackwardChoice(backward, backward)
    reason = unavailable
    if reason is None:
        try:
            reason = (stack_reason or backward_stack_reason)(kind, num_layers, units, batch,
                                                             steps, ordinal)
        except Exception as exc:  # noqa: BLE001 - no library, no driver: v1 is tried
            reason = f"the reverse-wavefront backward is not available: {exc}"
    return BackwardChoice("layer" if reason else "stack", "auto", reason)
