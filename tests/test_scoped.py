"""rnnfuse.scoped: the one helper for scoped switches."""

from __future__ import annotations

import contextvars

import pytest

from rnnfuse.scoped import scoped

_LEVEL = contextvars.ContextVar("test_level", default="low")


def test_the_value_holds_inside_and_is_undone_however_the_block_ends():
    with scoped(_LEVEL, "high") as value:
        assert value == _LEVEL.get() == "high"
        with scoped(_LEVEL, "top"):
            assert _LEVEL.get() == "top"
        assert _LEVEL.get() == "high"
    with pytest.raises(ZeroDivisionError), scoped(_LEVEL, "high"):
        1 / 0
    assert _LEVEL.get() == "low"
