"""An on-disk cache of tuned plans, so a second `optimize` costs nothing.

``plans.json`` in the user cache folder (or ``$RNNFUSE_CACHE_DIR``) files
each decision under a `CacheKey` of all it depends on (device, versions,
group, shape, dtype, mode, masking). Writes are read-modify-write under a
file lock with an atomic replace, so concurrent processes lose no entry.
Damage is set aside, never fatal: a file in no known format is renamed
with a warning, an entry that does not fit its group moves to
``set_aside``, and an unusable location means no cache (`default_cache`).

>>> import tempfile, pathlib
>>> cache = PlanCache(pathlib.Path(tempfile.mkdtemp()) / "plans.json")
>>> key = CacheKey.of({"device": "GPU-A"}, "lstm/u8", (32, 20, 4), "float32", training=True)
>>> cache.put(key, {"plan": {"pieces": [2], "algorithm": None}})
>>> cache.get(key)["plan"]["pieces"]
[2]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import time
import warnings
from typing import Any

from rnnfuse.reasons import PlanCacheWarning

__all__ = ["CacheKey", "PlanCache", "cache_key", "default_cache", "default_cache_path", "group_signature"]

FORMAT = 1
# Seconds a process waits for another's lock before giving up on the cache.
LOCK_TIMEOUT = 60.0


def default_cache_path() -> pathlib.Path:
    """``plans.json`` in ``$RNNFUSE_CACHE_DIR`` or the user cache folder."""
    root = os.environ.get("RNNFUSE_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "plans.json"
    try:
        import platformdirs
    except ImportError:  # pragma: no cover - platformdirs is a dependency
        return pathlib.Path.home() / ".cache" / "rnnfuse" / "plans.json"
    return pathlib.Path(platformdirs.user_cache_dir("rnnfuse", appauthor=False)) / "plans.json"


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


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """What one tuning decision depends on (the cache's key)."""

    # Device and library versions, as sorted (name, value) pairs.
    environment: tuple[tuple[str, str], ...]
    # The group's `group_signature`.
    group: str
    # The group's input shape: (batch, steps, features).
    shape: tuple[int, ...]
    # The compute dtype ("float32", "float16", ...).
    dtype: str
    # Tuned for training steps (forward + backward) or inference.
    training: bool
    # The input carries a padding mask (right-padded lengths), which
    # changes which kernels Keras runs: its own decision.
    masked: bool = False
    # The original layers were timed XLA-compiled (as Keras' `fit` runs them under
    # jit_compile="auto"): the same shape on another path is another decision.
    xla_baseline: bool = False

    @classmethod
    def of(cls, environment: dict, group: Any, shape: tuple, dtype: str, training: bool,
           masked: bool = False, xla_baseline: bool = False) -> "CacheKey":
        """The key of a decision; `group` is a FusionGroup or its signature."""
        return cls(
            environment=tuple(sorted((str(k), str(v)) for k, v in environment.items())),
            group=group if isinstance(group, str) else group_signature(group),
            shape=tuple(int(d) for d in shape),
            dtype=str(dtype),
            training=bool(training),
            masked=bool(masked),
            xla_baseline=bool(xla_baseline),
        )

    @property
    def text(self) -> str:
        """The entry's name in the file (the same text as before keys were
        stored as records, so older files still answer exact lookups)."""
        env = "|".join(f"{k}={v}" for k, v in self.environment)
        mode = "train" if self.training else "infer"
        key = f"{env}||{self.group}||{self.shape}||{self.dtype}||{mode}"
        key = key + "||masked" if self.masked else key
        return key + "||xla" if self.xla_baseline else key

    def other_shape(self, other: "CacheKey") -> bool:
        """Whether `other` is the same decision for another input shape."""
        return dataclasses.replace(other, shape=self.shape) == self and other.shape != self.shape

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["environment"] = dict(self.environment)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CacheKey":
        """The inverse of `to_dict`.

        Raises:
            KeyError, TypeError, ValueError, AttributeError: not a key's dict.
        """
        return cls.of(d["environment"], d["group"], tuple(d["shape"]), d["dtype"],
                      d["training"], d.get("masked", False), d.get("xla_baseline", False))


def cache_key(
    environment: dict, group: Any, shape: tuple, dtype: str, training: bool, masked: bool = False,
    xla_baseline: bool = False,
) -> CacheKey:
    """The cache key of one decision (`CacheKey.of`)."""
    return CacheKey.of(environment, group, shape, dtype, training, masked, xla_baseline)


class PlanCache:
    """A JSON file of tuning decisions, safe for concurrent processes, at
    `path` (default: `default_cache_path()`); a path that is a folder, or
    under a regular file, raises ValueError."""

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = default_cache_path()
        elif isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                "PlanCache(path): expected a file path (str or os.PathLike); "
                f"received {type(path).__name__} {path!r}. Fix: pass a path such "
                "as 'plans.json', cache=False for no cache, or None for the default."
            )
        self.path = pathlib.Path(path)
        _check_location(self.path)
        self._entries: dict[str, Any] | None = None

    # -- reading ---------------------------------------------------------------

    def get(self, key: CacheKey | str) -> dict | None:
        """The entry under `key`, or None."""
        entry = self._loaded().get(_text(key))
        return entry if isinstance(entry, dict) else None

    def entries(self) -> list[tuple[CacheKey, dict]]:
        """Every (key, entry) pair whose key is stored as a record (what
        first-batch tuning reads for the nearest decided shape)."""
        out = []
        for entry in self._loaded().values():
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
                continue
            try:
                out.append((CacheKey.from_dict(entry["key"]), entry))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        return out

    def _loaded(self) -> dict:
        """The entries, read once per PlanCache."""
        if self._entries is None:
            try:
                with self._locked():
                    self._entries = self._read(set_aside_damage=True)["entries"]
            except (OSError, TimeoutError) as err:
                # A folder we may not write (or a lock held too long): read
                # without the lock; damage is then reported, not moved.
                self._warn_unusable("read", err)
                self._entries = self._read(set_aside_damage=False)["entries"]
        return self._entries

    # -- writing ---------------------------------------------------------------

    def put(self, key: CacheKey | str, value: dict) -> None:
        """Stores `value` under `key` (read-modify-write under the lock);
        a `CacheKey` is stored in the entry too (``"key"``)."""
        if isinstance(key, CacheKey):
            value = {**value, "key": key.to_dict()}
        key = _text(key)
        try:
            with self._locked():
                data = self._read(set_aside_damage=True)
                data["entries"][key] = value
                self._write(data)
                self._entries = data["entries"]
        except (OSError, TimeoutError) as err:
            # The decision still applies to this call; only caching fails.
            self._warn_unusable("write", err)
            if self._entries is not None:
                self._entries[key] = value

    def set_aside(self, key: CacheKey | str, reason: str) -> None:
        """Moves the entry under `key` to the file's ``set_aside`` section, with
        a warning giving `reason`; the caller tunes the group again."""
        key = _text(key)
        warnings.warn(
            f"rnnfuse: setting aside the cached plan for this group in "
            f"{self.path} ({reason}); it will be tuned again",
            PlanCacheWarning,
            stacklevel=3,
        )
        try:
            with self._locked():
                data = self._read(set_aside_damage=True)
                entry = data["entries"].pop(key, None)
                if entry is not None:
                    data.setdefault("set_aside", {})[key] = {"entry": entry, "reason": reason}
                    self._write(data)
                self._entries = data["entries"]
        except (OSError, TimeoutError) as err:
            self._warn_unusable("write", err)
            if self._entries is not None:
                self._entries.pop(key, None)

    def _warn_unusable(self, what: str, err: BaseException) -> None:
        warnings.warn(
            f"rnnfuse: could not {what} the plan cache {self.path} under its "
            f"lock ({type(err).__name__}: {err}); tuning decisions are not "
            "shared with other processes. Fix: point RNNFUSE_CACHE_DIR at a "
            "writable folder, or pass cache=False.",
            PlanCacheWarning,
            stacklevel=4,
        )

    # -- the file ----------------------------------------------------------------

    @property
    def _tmp_path(self) -> pathlib.Path:
        return self.path.with_name(self.path.name + ".tmp")

    @contextlib.contextmanager
    def _locked(self):
        """The cache's file lock; removes what a killed writer left."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.path.with_name(self.path.name + ".lock")):
            # Only a lock holder writes the temporary file: one found now
            # belongs to a writer that died before its replace.
            with contextlib.suppress(FileNotFoundError):
                self._tmp_path.unlink()
            yield

    def _read(self, set_aside_damage: bool) -> dict:
        """The file's content (lock held); damage renamed aside with a warning."""
        empty = {"format": FORMAT, "entries": {}}
        if not self.path.exists():
            return empty
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            problem = f"it cannot be read as JSON ({type(err).__name__}: {err})"
        else:
            if (
                isinstance(data, dict)
                and data.get("format") == FORMAT
                and isinstance(data.get("entries"), dict)
            ):
                return data
            problem = f"it is not in cache format {FORMAT}"
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        moved = None
        if set_aside_damage:
            try:
                os.replace(self.path, aside)
                moved = True
            except OSError as err:
                moved = err
        if moved is True:
            what = f"moved it to {aside.name} and starting a new one"
        else:
            why = f" ({type(moved).__name__}: {moved})" if moved is not None else ""
            what = (
                f"could not move it aside{why}, so it stays where it is and is "
                "ignored. Fix: delete it or make its folder writable, point "
                "RNNFUSE_CACHE_DIR at a writable folder, or pass cache=False"
            )
        warnings.warn(
            f"rnnfuse: ignoring the plan cache {self.path}: {problem}; {what}",
            PlanCacheWarning,
            stacklevel=4,
        )
        return empty

    def _write(self, data: dict) -> None:
        """fsync'ed temporary file, then an atomic replace (lock held)."""
        payload = json.dumps(data, indent=1, sort_keys=True)
        tmp = self._tmp_path
        try:
            with open(tmp, "w") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_folder(self.path.parent)


def _text(key: CacheKey | str) -> str:
    return key.text if isinstance(key, CacheKey) else str(key)


def default_cache() -> PlanCache | None:
    """The cache at `default_cache_path()`, or None with one warning naming
    the location and the fix where it cannot hold the file.

    >>> import os, tempfile, warnings
    >>> os.environ["RNNFUSE_CACHE_DIR"] = tempfile.mkstemp()[1]  # a file
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     default_cache() is None, "RNNFUSE_CACHE_DIR" in str(seen[0].message)
    (True, True)
    >>> del os.environ["RNNFUSE_CACHE_DIR"]
    """
    try:
        return PlanCache()
    except ValueError as err:
        root = os.environ.get("RNNFUSE_CACHE_DIR")
        where = (
            f"RNNFUSE_CACHE_DIR={root!r}" if root else "the default plan cache location"
        )
        warnings.warn(
            f"rnnfuse: {where} cannot hold the plan cache ({err}); tuning runs "
            "without a cache, so decisions are timed again in every process. "
            "Fix: point RNNFUSE_CACHE_DIR at a folder (or unset it), or pass "
            "cache=False to say no cache is wanted.",
            PlanCacheWarning,
            stacklevel=3,
        )
        return None


def _check_location(path: pathlib.Path) -> None:
    """A clear error for a cache path that can never hold a file."""
    if path.is_dir():
        raise ValueError(
            f"PlanCache(path): '{path}' is a folder. Fix: pass a file path "
            f"inside it, e.g. '{path / 'plans.json'}'."
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"PlanCache(path): cannot create the plan cache '{path}': "
                    f"'{parent}' is a regular file, not a folder. Fix: choose a "
                    "path under a folder (or cache=False for no cache)."
                )
            break


def _fsync_folder(folder: pathlib.Path) -> None:
    """Makes the replace itself durable where the OS allows (POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """An inter-process lock on `path` (filelock; fcntl where it is missing)."""
    try:
        import filelock
    except ImportError:  # pragma: no cover - filelock is a dependency
        filelock = None
    if filelock is not None:
        with filelock.FileLock(str(path), timeout=LOCK_TIMEOUT):
            yield
        return
    import fcntl  # pragma: no cover

    with open(path, "a") as f:  # pragma: no cover
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
