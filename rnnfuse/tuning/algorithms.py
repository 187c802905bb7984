"""cuDNN RNN algorithms and the environment variables TensorFlow reads.

TensorFlow's CudnnRNNV3 has no algorithm attribute and never autotunes
(CudnnRNNV2, the version it autotunes, fails with "No algorithm worked!" on
cuDNN 9). Its kernel constructor reads three debug variables:

- ``TF_DEBUG_CUDNN_RNN=1`` turns the debug mode on;
- ``TF_DEBUG_CUDNN_RNN_ALGO`` = 0 standard, 1 persistent static,
  2 persistent dynamic (any other value, or none with the debug mode on,
  aborts the process inside TensorFlow, so this module always sets it);
- ``TF_DEBUG_CUDNN_RNN_USE_TENSOR_OPS`` = 0/1.

Only the forward kernel reads them (the backward op keeps the standard
algorithm). `algorithm_env` sets them and restores whatever was there before
(including "unset"); it never leaves a variable set that was not set.

Example:

    >>> import os
    >>> algo = Algorithm.parse("persistent_static+tc")
    >>> with algorithm_env(algo):
    ...     os.environ["TF_DEBUG_CUDNN_RNN_ALGO"]
    '1'
    >>> "TF_DEBUG_CUDNN_RNN" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

__all__ = [
    "Algorithm",
    "algorithm_env",
    "begin_graph_algorithm",
    "end_graph_algorithm",
    "restore_pending",
    "ENV_VARS",
]

ENV_VARS = (
    "TF_DEBUG_CUDNN_RNN",
    "TF_DEBUG_CUDNN_RNN_ALGO",
    "TF_DEBUG_CUDNN_RNN_USE_TENSOR_OPS",
)
_NAMES = {"standard": 0, "persistent_static": 1, "persistent_dynamic": 2}
_LOCK = threading.RLock()


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A cuDNN RNN algorithm and math mode for the fused forward call."""

    # 0 standard, 1 persistent static, 2 persistent dynamic.
    algo: int = 0
    # Whether cuDNN may use tensor-core math (TF32 / fp16 accumulation).
    tensor_ops: bool = False

    def __post_init__(self):
        if self.algo not in (0, 1, 2):
            raise ValueError(
                f"Algorithm.algo must be 0, 1 or 2 (standard, persistent "
                f"static, persistent dynamic); received {self.algo!r}"
            )

    @property
    def name(self) -> str:
        names = {v: k for k, v in _NAMES.items()}
        return names[self.algo] + ("+tc" if self.tensor_ops else "")

    @classmethod
    def parse(cls, text: str) -> "Algorithm":
        """'standard', 'persistent_static+tc', ... -> Algorithm."""
        base, _, suffix = str(text).partition("+")
        if base not in _NAMES or suffix not in ("", "tc"):
            raise ValueError(
                f"unknown cuDNN algorithm {text!r}; expected one of "
                f"{sorted(_NAMES)} with an optional '+tc' (tensor ops)"
            )
        return cls(_NAMES[base], suffix == "tc")

    def env(self) -> dict[str, str]:
        return {
            "TF_DEBUG_CUDNN_RNN": "1",
            "TF_DEBUG_CUDNN_RNN_ALGO": str(self.algo),
            "TF_DEBUG_CUDNN_RNN_USE_TENSOR_OPS": "1" if self.tensor_ops else "0",
        }

    @property
    def kernel_tag(self) -> int:
        """A distinct CudnnRNNV3 `seed2` per algorithm.

        With no dropout the seed is unused; giving each algorithm its own
        value keeps TensorFlow's eager kernel cache from handing back a
        kernel built under another algorithm.
        """
        return 7_000 + 10 * self.algo + int(self.tensor_ops)


def set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Sets (or, for None, removes) variables; returns the previous values."""
    with _LOCK:
        previous = {k: os.environ.get(k) for k in values}
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return previous


@contextlib.contextmanager
def algorithm_env(algorithm: Algorithm | None):
    """Sets the debug variables for `algorithm` (None: leave them) and
    restores the previous environment on exit."""
    if algorithm is None:
        yield
        return
    previous = set_env(algorithm.env())
    try:
        yield
    finally:
        set_env(previous)


# Set by a graph-mode step before the fused op runs, cleared just after it.
# If the op fails in between, the values stay here until `restore_pending`.
_PENDING: list[dict[str, str | None]] = []


def begin_graph_algorithm(algorithm: Algorithm) -> None:
    """Sets `algorithm`'s variables for a graph-mode fused call (see the
    TensorFlow backend); pair with `end_graph_algorithm`."""
    with _LOCK:
        restore_pending()
        _PENDING.append(set_env(algorithm.env()))


def end_graph_algorithm() -> None:
    """Restores what `begin_graph_algorithm` replaced."""
    restore_pending()


def restore_pending() -> bool:
    """Restores variables a failed graph-mode call left set; True if any."""
    with _LOCK:
        if not _PENDING:
            return False
        # The first entry holds what was there before any of them.
        set_env(_PENDING[0])
        _PENDING.clear()
        return True
