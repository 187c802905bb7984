"""rnnfuse.cli.quiet and rnnfuse.cli.errors: log levels, the rnnfuse
logger's one-line format, and one-line error text."""

from __future__ import annotations

import logging

from rnnfuse.cli.errors import _first_line, _one_line
from rnnfuse.cli.quiet import configure_logging, quiet_native_stderr, verbosity_level


def test_verbosity_levels():
    assert verbosity_level(quiet=1, verbose=2) == logging.ERROR
    assert verbosity_level(quiet=0, verbose=1) == logging.DEBUG
    assert verbosity_level(quiet=0, verbose=0) == logging.INFO


def test_configure_logging_formats_one_line_and_restores(capsys):
    logger = logging.getLogger("rnnfuse")
    before = (logger.level, logger.propagate, list(logger.handlers))
    restore = configure_logging(logging.INFO)
    try:
        logger.info("fused 2 groups")
        logger.warning("no GPU")
        logger.debug("hidden")
    finally:
        restore()
    err = capsys.readouterr().err
    assert err.splitlines() == ["rnnfuse: fused 2 groups", "rnnfuse: warning: no GPU"]
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_quiet_native_stderr_leaves_a_captured_stderr_alone(capsys):
    import sys

    with quiet_native_stderr(debug=False):
        print("still seen", file=sys.stderr)
    assert "still seen" in capsys.readouterr().err


def test_error_text_is_one_line():
    assert _first_line(ValueError("\n  first  \nsecond")) == "first"
    assert _first_line(ValueError("")) == "ValueError"
    assert _first_line(ValueError("x" * 400), limit=10) == "xxxxxxx..."
    assert _one_line("a\n  b\tc") == "a b c"
