"""tests/conftest.py's markers: by directory, and `slow` from
tests/markers_slow.py (setup.cfg lists them)."""

from __future__ import annotations

import ast
import configparser
import os
import pathlib
import subprocess
import sys

import pytest

from markers_by_directory import backend_markers
from markers_slow import SLOW


@pytest.mark.parametrize(
    "relpath, markers",
    [
        ("test_api.py", ("tensorflow",)),
        ("torch_backend/test_torch_fused.py", ("torch",)),
        ("jax_backend/test_jax_fused.py", ("jax",)),
        ("gpu/test_gpu_fused.py", ("gpu", "tensorflow")),
        ("gpu/test_gpu_torch.py", ("gpu", "torch")),
        ("gpu/test_gpu_distribute_torch.py", ("gpu", "torch")),
        ("gpu/test_gpu_jax.py", ("gpu", "jax")),
    ],
)
def test_markers_follow_the_directory(relpath, markers):
    assert backend_markers(relpath) == markers


def test_this_test_is_marked_and_every_marker_is_declared(request):
    assert request.node.get_closest_marker("tensorflow") is not None
    assert request.node.get_closest_marker("gpu") is None
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"))
    declared = {line.split(":")[0].strip() for line in cfg["tool:pytest"]["markers"].splitlines() if line.strip()}
    assert {"gpu", "tensorflow", "torch", "jax", "slow"} <= declared


TESTS = pathlib.Path(__file__).parent


def _test_functions(relpath: str) -> set[str]:
    tree = ast.parse((TESTS / relpath).read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    }


def test_every_slow_entry_names_a_test_and_says_why():
    for entry, why in SLOW.items():
        relpath, _, test = entry.partition("::")
        assert (TESTS / relpath).is_file(), f"{entry}: no such file"
        assert test.split("[", 1)[0] in _test_functions(relpath), f"{entry}: no such test"
        assert why.strip(), f"{entry}: say why it is slow"


def test_every_collected_test_is_marked_slow_exactly_when_listed(request):
    """Over the tests this run collected (after -m): the marker follows the list."""
    from markers_slow import slow_reason

    for item in request.session.items:
        relpath = pathlib.Path(str(item.fspath)).resolve().relative_to(TESTS.resolve()).as_posix()
        listed = slow_reason(f"{relpath}::{item.nodeid.split('::', 1)[1]}") is not None
        marked = item.get_closest_marker("slow") is not None
        assert marked == listed, item.nodeid


def test_the_slow_marker_selects_exactly_the_listed_tests():
    """`-m slow` collects the listed tests of this backend and nothing else;
    a parametrized entry names an id that exists."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m", "slow", str(TESTS)],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
    )
    collected = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    mine = {
        entry for entry in SLOW
        if backend_markers(entry.partition("::")[0]) == ("tensorflow",)
    }
    for entry in mine:
        matches = [c for c in collected if c == f"tests/{entry}" or c.startswith(f"tests/{entry}[")]
        assert matches, f"{entry} is listed as slow but -m slow collects no such test"
    listed = {f"tests/{e}" for e in SLOW}
    stray = [c for c in collected if c not in listed and c.split("[", 1)[0] not in listed]
    assert not stray, f"marked slow but not in tests/markers_slow.py: {stray}"
