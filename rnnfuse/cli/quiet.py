"""Start-up of a command-line run: logging levels and a quiet TensorFlow.

`-q` shows errors only, the default warnings and the `rnnfuse` logger's
INFO lines, `-v` adds DEBUG, `--debug` TensorFlow's C++ log lines and
other libraries' warnings; rnnfuse's own warnings always show. TensorFlow
writes some C++ log lines while it is imported, before it reads
TF_CPP_MIN_LOG_LEVEL, so without `--debug` `quiet_native_stderr` points
fd 2 at /dev/null and gives `sys.stderr` a copy of the real one.

>>> import logging
>>> verbosity_level(quiet=1, verbose=0) == logging.ERROR
True
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings

__all__ = ["configure_logging", "quiet_native_stderr", "rnnfuse_warnings_logged", "verbosity_level"]

# Environment that quiets TensorFlow's and absl's own logging (read when TF
# is imported; set only where the user has not set it).
_QUIET_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "GLOG_minloglevel": "3",
    "ABSL_MIN_LOG_LEVEL": "3",
    "GRPC_VERBOSITY": "ERROR",
}


def verbosity_level(*, quiet: int, verbose: int) -> int:
    """The `rnnfuse` logger's level for `-q`/`-v` counts."""
    if quiet:
        return logging.ERROR
    if verbose:
        return logging.DEBUG
    return logging.INFO


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "rnnfuse: "
        if record.levelno >= logging.WARNING:
            prefix += record.levelname.lower() + ": "
        elif record.levelno <= logging.DEBUG:
            prefix += "debug: "
        return prefix + record.getMessage()


def configure_logging(level: int):
    """Sends the `rnnfuse` logger to stderr at `level`.

    Returns a function that puts the logger back as it was (main() calls it
    when the command ends, so an in-process caller's logging is untouched).
    """
    logger = logging.getLogger("rnnfuse")
    before = (logger.level, logger.propagate)
    for old in [h for h in logger.handlers if getattr(h, "_rnnfuse_cli", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(_Formatter())
    handler._rnnfuse_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]

    return restore


class _CurrentStderr(io.TextIOBase):
    """Writes to whatever sys.stderr is at the time (pytest swaps it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@contextlib.contextmanager
def quiet_native_stderr(debug: bool):
    """Drops native code's writes to fd 2 for the block (not with `debug`).

    Python's sys.stderr keeps writing to the real stderr. Does nothing when
    sys.stderr is not fd 2 (pytest's capture, for example).
    """
    if not debug:
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
    try:
        real = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        real = False
    if debug or not real:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    old_stderr = sys.stderr
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1, encoding=old_stderr.encoding, errors="backslashreplace")
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr.close()
        sys.stderr = old_stderr


@contextlib.contextmanager
def rnnfuse_warnings_logged(debug: bool):
    """For the block: rnnfuse's own warnings become one line each on the
    `rnnfuse` logger, every time they are raised; other Python warnings
    (Keras', TensorFlow's) are hidden unless `debug`."""
    from rnnfuse.reasons import FusionWarning, PlanCacheWarning

    ours = (FusionWarning, PlanCacheWarning)
    with warnings.catch_warnings():  # restores the filters and showwarning
        if not debug:
            warnings.simplefilter("ignore")
        for category in ours:
            warnings.filterwarnings("always", category=category)
        show_others = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, ours):
                show_others(message, category, filename, lineno, file, line)
                return
            text = " ".join(str(message).split()).removeprefix("rnnfuse: ")
            logging.getLogger("rnnfuse").warning(text)

        warnings.showwarning = show
        yield
