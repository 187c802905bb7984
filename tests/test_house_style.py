"""The code describes the project as it is; its history stays in git.

Comments and string literals (docstrings included) of the Python sources in
rnnfuse/, tests/ and bench/ carry no run dates, no work-session or issue
numbers, no "main at <commit>" and no machine anecdotes ("on the H200").
Measurements belong in docs/benchmarks.md, where they are kept current.
Names in code (a constant holding a device's limits) are not checked.
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("rnnfuse", "tests", "bench")
HERE = pathlib.Path(__file__).resolve()

# Each pattern, and what to write instead.
RULES = (
    (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a run date: say what holds now, or move the number to docs/benchmarks.md"),
    (re.compile(r"\b[Ss]essions? \d+"), "a work-session number: say why, not when"),
    (re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/])#\d{1,4}\b"), "an issue reference: say what the code does and why"),
    (re.compile(r"\bmain at [0-9a-f]{7,40}\b"), "a commit of main: history stays in git"),
    # Not the name of a constant (`library.H200`, `**H200`, "H200" in __all__).
    (re.compile(r"(?<![\w.*\"])H[12]00\b"), "a machine anecdote: say why in a line, the number goes to docs/benchmarks.md"),
)

_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | {
    getattr(tokenize, name) for name in ("FSTRING_MIDDLE",) if hasattr(tokenize, name)
}


def sources() -> list[pathlib.Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if p.resolve() != HERE)


def findings(text: str, name: str = "<text>") -> list[str]:
    """`name:line: what` for every rule a comment or string of `text` breaks.

    >>> findings('x = 1  # 40 ms on the H200\\n', "m.py")
    ['m.py:1: "H200": a machine anecdote: say why in a line, the number goes to docs/benchmarks.md']
    >>> findings('H200 = {"sms": 132}  # a device\\'s limits\\n')
    []
    """
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in _TEXT_TOKENS:
            continue
        for pattern, why in RULES:
            for match in pattern.finditer(tok.string):
                line = tok.start[0] + tok.string.count("\n", 0, match.start())
                out.append(f'{name}:{line}: "{match.group(0)}": {why}')
    return out


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_and_strings_carry_no_history(path):
    found = findings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "history or anecdotes in comments/strings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "# measured 2026-12-02\n",
        "# since session 14\n",
        "# issue 25's target\n",
        "# see #31\n",
        '"""main at 3328dc3"""\n',
        "# 40 ms on the H100\n",
        'x = f"on the H200 {y}"\n',
    ],
)
def test_each_rule_finds_what_it_is_for(text):
    assert findings(text)


def test_code_names_and_plain_comments_pass():
    assert findings("H200 = dict(sms=132)\nh = H200['sms']  # the SM count of the plan\n") == []
    assert findings('__all__ = ["H200"]\n"""\n>>> plan(4, **H200)\n>>> library.H200\n"""\n') == []
    assert findings("x = '#fff'  # a colour, not an issue; 20 steps\n") == []
