"""Records of why: `Reason` (why a layer or a link cannot be fused),
`CallPath` (which path a `FusedRNN` call took, and why) and `KernelRun`
(which kernel a fused call ran).

A reason is a plain string a user can read, carrying the name of the rule
that produced it (`reason.rule`), so tools and tests can match on the rule
rather than on the wording.

Example:

    >>> r = Reason("units", "lstm_2 has 16 units, lstm_1 has 32")
    >>> r.rule, str(r)
    ('units', 'lstm_2 has 16 units, lstm_1 has 32')
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["CallPath", "FUSED_PATH", "FusionWarning", "KernelRun", "PathKind", "PlanCacheWarning", "Reason"]


class Reason(str):
    """A human-readable reason with the name of the rule behind it."""

    rule: str

    def __new__(cls, rule: str, message: str) -> "Reason":
        obj = super().__new__(cls, message)
        obj.rule = rule
        return obj

    def __reduce__(self):
        return (Reason, (self.rule, str(self)))

    def prefixed(self, prefix: str) -> "Reason":
        """The same rule with `prefix` in front of the message."""
        return Reason(self.rule, f"{prefix}{self}")


class PathKind(str, enum.Enum):
    """How one FusedRNN call ran."""

    # The backend ran the whole stack in one fused call.
    FUSED = "fused"
    # The original layers ran, one after the other (exactly their numbers).
    LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """Which kernel one fused call ran (what `Backend.run_stack` returns
    beside its tensors; decided when the call is traced).

    Example:

        >>> KernelRun("CudnnRNNV3", "standard", "rnnfuse's cuDNN op is turned off").name
        'CudnnRNNV3'
    """

    # The kernel: "RnnfuseCudnnRnn" (rnnfuse's op), "CudnnRNNV3",
    # "torch._VF.lstm", "jax.experimental.rnn.lstm", ...
    name: str
    # Its algorithm: "standard", "persistent_static+tc", ...; "runtime"
    # where the algorithm is an input of the traced step (the tuner's
    # shared step); "" where the framework chooses it (torch, JAX).
    algorithm: str = ""
    # Why this is not the kernel or algorithm the plan asked for (the op
    # not loaded, a persistent algorithm refused under a mask, the
    # wavefront kernel refusing a shape), or None.
    note: str | None = None

    def with_note(self, note: str | None) -> "KernelRun":
        """This record with `note` before its own note (None: unchanged).

        >>> KernelRun("CudnnRNNV3", "standard", "op off").with_note("a training call").note
        'a training call; op off'
        """
        if note is None:
            return self
        return dataclasses.replace(self, note=note if self.note is None else f"{note}; {self.note}")


class CallPath(str):
    """The path a `FusedRNN` call took: `kind`, for `LAYERS` the reason,
    and for `FUSED` the `KernelRun` of the fused call.

    A string ("fused", or "layers: <why>") so it prints and compares as
    before; match on `.kind`, `.reason.rule` and `.kernel` in code.

    Example:

        >>> p = CallPath(PathKind.LAYERS, Reason("no_device", "no CUDA GPU"))
        >>> p.kind is PathKind.LAYERS, p.reason.rule, str(p)
        (True, 'no_device', 'layers: no CUDA GPU')
        >>> CallPath(PathKind.FUSED, kernel=KernelRun("RnnfuseCudnnRnn", "standard")).kernel.name
        'RnnfuseCudnnRnn'
    """

    kind: PathKind
    reason: Reason | None
    kernel: KernelRun | None

    def __new__(cls, kind: PathKind, reason: Reason | None = None,
                kernel: KernelRun | None = None) -> "CallPath":
        kind = PathKind(kind)
        text = kind.value if reason is None else f"{kind.value}: {reason}"
        obj = super().__new__(cls, text)
        obj.kind = kind
        obj.reason = reason
        obj.kernel = kernel
        return obj

    def __reduce__(self):
        return (CallPath, (self.kind, self.reason, self.kernel))


FUSED_PATH = CallPath(PathKind.FUSED)


class FusionWarning(UserWarning):
    """A group that could not be fused, or a model rnnfuse left as it was."""


class PlanCacheWarning(RuntimeWarning):
    """The plan cache could not be read, written or used; tuning goes on
    without it (the message names the fix)."""

