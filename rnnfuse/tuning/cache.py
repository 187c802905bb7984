"""An on-disk cache of tuned plans, so a second `optimize` costs nothing.

One JSON file (default ``~/.cache/rnnfuse/plans.json``, or the folder in
``RNNFUSE_CACHE_DIR``). A key holds everything a decision depends on: the
device (GPU name), the TensorFlow and cuDNN versions, the group's signature
(cell, width, levels per layer, directions, input width, absorbed dropout),
the input shape, the dtype and whether it was tuned for training. A file
that cannot be read, is not JSON, or was written by another cache format is
ignored with a warning (and rewritten on the next save); entries for another
device or version simply never match.

Example:

    >>> import tempfile, pathlib
    >>> cache = PlanCache(pathlib.Path(tempfile.mkdtemp()) / "plans.json")
    >>> cache.put("k", {"plan": {"pieces": [2], "algorithm": None}})
    >>> cache.get("k")["plan"]["pieces"]
    [2]
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import warnings
from typing import Any

__all__ = ["PlanCache", "default_cache_path", "group_signature", "cache_key"]

FORMAT = 1


def default_cache_path() -> pathlib.Path:
    root = os.environ.get("RNNFUSE_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "rnnfuse"
    return base / "plans.json"


def group_signature(group: Any) -> str:
    """What about a group a plan depends on, as a short string."""
    levels = "-".join(str(v.num_levels) for v in group.views) or str(group.num_layers)
    dirs = 2 if group.bidirectional else 1
    rates = ",".join(
        "0" if d is None else f"{float(d.rate):g}" for d in group.gap_dropout
    )
    return (
        f"{group.cell}/u{group.units}/p{group.proj_size}/in{group.input_size}"
        f"/levels{levels}/d{dirs}/drop[{rates}]"
    )


def cache_key(environment: dict, group: Any, shape: tuple, dtype: str, training: bool) -> str:
    env = "|".join(f"{k}={environment[k]}" for k in sorted(environment))
    mode = "train" if training else "infer"
    return f"{env}||{group_signature(group)}||{tuple(shape)}||{dtype}||{mode}"


class PlanCache:
    """A JSON file of tuning decisions."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = pathlib.Path(path) if path is not None else default_cache_path()
        self._entries: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._entries is not None:
            return self._entries
        self._entries = {}
        if not self.path.exists():
            return self._entries
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            warnings.warn(
                f"rnnfuse: ignoring the plan cache {self.path} ({err}); it will "
                "be rewritten",
                RuntimeWarning,
                stacklevel=3,
            )
            return self._entries
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(
            data.get("entries"), dict
        ):
            warnings.warn(
                f"rnnfuse: ignoring the plan cache {self.path}: it is not in "
                f"cache format {FORMAT}; it will be rewritten",
                RuntimeWarning,
                stacklevel=3,
            )
            return self._entries
        self._entries = data["entries"]
        return self._entries

    def get(self, key: str) -> dict | None:
        entry = self._load().get(key)
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, value: dict) -> None:
        entries = self._load()
        entries[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True)
        # Write atomically: a crash mid-write never leaves half a file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plans-")
        with os.fdopen(fd, "w") as f:
            f.write(payload)
        os.replace(tmp, self.path)
