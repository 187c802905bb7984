"""The plan cache file (rnnfuse/tuning/cache.py): location, concurrency, damage."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import platformdirs
import pytest

from rnnfuse.tuning.cache import CacheKey, PlanCache, default_cache_path

_ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def test_default_location_is_the_platform_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("RNNFUSE_CACHE_DIR", raising=False)
    expected = pathlib.Path(platformdirs.user_cache_dir("rnnfuse", appauthor=False))
    assert default_cache_path() == expected / "plans.json"
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path))
    assert default_cache_path() == tmp_path / "plans.json"


# The writer processes load cache.py by its path, not through the rnnfuse
# package, whose import loads Keras and TensorFlow (8 s a process here):
# an empty package stands in for rnnfuse, and cache.py and the one module
# it imports (reasons.py) need only the standard library; it is the same code.
_LOAD_CACHE = """
import importlib.util, sys, types
def load(name, relpath):
    spec = importlib.util.spec_from_file_location(name, sys.argv[{root}] + relpath)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
sys.modules["rnnfuse"] = types.ModuleType("rnnfuse")
sys.modules["rnnfuse"].__path__ = []
load("rnnfuse.reasons", "/rnnfuse/reasons.py")
PlanCache = load("plan_cache", "/rnnfuse/tuning/cache.py").PlanCache
assert "keras" not in sys.modules, "the writer imported Keras"
"""

_WRITER = _LOAD_CACHE.format(root=3) + textwrap.dedent(
    """
    path, name = sys.argv[1], sys.argv[2]
    for i in range(int(sys.argv[4])):
        # A new PlanCache per entry, as separate optimize() calls would make.
        PlanCache(path).put(f"{name}-{i}", {"plan": {"pieces": [2], "algorithm": None}})
    """
)


def test_two_writer_processes_lose_no_entry(tmp_path):
    path = tmp_path / "plans.json"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    n = 120
    procs = [
        subprocess.Popen([sys.executable, str(script), str(path), name, _ROOT, str(n)])
        for name in ("a", "b")
    ]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 * n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.json", "plans.json.lock", "writer.py"]


_KILLED = _LOAD_CACHE.format(root=2) + textwrap.dedent(
    """
    import os, time
    cache = PlanCache(sys.argv[1])
    def stuck(*args):  # killed after writing the temporary file
        print("written", flush=True)
        time.sleep(600)
    os.replace = stuck
    cache.put("late", {"plan": {"pieces": [3], "algorithm": None}})
    """
)


def test_a_killed_writer_leaves_no_temporary_file_and_loses_nothing(tmp_path):
    path = tmp_path / "plans.json"
    PlanCache(path).put("early", {"plan": {"pieces": [2], "algorithm": None}})
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), _ROOT], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "written"
    assert (tmp_path / "plans.json.tmp").exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    cache = PlanCache(path)
    assert cache.get("early")["plan"]["pieces"] == [2]  # the old file is whole
    assert cache.get("late") is None
    assert not (tmp_path / "plans.json.tmp").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".plans-")]


def test_a_corrupt_file_is_set_aside_with_a_warning(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="moved it to plans.json.corrupt-"):
        assert PlanCache(path).get("k") is None
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.read_text() == "{not json"
    PlanCache(path).put("k", {"plan": {"pieces": [1], "algorithm": None}})
    assert json.loads(path.read_text())["entries"]["k"]["plan"]["pieces"] == [1]


def test_set_aside_moves_the_entry_with_its_reason(tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    cache.put("k", {"plan": {"pieces": [5], "algorithm": None}})
    with pytest.warns(RuntimeWarning, match="setting aside.*covers 5 layers"):
        cache.set_aside("k", "plan 'fused' covers 5 layers; the group has 2")
    data = json.loads((tmp_path / "plans.json").read_text())
    assert "k" not in data["entries"]
    assert data["set_aside"]["k"]["entry"]["plan"]["pieces"] == [5]
    assert PlanCache(tmp_path / "plans.json").get("k") is None


@pytest.mark.parametrize("bad", [123, 1.5, True, ["plans.json"]])
def test_a_cache_path_that_is_not_a_path_names_what_was_received(bad):
    with pytest.raises(TypeError, match=r"expected a file path.*received"):
        PlanCache(bad)


def test_a_cache_path_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"'.*file' is a regular file, not a folder"):
        PlanCache(tmp_path / "file" / "plans.json")
    with pytest.raises(ValueError, match="is a folder"):
        PlanCache(tmp_path)


def test_a_cache_that_cannot_be_locked_warns_and_optimize_goes_on(tmp_path, monkeypatch):
    from rnnfuse.tuning import cache as cache_module

    path = tmp_path / "plans.json"
    PlanCache(path).put("k", {"plan": {"pieces": [2], "algorithm": None}})

    def denied(lock_path):
        raise PermissionError(13, "Permission denied", str(lock_path))

    monkeypatch.setattr(cache_module, "_file_lock", denied)
    cache = PlanCache(path)
    with pytest.warns(RuntimeWarning, match="could not read the plan cache.*RNNFUSE_CACHE_DIR"):
        assert cache.get("k")["plan"]["pieces"] == [2]
    with pytest.warns(RuntimeWarning, match="could not write the plan cache"):
        cache.put("new", {"plan": {"pieces": [1], "algorithm": None}})
    assert cache.get("new")["plan"]["pieces"] == [1]  # kept for this process


def test_entries_hold_their_key_as_a_record_and_old_entries_still_answer(tmp_path):
    path = tmp_path / "plans.json"
    key = CacheKey.of({"device": "GPU-A", "cudnn": "9"}, "gru/u8", (32, 20, 4), "float16", True, masked=True)
    # A file written before keys were stored as records: the same entry name.
    path.write_text(json.dumps({"format": 1, "entries": {key.text: {"plan": {"pieces": [2], "algorithm": None}}}}))
    cache = PlanCache(path)
    assert cache.get(key)["plan"]["pieces"] == [2]
    assert cache.entries() == []  # no record: exact lookups only
    other = CacheKey.of({"device": "GPU-A", "cudnn": "9"}, "gru/u8", (128, 20, 4), "float16", True, masked=True)
    cache.put(other, {"plan": {"pieces": [], "algorithm": None}})
    ((stored, entry),) = PlanCache(path).entries()
    assert stored == other and entry["plan"]["pieces"] == []
    assert key.other_shape(stored) and not key.other_shape(key)
    assert not key.other_shape(CacheKey.of({"device": "GPU-A", "cudnn": "9"}, "gru/u8", (128, 20, 4), "float16", False, masked=True))


def test_a_decision_timed_against_the_xla_compiled_original_is_its_own_entry(tmp_path):
    env = {"device": "GPU-A", "cudnn": "9"}
    xla = CacheKey.of(env, "lstm/u8", (32, 20, 4), "float16", True, xla_baseline=True)
    graph = CacheKey.of(env, "lstm/u8", (32, 20, 4), "float16", True)
    assert xla.text != graph.text and xla.text.endswith("||xla")
    cache = PlanCache(tmp_path / "plans.json")
    cache.put(xla, {"plan": {"pieces": [2], "algorithm": None}})
    assert cache.get(graph) is None
    ((stored, _),) = PlanCache(tmp_path / "plans.json").entries()
    assert stored == xla and not graph.other_shape(stored)


def _optimize_with_default_cache(monkeypatch, gpu: bool):
    """optimize() through the path that reads the default cache: a tuned
    plan (tune=) on the CPU, or, with a (fake) GPU, first-batch tuning."""
    import warnings

    import rnnfuse
    from builders import stack_model
    from rnnfuse.tuning import first_batch

    model = stack_model("lstm", 2, steps=5)
    if gpu:
        monkeypatch.setattr(first_batch, "device_environment", lambda: {"device": "FakeGPU", "backend": "tensorflow"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if gpu:
            fast = rnnfuse.optimize(model)
        else:
            fast = rnnfuse.optimize(model, tune=rnnfuse.TuneShape(4, 5))
    return fast, [w for w in seen if "plan cache" in str(w.message)]


@pytest.mark.parametrize("gpu", [False, True], ids=["tune=", "first-batch"])
@pytest.mark.parametrize("where", ["RNNFUSE_CACHE_DIR is a file", "plans.json is a folder"])
def test_a_bad_default_cache_location_warns_once_and_optimize_runs_without_a_cache(
    tmp_path, monkeypatch, where, gpu
):
    if where == "plans.json is a folder":
        (tmp_path / "plans.json").mkdir()
        monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path))
    else:
        (tmp_path / "file").write_text("x")
        monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "file"))
    fast, warned = _optimize_with_default_cache(monkeypatch, gpu)
    assert fast is not None
    (warning,) = warned
    text = str(warning.message)
    assert "RNNFUSE_CACHE_DIR=" in text and "without a cache" in text and "Fix:" in text
    if gpu:
        assert fast._rnnfuse_autotune.cache is None


def test_a_corrupt_file_that_cannot_be_moved_is_not_said_to_be_moved(tmp_path, monkeypatch):
    from rnnfuse.tuning import cache as cache_module

    path = tmp_path / "plans.json"
    path.write_text("{not json")

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(cache_module.os, "replace", read_only)
    with pytest.warns(RuntimeWarning) as seen:
        assert PlanCache(path).get("k") is None
    (text,) = [str(w.message) for w in seen if "ignoring the plan cache" in str(w.message)]
    assert "moved it" not in text
    assert "could not move it aside (PermissionError" in text and "Fix:" in text
    assert path.read_text() == "{not json"
