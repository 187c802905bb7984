"""Every ```python block of README.md and docs/*.md runs as written.

Blocks of one file run in order in one namespace, like one doctest
session: a block with `>>>` prompts is checked with doctest (its printed
results must match), any other block is executed. A block whose first
line is `# docs-test: skip (why)` is not run, only compiled, and its
mark must give a reason (a GPU, a file, or your own model).
Signatures are in ```text blocks, so they are not code blocks here. Each
file's blocks run in a fresh temporary folder.
"""

from __future__ import annotations

import doctest
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"^# docs-test: skip \((.+)\)\s*$")


def _blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _skip_reason(code: str) -> str | None:
    first = code.splitlines()[0] if code.strip() else ""
    match = _SKIP.match(first)
    return match.group(1) if match else None


SKIPPED = [
    pytest.param(path, line, code, reason, id=f"{path.relative_to(ROOT)}:{line}")
    for path in FILES
    for line, code in _blocks(path)
    if (reason := _skip_reason(code))
]


# The files with a block to run (the others' blocks are all marked skip).
RUNNABLE = [p for p in FILES if any(not _skip_reason(code) for _, code in _blocks(p))]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    parser = doctest.DocTestParser()
    ran = 0
    for line, code in _blocks(path):
        if _skip_reason(code):
            continue
        where = f"{path.relative_to(ROOT)}:{line}"
        if ">>>" in code:
            test = parser.get_doctest(code, namespace, where, str(path), line)
            result = runner.run(test, clear_globs=False)
            assert result.failed == 0, f"{where}: {result.failed} example(s) failed (see output above)"
            namespace.update(test.globs)
        else:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - our own docs
        ran += 1
    assert ran, f"{path.name}: no block ran"


@pytest.mark.parametrize("path, line, code, reason", SKIPPED)
def test_a_block_marked_skip_still_compiles_and_says_why(path, line, code, reason):
    """A block that cannot run here (a GPU, a file, your model) is still
    valid Python, and its mark gives a reason."""
    assert len(reason.split()) >= 2, f"skip mark without a reason: {reason!r}"
    where = f"{path.relative_to(ROOT)}:{line}"
    if ">>>" in code:
        for example in doctest.DocTestParser().get_examples(code):
            compile(example.source, where, "single")
    else:
        compile(code, where, "exec")


def test_every_python_block_is_run_or_marked():
    # No other fence language hides Python from this test.
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^```(py|python3|pycon)\n", text, re.M), path
