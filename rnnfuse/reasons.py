"""`Reason`: why a layer or a link between layers cannot be fused.

A reason is a plain string a user can read, carrying the name of the rule
that produced it (`reason.rule`), so tools and tests can match on the rule
rather than on the wording.

Example:

    >>> r = Reason("units", "lstm_2 has 16 units, lstm_1 has 32")
    >>> r.rule, str(r)
    ('units', 'lstm_2 has 16 units, lstm_1 has 32')
"""

from __future__ import annotations

__all__ = ["Reason"]


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
