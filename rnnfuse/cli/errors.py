"""The command line's one error type and its one-line formatting.

Example:
    >>> _first_line(ValueError("first\\nsecond"))
    'first'
"""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """A problem with what the user passed: one line, what and how to fix."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
