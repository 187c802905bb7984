"""A stand-in compiler for build tests: no toolchain, every run recorded.

    >>> import pathlib, subprocess, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> cxx = fake_compiler(root, root / "log")
    >>> _ = subprocess.run([str(cxx), "-O2", "-o", str(root / "lib.so")], check=True)
    >>> (root / "log").read_text() == f"built -O2 -o {root / 'lib.so'}\\n", (root / "lib.so").exists()
    (True, True)
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def fake_compiler(root: Path, log: Path, delay: float = 0.0) -> Path:
    """An executable `root`/fake-cxx that, after `delay` seconds, appends
    "built <its arguments>" to `log` and writes its -o file."""
    script = root / "fake-cxx"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        time.sleep({delay})
        with open({str(log)!r}, "a") as f:
            f.write("built " + " ".join(sys.argv[1:]) + "\\n")
        open(sys.argv[sys.argv.index("-o") + 1], "w").write("not really a library")
        """))
    script.chmod(0o755)
    return script
