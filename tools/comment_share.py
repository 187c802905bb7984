"""Share of a package's Python lines that are comments or docstrings.

    python tools/comment_share.py rnnfuse            # the total
    python tools/comment_share.py rnnfuse --files    # and per file, largest share first

Commentary: whole-line comments and every line of a module, class or
function docstring (its blank lines too); the total: the non-blank lines.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import tokenize


def commentary_lines(text: str) -> tuple[int, int]:
    """(commentary lines, non-blank lines) of one Python source.

    >>> commentary_lines("'''Doc.\\n\\nMore.'''\\n\\n# why\\nx = 1  # trailing\\n")
    (4, 4)
    """
    lines = text.splitlines()
    marked: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip():
            marked.add(tok.start[0])
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                marked.update(range(body[0].lineno, body[0].end_lineno + 1))
    nonblank = {i + 1 for i, line in enumerate(lines) if line.strip()}
    return len(marked), len(nonblank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="rnnfuse")
    parser.add_argument("--files", action="store_true", help="also print each file's share")
    args = parser.parse_args(argv)
    rows = []
    for path in sorted(pathlib.Path(args.package).rglob("*.py")):
        rows.append((path, *commentary_lines(path.read_text(encoding="utf-8"))))
    if args.files:
        for path, c, n in sorted(rows, key=lambda r: -r[1] / max(r[2], 1)):
            print(f"{c / max(n, 1):6.1%} {c:6d} / {n:6d}  {path}")
    c, n = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{args.package}: {c} of {n} non-blank lines are comments or docstrings: {c / n:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
