"""Rewrites the generated rule table in docs/guide.md from the registry.

    python tools/rules_table.py          # rewrite
    python tools/rules_table.py --check  # exit 1 when it differs
"""

from __future__ import annotations

import pathlib
import re
import sys

import rnnfuse.rules

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md"
BLOCK = re.compile(r"(<!-- rules-table:begin -->\n).*?(\n<!-- rules-table:end -->)", re.S)


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + rnnfuse.rules.markdown_table() + m.group(2), text)


def main(argv: list[str]) -> int:
    text = GUIDE.read_text()
    new = render(text)
    if "--check" in argv:
        return 0 if new == text else 1
    GUIDE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
