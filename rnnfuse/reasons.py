"""Records of why: `Reason` (why a layer or a link cannot be fused) and
`CallPath` (which path a `FusedRNN` call took, and why).

A reason is a plain string a user can read, carrying the name of the rule
that produced it (`reason.rule`), so tools and tests can match on the rule
rather than on the wording.

Example:

    >>> r = Reason("units", "lstm_2 has 16 units, lstm_1 has 32")
    >>> r.rule, str(r)
    ('units', 'lstm_2 has 16 units, lstm_1 has 32')
"""

from __future__ import annotations

import enum

__all__ = ["CallPath", "FUSED_PATH", "FusionWarning", "PathKind", "Reason"]


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


class CallPath(str):
    """The path a `FusedRNN` call took: `kind`, and for `LAYERS` the reason.

    A string ("fused", or "layers: <why>") so it prints and compares as
    before; match on `.kind` and `.reason.rule` in code.

    Example:

        >>> p = CallPath(PathKind.LAYERS, Reason("no_device", "no GPU visible to the backend"))
        >>> p.kind is PathKind.LAYERS, p.reason.rule, str(p)
        (True, 'no_device', 'layers: no GPU visible to the backend')
    """

    kind: PathKind
    reason: Reason | None

    def __new__(cls, kind: PathKind, reason: Reason | None = None) -> "CallPath":
        kind = PathKind(kind)
        text = kind.value if reason is None else f"{kind.value}: {reason}"
        obj = super().__new__(cls, text)
        obj.kind = kind
        obj.reason = reason
        return obj

    def __reduce__(self):
        return (CallPath, (self.kind, self.reason))


FUSED_PATH = CallPath(PathKind.FUSED)


class FusionWarning(UserWarning):
    """A group that could not be fused, or a model rnnfuse left as it was."""
