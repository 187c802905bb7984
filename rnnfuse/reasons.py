"""Records of why: `Reason` (why a layer or link cannot be fused),
`CallPath` (which path a `FusedRNN` call took) and `KernelRun` (which
kernel a fused call ran). A reason is a readable string carrying its
rule's name (`reason.rule`), so code matches on the rule, not the wording.

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
    """Which kernel one fused call ran (`Backend.run_stack` returns it).

    >>> KernelRun("CudnnRNNV3", "standard", "rnnfuse's cuDNN op is turned off").name
    'CudnnRNNV3'
    """

    # The kernel: "RnnfuseCudnnRnn" (rnnfuse's op), "CudnnRNNV3",
    # "torch._VF.lstm", "jax.experimental.rnn.lstm", ...
    name: str
    # "standard", "persistent_static+tc", ...; "runtime" where the step takes it
    # as an input; "" where the framework chooses (torch, JAX).
    algorithm: str = ""
    # Why this is not the kernel or algorithm the plan asked for, or None.
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
    """The path a `FusedRNN` call took: `kind`, for `LAYERS` the reason, for
    `FUSED` the `KernelRun`. A string ("fused", "layers: <why>"); match on
    `.kind`, `.reason.rule` and `.kernel` in code.

    >>> p = CallPath(PathKind.LAYERS, Reason("no_device", "no CUDA GPU"))
    >>> p.kind is PathKind.LAYERS, p.reason.rule, str(p)
    (True, 'no_device', 'layers: no CUDA GPU')
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

